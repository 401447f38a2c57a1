"""Before/after ``paged_attention``, per layer call and end to end on SmolLM2, in one process.

    mkdir -p /tmp/before && git archive ba987f0 mstar/engine/resources/attn/paged.py | tar -x -C /tmp/before
    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_attention.py \\
        /tmp/before/mstar/engine/resources/attn/paged.py [--quick] [--rounds N]

The given ``paged.py`` loads beside the current one. Per layer call
(``--layer``, SmolLM2's attention shape, ms, the median of 41 rounds in
shuffled turns, ``turns_us``):
before, after, and HF's sdpa path on the same rows (the new K/V
concatenated onto a padded cache, then sdpa: grouped query heads for
decode, repeated KV heads and a mask for prefill). End to end: ``Engine`` serves each
workload with either (swapped into ``mstar.models.hf_attention``, the only
caller), and HF ``generate`` on left-padded batches serves it too, the
three in turns for ``--rounds`` rounds (default 3); each path's best round
counts. Workloads: the 16 chat prompts of ``bench --e2e`` (32 new tokens,
one padded batch) and the mixed serving jobs of ``bench --e2e --workload
mixed``, all at once (64 prompts, batches of 16; ``--quick``: 12 prompts
of 8-32 new tokens, batches of 6). Prints seconds, tokens/s and the ratios.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from mstar.bench import turns_us
from mstar.bench.attention import HEAD_DIM, HEADS, KV_HEADS, PAGE_SIZE, Case
from mstar.bench.serving import Job, mixed_jobs, serve_engine, serve_padded
from mstar.cli.demo import CHAT_QUESTIONS
from mstar.engine import Engine
from mstar.engine.prompts import chat_prompt
from mstar.engine.resources.attn import paged as after
from mstar.engine.resources.attn.options import AttentionOptions
from mstar.models import hf_attention
from mstar.models.loader import load

# Decode and prefill steps (HF runs no step mixing the two): rows as (stored, new).
LAYER_CASES = [
    ("decode 16 x ~300", [(290 + 2 * i, 1) for i in range(16)]),
    ("decode 64 x 40..400", [(40 + 6 * i, 1) for i in range(64)]),
    # the mixed workload's spread: every other row behind the 175-token preamble
    ("decode 48 x 60..480", [(60 + 5 * i + 175 * (i % 2), 1) for i in range(48)]),
    ("prefill 4 x 64", [(0, 64)] * 4),
    ("prefill 1 x 30", [(0, 30)]),
]


def hf_sdpa(rows: list[tuple[int, int]]) -> Callable[[], torch.Tensor]:
    """HF's per-layer work for these rows, as ``sdpa_attention_forward`` does it."""
    num, width, new = len(rows), max(h + n for h, n in rows), max(n for _, n in rows)
    group = HEADS // KV_HEADS
    past = [torch.randn(num, KV_HEADS, width - new, HEAD_DIM) for _ in range(2)]
    fresh = [torch.randn(num, KV_HEADS, new, HEAD_DIM) for _ in range(2)]
    q = torch.randn(num, HEADS, new, HEAD_DIM)
    mask = torch.ones(new, width, dtype=torch.bool).tril(width - new)[None, None]

    def call() -> torch.Tensor:
        k, v = (torch.cat([p, f], dim=-2) for p, f in zip(past, fresh))
        if new == 1:
            qg = q.view(num, KV_HEADS, group, HEAD_DIM)
            return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.expand(num, 1, 1, -1))
        k, v = (
            t[:, :, None].expand(-1, -1, group, -1, -1).reshape(num, HEADS, width, HEAD_DIM)
            for t in (k, v)
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(num, 1, -1, -1))

    return call


