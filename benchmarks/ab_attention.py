"""Before/after ``paged_attention``, end to end on SmolLM2, in one process.

    mkdir -p /tmp/before && git archive ba987f0 mstar/engine/resources/attn/paged.py | tar -x -C /tmp/before
    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_attention.py \\
        /tmp/before/mstar/engine/resources/attn/paged.py [--quick] [--rounds N]

The given ``paged.py`` loads beside the current one; ``Engine`` serves each
workload with either (swapped into ``mstar.integrations.hf``, the only
caller), and HF ``generate`` on left-padded batches serves it too, the
three in turns for ``--rounds`` rounds (default 3); each path's best round
counts. Workloads: the 16 chat prompts of ``bench --e2e`` (32 new tokens,
one padded batch) and the mixed serving jobs of ``bench --e2e --workload
mixed``, all at once (64 prompts, batches of 16; ``--quick``: 16 prompts
of 8-48 new tokens, batches of 8). Prints seconds, tokens/s and the ratios.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import time

import torch
from transformers import GenerationConfig

import mstar.integrations.hf as hf
from mstar.bench.serving import Job, mixed_jobs, serve_engine, serve_padded
from mstar.demo import CHAT_QUESTIONS
from mstar.engine import Engine
from mstar.engine.loader import chat_prompt, load
from mstar.engine.resources.attn import paged as after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the earlier checkout's attn/paged.py")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("paged_before", args.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)

    model, tokenizer = load("smollm2")
    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=eos)
    num, new_tokens, batch = (16, (8, 48), 8) if args.quick else (64, (16, 256), 16)
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
            hf.paged_attention, hf.AttentionSchedule = (
                module.paged_attention,
                module.AttentionSchedule,
            )
            return serve_engine(lambda: Engine(paged, tokenizer), jobs)

        return serve

    print(f"torch threads {torch.get_num_threads()}; best of {args.rounds} rounds, in turns")
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
    hf.paged_attention, hf.AttentionSchedule = after.paged_attention, after.AttentionSchedule


if __name__ == "__main__":
    main()
