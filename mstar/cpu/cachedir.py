"""Where mstar-kv keeps what it builds once (a GGUF file's index and
tokenizer, converted models, compiled kernels, inductor's caches):
``$MSTAR_KV_CACHE``, default ``~/.cache/mstar-kv``."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MSTAR_KV_CACHE", Path.home() / ".cache" / "mstar-kv"))


def file_key(path: Path) -> str:
    """A name for what is made from the file ``path``: its stem and a hash
    of its resolved path, size and modification time."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{path.stem}-{key.hexdigest()[:12]}"


def cached(name: str, marker: str, write: Callable[[Path], None]) -> Path:
    """The folder ``name`` under the cache folder, made by ``write`` on first
    use (written aside, then renamed into place, so a reader never sees half
    of it; ``marker``: a file it holds once made)."""
    folder = cache_root() / name
    if (folder / marker).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    try:
        write(scratch)
        scratch.rename(folder)
    except OSError:
        if not (folder / marker).exists():  # not a concurrent writer's win
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder
