"""KV pages below the pool: a local disk tier and a shared Valkey/Redis tier,
found by the prefix cache's chain keys (see ``tiers.py``, docs/kv-tiers.md)."""

from __future__ import annotations

import os
from typing import Any

from mstar.engine.resources.kv.tiers.codec import model_identity
from mstar.engine.resources.kv.tiers.disk import DiskStore
from mstar.engine.resources.kv.tiers.remote import RemoteStore
from mstar.engine.resources.kv.tiers.tiers import MODES, KVTiers
from mstar.engine.resources.kv.tiers.worker import Store

__all__ = ["MODES", "DiskStore", "KVTiers", "RemoteStore", "attach", "tiers_of"]


def attach(
    engine: Any,
    *,
    disk: str | os.PathLike[str] | None = None,
    disk_size: int = 8 << 30,
    remote: str | None = None,
    offload: str = "lazy",
) -> KVTiers:
    """Put tiers below ``engine``'s page pool: files under ``disk`` in
    ``disk_size`` bytes, and/or the Valkey/Redis server at ``remote``
    (``redis://HOST:PORT``); pages offered when evicted (``offload="lazy"``)
    or as they fill (``"eager"``). ``ValueError`` when the engine cannot use
    them (no prefix cache, tensor parallel) or none is named."""
    if offload not in MODES:
        raise ValueError(f"expected --kv-offload lazy or eager, got {offload!r}")
    if disk is None and remote is None:
        raise ValueError("expected a tier: --kv-disk PATH and/or --kv-remote redis://HOST:PORT")
    if not engine.prefix_cache:
        raise ValueError("expected the prefix cache on for KV tiers, got it off")
    if engine.tp is not None:
        raise ValueError("expected tensor_parallel_size 1 for KV tiers (the cache is on workers)")
    stores: list[Store] = []
    if disk is not None:
        stores.append(DiskStore(disk, disk_size))
    if remote is not None:
        stores.append(RemoteStore(remote))
    pool = engine.mgr.pool
    identity = model_identity(engine.model, engine.cache, pool.page_size)
    tiers = KVTiers(pool, engine.cache, identity, stores, offload)
    pool.tiers = tiers
    engine.admitter.tiers = tiers
    return tiers


def tiers_of(engine: Any) -> KVTiers | None:
    """The tiers ``attach`` put below ``engine``'s pool, if any."""
    return getattr(engine.admitter, "tiers", None)
