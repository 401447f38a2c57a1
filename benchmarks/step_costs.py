"""Where an engine step's time goes on the CPU, and two costs that bound it.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/step_costs.py [--rows 12] [--steps 5]

1. An ``Engine`` decode step on SmolLM2 with ``--rows`` requests (the mixed
   workload's prompts, decoding): the share of its CPU time spent outside
   the model's forward (the plan, sampling, the engine's host work) and in
   the model's head (its forward less the decoder stack: lm_head), then
   each op's share under the torch profiler.
2. A linear layer of SmolLM2's MLP shape (``[M, 576] @ [576, 1536]``, 60
   weights so they come from memory, as in a forward) at M rows: ms per
   call, best of 5 rounds in turns. A decode step is M = its rows.
3. sdpa on one decode batch (16 rows x 320 keys, 9 query / 3 KV heads):
   K/V as the strided views ``paged_attention`` reads from its gathered
   pages (``[L, H_kv, D]`` per row) against K/V contiguous per head
   (``[H_kv, L, D]``, what a head-major page layout would give); best of 7
   rounds in turns.

Times are process CPU time (all threads), so other jobs on a shared
machine move them less than wall time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from mstar.bench.serving import mixed_jobs
from mstar.engine import Engine, SamplingParams
from mstar.engine.loader import load


def step_shares(rows: int, steps: int) -> None:
    model, tokenizer = load("smollm2")
    engine = Engine(model, tokenizer)
    for job in mixed_jobs(tokenizer, rows, (8, 32), 0, 0.0):
        engine.add_request(job.prompt, SamplingParams(max_new_tokens=500, ignore_eos=True))
    while engine.stats.decode_steps < 2:  # every prompt in, two decode steps warm
        engine.step()
    spent = {"model": 0.0, "layers": 0.0}
    for key, module in (("model", model), ("layers", model.model)):
        module.forward = _timed(module.forward, spent, key)
    t0 = time.process_time()
    for _ in range(steps):
        engine.step()
    total = time.process_time() - t0
    del model.forward, model.model.forward
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    whole = sum(e.self_cpu_time_total for e in ops)
    print(
        f"decode step, {rows} rows: {total / steps * 1e3:.1f} ms of CPU time; op shares under the profiler"
    )
    outside, head = total - spent["model"], spent["model"] - spent["layers"]
    print(
        f"  outside the model's forward (plan, sampling, host work): {100 * outside / total:.1f}%"
    )
    print(f"  the model's head (lm_head at the {rows} rows that choose): {100 * head / total:.1f}%")
    for e in ops[:6]:
        print(
            f"  {e.key:50s} {100 * e.self_cpu_time_total / whole:5.1f}%  {e.count // steps} calls"
        )


def _timed(forward: Callable, spent: dict[str, float], key: str) -> Callable:
    """``forward`` adding its CPU time to ``spent[key]``."""

    def timed(*args, **kwargs):
        t0 = time.process_time()
        try:
            return forward(*args, **kwargs)
        finally:
            spent[key] += time.process_time() - t0

    return timed


def best_of(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """ms per call of each, best of ``rounds`` rounds taken in turns."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.process_time() - t0) / calls * 1e3)
    return best


def linear_by_rows() -> None:
    weights = [torch.randn(1536, 576) for _ in range(60)]
    xs = {m: torch.randn(m, 576) for m in (1, 4, 12, 16, 64, 256)}
    fns = {m: (lambda x=x: [F.linear(x, w) for w in weights]) for m, x in xs.items()}
    best = best_of(fns, 5, 1)
    print("linear [M, 576] @ [576, 1536], ms per call (per row)")
    for m, ms in best.items():
        print(f"  M={m:<4d} {ms / len(weights):7.3f} ({ms / len(weights) / m:.3f})")


def sdpa_layouts() -> None:
    rows, width, kv_heads, heads, dim = 16, 320, 3, 9, 64
    q = torch.randn(rows, heads, 1, dim)
    gathered = torch.randn(2, rows, width, kv_heads, dim)  # as the page gather leaves it
    per_head = gathered.transpose(2, 3).contiguous()

    def strided() -> torch.Tensor:
        k, v = (t.transpose(1, 2) for t in gathered)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, *per_head, enable_gqa=True)

    torch.testing.assert_close(strided(), contiguous())
    best = best_of({"strided (paged_attention)": strided, "contiguous per head": contiguous}, 7, 50)
    print(f"sdpa, decode {rows} rows x {width} keys, ms per call")
    for name, ms in best.items():
        print(f"  {name:28s} {ms:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    step_shares(args.rows, args.steps)
    linear_by_rows()
    sdpa_layouts()


if __name__ == "__main__":
    main()
