"""Per decode step on the GPU: the plan layer's host time beside the forward.

For each batch x context, steady decode steps through ``KVManager`` (index
arrays from a ``PinnedIndexRing`` on CUDA), each timed in parts: the plan
layer (admit + plan + commit, host), the copy of the plan's index arrays to
the device (host call and GPU time), FlashInfer's ``plan`` (host), and one
layer's attention (GPU time) through FlashInfer and through
``paged_attention``. The last column is the host work (plan layer + copy +
FlashInfer plan) over a 32-layer step's attention: what the plan costs
beside the forward. Medians over the steps. The GPU check's last stage;
``--quick --device cpu`` runs it in seconds on the CPU (its dry run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mstar.engine.resources.attn.paged import paged_attention
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.kv.plan import PinnedIndexRing
from mstar.engine.resources.step import KVStep, Segment

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, LAYERS = 32, 8, 64, 16, 32
CONFIGS = ((32, 1024), (256, 1024), (32, 4096), (256, 4096))
QUICK = ((4, 64),)


def _elapsed_us(fn: Callable[[], object], device: str) -> float:
    """Device time of ``fn``'s work in µs (CUDA events; wall time on the CPU)."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def _host_us(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def measure(batch: int, context: int, device: str, flashinfer, steps: int) -> dict[str, float]:
    """Medians of each part over ``steps`` decode steps at ``batch`` x ``context``."""
    per_row = -(-(context + steps + 1) // PAGE_SIZE)
    num_pages = batch * per_row
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cache = KVCache(1, num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype, device)
    ring = PinnedIndexRing() if device == "cuda" else None
    mgr = KVManager(num_pages, PAGE_SIZE, cache=cache, ring=ring)
    names = [f"r{i}" for i in range(batch)]
    prefill = KVStep(tuple(Segment(n, "main", context) for n in names))
    mgr.admit(prefill)
    mgr.plan(prefill)
    mgr.commit(prefill)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
    layer = cache.layer(0)
    options = {"num_qo_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    options |= {"page_size": PAGE_SIZE, "q_dtype": dtype}
    decode = KVStep(tuple(Segment(n, "main", 1) for n in names))
    parts: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        parts.setdefault(name, []).append(value)

    for _ in range(steps):
        t0 = time.perf_counter()
        mgr.admit(decode)
        plan = mgr.plan(decode)["main"]
        planned_s = time.perf_counter() - t0
        idx = plan.cpu_indptrs
        record("copy host", _host_us(lambda idx=idx: idx.to_device(device)))
        record("copy gpu", _elapsed_us(lambda idx=idx: idx.to_device(device), device))
        if flashinfer is not None:
            record("fi plan", _host_us(lambda plan=plan: flashinfer.plan(plan, **options)))
            record("fi attn", _elapsed_us(lambda: flashinfer.run(q, layer), device))
        record("paged attn", _elapsed_us(lambda idx=idx: paged_attention(q, layer, idx), device))
        t0 = time.perf_counter()
        mgr.commit(decode)
        record("plan layer", (planned_s + time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(values) for name, values in parts.items()}


def table(rows: list[tuple[int, int, dict[str, float]]], device: str, steps: int) -> str:
    head = ["batch x context", "plan layer µs", "copy host µs", "copy gpu µs"]
    head += ["FI plan µs", "FI attn µs/layer", "paged attn µs/layer", "host / 32-layer attn"]
    body = []
    for batch, context, m in rows:
        attn = m.get("fi attn", m["paged attn"])
        host = m["plan layer"] + m["copy host"] + m.get("fi plan", 0.0)
        cells = [m["plan layer"], m["copy host"], m["copy gpu"], m.get("fi plan")]
        cells += [m.get("fi attn"), m["paged attn"]]
        body.append(
            [f"{batch} x {context}"]
            + ["-" if c is None else f"{c:.1f}" for c in cells]
            + [f"{host / (LAYERS * attn):.2f}"]
        )
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    title = (
        f"decode step, {HEADS} q / {KV_HEADS} kv heads x {HEAD_DIM}, page {PAGE_SIZE},"
        f" medians of {steps} steps on {name} (torch {torch.__version__})"
    )
    return "\n".join([title, *lines]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--no-flashinfer", action="store_true")
    parser.add_argument("--quick", action="store_true", help="toy sizes (a dry run)")
    args = parser.parse_args()
    flashinfer = None
    if not args.no_flashinfer:
        from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention

        flashinfer = FlashInferPagedAttention(device=args.device)
    steps = 5 if args.quick else 20
    rows = []
    for batch, context in QUICK if args.quick else CONFIGS:
        rows.append((batch, context, measure(batch, context, args.device, flashinfer, steps)))
        print(f"measured {batch} x {context}", flush=True)
    text = table(rows, args.device, steps)
    if args.out is not None:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