def layer_calls(before: Any) -> None:
    """ms per layer call: before, after, HF's sdpa path; medians of rounds in turns."""
    print(
        f"{'step':22s} {'before':>8s} {'after':>8s} {'HF sdpa':>8s} {'before/after':>12s}"
        f" {'after/HF':>9s}"
    )
    for name, rows in LAYER_CASES:
        case = Case(rows)
        sched = {m: m.AttentionSchedule(case.indptrs, PAGE_SIZE) for m in (before, after)}
        calls = {m: _layer_call(m, case, sched[m]) for m in (before, after)}
        torch.testing.assert_close(calls[before](), calls[after](), atol=1e-5, rtol=1e-5)
        best = [
            us / 1e3 for us in turns_us([calls[before], calls[after], hf_sdpa(rows)], rounds=41)
        ]
        print(
            f"{name:22s} {best[0]:8.3f} {best[1]:8.3f} {best[2]:8.3f} {best[0] / best[1]:11.2f}x"
            f" {best[1] / best[2]:8.2f}x"
        )


def _layer_call(module: Any, case: Case, schedule: Any) -> Callable[[], torch.Tensor]:
    attend = _taking_options(module)

    def call() -> torch.Tensor:
        return attend(case.q, case.layer, case.indptrs, case.options, schedule=schedule)

    return call


def _taking_options(module: Any) -> Callable[..., torch.Tensor]:
    """``module.paged_attention`` called as today's is, with an
    ``AttentionOptions``; a ``paged.py`` from before the record took its
    fields as keywords."""
    if "options" in inspect.signature(module.paged_attention).parameters:
        return module.paged_attention

    def attend(q, kv_layer, indptrs, options=AttentionOptions(), *, schedule=None):
        return module.paged_attention(q, kv_layer, indptrs, schedule=schedule, **options._asdict())

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the earlier checkout's attn/paged.py")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layer", action="store_true", help="per layer call only")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("paged_before", args.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    print(f"torch threads {torch.get_num_threads()}")
    if args.layer:
        layer_calls(before)
        return

    model, tokenizer = load("smollm2")
    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=eos)
    num, new_tokens, batch = (12, (8, 32), 6) if args.quick else (64, (16, 256), 16)
    workloads = {
        "16 chat prompts x 32 tokens": (
            [Job(chat_prompt(tokenizer, q), 32, 0.0) for q in CHAT_QUESTIONS],
            16,
        ),
        f"mixed, {num} prompts at once": (mixed_jobs(tokenizer, num, new_tokens, 0, 0.0), batch),
    }
    paged = copy.deepcopy(model)
    Engine(paged, tokenizer)  # switches the copy to paged attention

    def engine_with(module):
        def serve(jobs):
            hf_attention.paged_attention, hf_attention.AttentionSchedule = (
                _taking_options(module),
                module.AttentionSchedule,
            )
            return serve_engine(lambda: Engine(paged, tokenizer), jobs)

        return serve

    print(f"best of {args.rounds} rounds, in turns")
    print(f"{'workload':32s} {'path':34s} {'seconds':>8s} {'tokens/s':>9s} {'after / this':>12s}")
    for name, (jobs, size) in workloads.items():
        paths = {
            "Engine, paged_attention before": engine_with(before),
            "Engine, paged_attention after": engine_with(after),
            f"HF generate (padded, batches of {size})": lambda js, s=size: serve_padded(
                model, js, config, s
            ),
        }
        best = dict.fromkeys(paths, float("inf"))
        tokens = {}
        serve_engine(lambda: Engine(paged, tokenizer), [Job(j.prompt, 4, 0.0) for j in jobs[:4]])
        for _ in range(args.rounds):
            for path, serve in paths.items():
                t0 = time.perf_counter()
                out = serve(jobs)
                best[path] = min(best[path], time.perf_counter() - t0)
                tokens[path] = out.tokens
        count = sum(map(len, tokens["Engine, paged_attention after"]))
        for path in paths:
            speed = sum(map(len, tokens[path])) / best[path]
            ratio = best[path] / best["Engine, paged_attention after"]
            print(f"{name:32s} {path:34s} {best[path]:8.2f} {speed:9.1f} {ratio:11.2f}x")
        same = tokens["Engine, paged_attention before"] == tokens["Engine, paged_attention after"]
        print(f"{name:32s} tokens {count}; before and after generate the same tokens: {same}")
    hf_attention.paged_attention, hf_attention.AttentionSchedule = (
        after.paged_attention,
        after.AttentionSchedule,
    )


if __name__ == "__main__":
    main()
