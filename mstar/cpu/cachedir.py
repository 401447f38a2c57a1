"""Where mstar-kv keeps what it builds once (converted models, compiled
kernels, inductor's caches): ``$MSTAR_KV_CACHE``, default ``~/.cache/mstar-kv``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MSTAR_KV_CACHE", Path.home() / ".cache" / "mstar-kv"))
