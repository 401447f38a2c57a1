"""``serve --kv-disk PATH --kv-disk-size N --kv-remote redis://HOST:PORT
--kv-offload lazy|eager``: KV tiers below a served engine's page pool
(``mstar.engine.resources.kv.tiers``, docs/kv-tiers.md)."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
DEFAULT_DISK_SIZE = "8G"


def add_tier_options(p: argparse.ArgumentParser) -> None:
    """The tier options of ``serve``."""
    g = p.add_argument_group("KV tiers: pages kept past the pool, a restart and a replica")
    g.add_argument("--kv-disk", metavar="PATH", help="keep evicted KV pages in files under PATH")
    g.add_argument(
        "--kv-disk-size", default=DEFAULT_DISK_SIZE, metavar="BYTES",
        help=f"--kv-disk's budget, e.g. 512M or 20G (default {DEFAULT_DISK_SIZE}; LRU by page)",
    )  # fmt: skip
    g.add_argument(
        "--kv-remote", metavar="URL",
        help="share KV pages through the Valkey/Redis server at redis://HOST:PORT",
    )  # fmt: skip
    g.add_argument(
        "--kv-offload", default="lazy", choices=("lazy", "eager"),
        help="offer a page to the tiers when the pool evicts it (lazy, the default) or as it fills",
    )  # fmt: skip


def parse_size(text: str) -> int:
    """``"512M"`` -> bytes; ``ValueError`` naming the text otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"expected --kv-disk-size a size such as 512M or 20G, got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def tier_options(args: Any, rank: int | None = None) -> dict | None:
    """``attach``'s keyword arguments from ``args`` (None when no tier is
    named); replica ``rank`` keeps its disk pages under ``PATH/replica-RANK``.
    ``ValueError`` naming a bad option."""
    disk, remote = getattr(args, "kv_disk", None), getattr(args, "kv_remote", None)
    if disk is None and remote is None:
        return None
    if getattr(args, "no_prefix_cache", False):
        raise ValueError("--kv-disk/--kv-remote need the prefix cache (drop --no-prefix-cache)")
    if remote is not None and not re.fullmatch(r"(redis|rediss|valkey)://[^/\s]+(/\d+)?", remote):
        raise ValueError(f"expected --kv-remote redis://HOST:PORT, got {remote!r}")
    if disk is not None and rank is not None:
        disk = os.path.join(disk, f"replica-{rank}")
    return {
        "disk": disk,
        "disk_size": parse_size(args.kv_disk_size),
        "remote": remote,
        "offload": args.kv_offload,
    }


def close_tiers(tiers: Any) -> None:
    """At shutdown: the pool's registered pages stored, then the tiers closed."""
    if tiers is not None:
        tiers.flush()
        tiers.close()


def add_restart_options(bench: argparse.ArgumentParser) -> None:
    """``bench --serve --workload shared-prefix --restart``'s options."""
    bench.add_argument(
        "--restart", action="store_true",
        help="--workload shared-prefix: a long context cold, then after a restart (disk tier)"
        " and from a second server (shared store); see docs/kv-tiers.md",
    )  # fmt: skip
    bench.add_argument(
        "--context-tokens", type=int, default=4096, help="--restart: the shared context's tokens"
    )
    bench.add_argument("--kv-store", help="--restart: this store (default: a throwaway one)")
    bench.add_argument(
        "--ray-replicas", action="store_true",
        help="--restart: the cold and second-replica phases on two Ray Serve replicas of one"
        " serve --replicas 2 --router round-robin",
    )  # fmt: skip
