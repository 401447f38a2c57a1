"""Building a C++ extension of torch ops at first use: compiled with the
system's compiler for AVX2 (+ FMA, F16C), AVX-512 too where torch sees it
(``flags()``), and OpenMP, cached under the cache
folder (``cache_root() / folder / <stem>_<hash>``: a build is named by a
hash of its source and flags, so a changed source builds afresh and two
trees with different sources never share a build folder), loaded into the
process (its ops registered with torch). Callers keep an aten fallback for
when it does not build."""

from __future__ import annotations

import hashlib
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from mstar.cpu.info import cpu_info

__all__ = ["AMX_FLAGS", "AVX512_FLAGS", "BF16_FLAGS", "FLAGS", "build", "build_or_why", "flags"]

# -fopenmp: without it ATen's headers compile ``at::parallel_for`` serial
# (``INTRA_OP_PARALLEL`` is defined only under ``_OPENMP``); the symbols
# resolve to torch's own OpenMP runtime
CODE = (".py", ".cpp", ".h")  # the sources ``code_digest`` hashes
STALE_LOCK_S = 900  # a build lock older than this was left by a killed build (builds take 1-3 min)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-fopenmp")
# the subset torch's "AVX512" capability requires; sources test __AVX512F__
AVX512_FLAGS = (*FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# and bfloat16 dot products (vdpbf16ps) and byte dot products (vpdpbusd, which every CPU
# with the first has); sources test __AVX512BF16__, __AVX512VNNI__
BF16_FLAGS = (*AVX512_FLAGS, "-mavx512bf16", "-mavx512vnni")
# and AMX's bfloat16 tiles (tdpbf16ps: a 16 x 16 x 32 product an instruction); sources
# test __AMX_BF16__
AMX_FLAGS = (*BF16_FLAGS, "-mamx-tile", "-mamx-bf16")


def flags() -> tuple[str, ...]:
    """The build flags for this CPU: ``AVX512_FLAGS`` where torch runs its
    AVX-512 kernels (``BF16_FLAGS`` where the CPU has AVX512-BF16 and VNNI too,
    ``AMX_FLAGS`` where it has AMX's bfloat16 tiles as well), else ``FLAGS``."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return FLAGS
    cpu = torch.cpu
    if not (cpu._is_avx512_bf16_supported() and cpu._is_vnni_supported()):
        return AVX512_FLAGS
    return AMX_FLAGS if cpu._is_amx_tile_supported() and _amx_bf16() else BF16_FLAGS


def _amx_bf16() -> bool:
    """Whether the CPU lists AMX's bfloat16 tiles (``amx_bf16``; torch probes the tiles alone)."""
    return "amx_bf16" in cpu_info().flags


def build(
    stem: str,
    source: str,
    folder: str,
    cflags: tuple[str, ...] | None = None,
    headers: Mapping[str, str] | None = None,
) -> str:
    """Build (or find built) the C++ ``source`` text, which may include the
    ``headers`` (``{file name: text}``, written beside it), and load it into
    this process with ``cflags`` (``flags()`` unless given); returns the
    build's name (``stem`` and a hash of the source, headers and flags).
    Raises what the build raises."""
    from torch.utils import cpp_extension

    from mstar.cpu.cachedir import cache_root

    cflags = flags() if cflags is None else cflags
    files = {f"{stem}.cpp": source, **(headers or {})}
    texts = [f"{n}\n{t}" for n, t in sorted(files.items())]
    digest = hashlib.sha256("\n".join([*texts, *cflags]).encode()).hexdigest()[:12]
    name = f"{stem}_{digest}"
    where = cache_root() / folder / name
    where.mkdir(parents=True, exist_ok=True)
    for file, text in files.items():
        path = where / file
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    path = where / f"{stem}.cpp"
    _clear_stale_lock(where / "lock")
    cpp_extension.load(
        name=name,
        sources=[str(path)],
        extra_cflags=list(cflags),
        build_directory=str(where),
        is_python_module=False,
    )
    return name


def _clear_stale_lock(lock: Path) -> None:
    """Remove torch's build ``lock`` where a killed build left it (older than
    ``STALE_LOCK_S``: torch would wait on it forever, silently), with a
    warning; say so on stderr where a build now holds it."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
        warnings.warn(
            f"removed {lock}, a build lock {age:.0f} s old (a killed build's)", stacklevel=3
        )
    else:
        print(f"mstar-kv: waiting for the kernels' build holding {lock}", file=sys.stderr)


def build_or_why(
    stem: str, source: str, folder: str, what: str, headers: Mapping[str, str] | None = None
) -> str | None:
    """``build`` with this CPU's flags: None when the ops are loaded, else
    why not (a CPU without AVX2, no compiler, a failed build: "``what`` did
    not build ...")."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch sees {capability})"
    try:
        build(stem, source, folder, headers=headers)
    except Exception as err:  # no compiler, no ninja, a failed build: fall back, say why
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return f"{what} did not build ({type(err).__name__}: {first})"
    return None


def code_digest(*settings: str) -> str:
    """A name for what mstar's own code computes in ``settings``: a hash of
    them, every ``.py``, ``.cpp`` and ``.h`` under ``mstar/`` (~10 ms), the
    kernels' flags and torch's version; a changed line makes a new name."""
    digest = hashlib.sha256("\n".join([*settings, torch.__version__, *flags()]).encode())
    for path in sorted(p for p in Path(__file__).parents[1].rglob("*") if p.suffix in CODE):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
