"""The layer ops' decode attention over a float32 and a bfloat16 KV cache.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/kv_attention.py [--rows 1 32]
        [--keys 61 401 1025 2049 4001] [--rounds 20]

This tree's ``attention`` op on SmolLM2's shape (``ab_layer_attention.py``'s:
9 query heads, 3 KV heads of 64, pages of 16 slots, 30 layers' caches with
each row's pages shuffled, so read from memory), the same keys and values
held float32 and rounded to bfloat16, the two in alternating turns: us a
layer (the median of ``--rounds``) and the ratio (float32 / bfloat16). Rows
of more than 40,000 keys in all are left out. Prints the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from ab_layer_attention import DIM, KV_HEADS, LAYERS, PAGE, decode_call

from mstar.cpu.info import cpu_info
from mstar.cpu.layer_ops import layer_ops_or_why


def turns(rows: int, keys: int, rounds: int) -> dict[str, float]:
    """Seconds a layer call takes over each cache dtype (the median of ``rounds``)."""
    pages, (qkv, cos, sin), rest = decode_call(rows, keys)
    floats = [torch.randn(pages, 2, PAGE, KV_HEADS, DIM) for _ in range(LAYERS)]
    caches = {"float32": floats, "bfloat16": [c.bfloat16() for c in floats]}
    times: dict[str, list[float]] = {name: [] for name in caches}
    for turn in range(rounds):
        for name in list(caches)[:: 1 if turn % 2 else -1]:
            start = time.perf_counter()
            for cache in caches[name]:
                torch.ops.mstar_layer.attention(qkv, cos, sin, cache, *rest)
            times[name].append((time.perf_counter() - start) / LAYERS)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--keys", type=int, nargs="+", default=[61, 401, 1025, 2049, 4001])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    if (why := layer_ops_or_why()) is not None:
        raise SystemExit(f"layer ops: {why}")
    print(cpu_info().describe())
    print(f"{'rows':>5} {'keys':>5} {'float32 us':>11} {'bfloat16 us':>12}   ratio")
    for rows in args.rows:
        for keys in (k for k in args.keys if rows * k <= 40_000):
            t = turns(rows, keys, args.rounds)
            print(
                f"{rows:>5} {keys:>5} {t['float32'] * 1e6:>11.1f} {t['bfloat16'] * 1e6:>12.1f}"
                f"   {t['float32'] / t['bfloat16']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
