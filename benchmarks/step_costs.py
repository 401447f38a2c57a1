"""Where an engine decode step's time goes, by part of the step.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/step_costs.py [--rows 1 32] [--steps 8]
        [--compile] [--dtype float32]

An ``Engine`` on SmolLM2 with ``--rows`` requests decoding (32-token
prompts), ``--steps`` timed decode steps. Eager, each part is timed around
its own calls (the process's CPU time, all threads: on a shared machine
wall time mostly measures the other jobs; median over the steps): the
linear layers (every ``linear_modules`` module but the head), the head,
the embedding, the norms, the rotary tables, the activation, paged
attention (its KV write apart), the rest of the forward (HF's Python,
rotary applied, residual adds, ``silu * up``), and outside the forward the
plan/commit, the sampling and the rest of the engine's host work. Compiled (``--compile``), the graph is
one call, so the parts come from the torch profiler's ops: the linear
layers and head (oneDNN's or aten's GEMMs), the attention op, the graph's
own kernels, dynamo's guards and the rest (wall time of the ops). Then the
linear layers alone (``mstar.bench.roofline.linear_alone_s``) at the same
rows on the same clock, for the ratio.
Prints the CPU (``mstar.engine.cpu``) and the load. It breaks down HF's
eager forward (``Engine(fused=False)``): the fused forward that eager
engines run by default calls its GEMMs and layer ops directly, and its step
is measured against its linear layers by ``mstar-kv bench --roofline``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import mstar.integrations.hf_attention as hf_attention
from mstar.bench.roofline import linear_alone_s, linear_modules
from mstar.engine import Engine, SamplingParams
from mstar.engine.cpu import cpu_info
from mstar.engine.loader import load

PROMPT_TOKENS = 32


def decoding_engine(rows: int, compile: bool, dtype: torch.dtype) -> Engine:
    """An engine with ``rows`` requests decoding, two decode steps warm."""
    model, tokenizer = load("smollm2", dtype=dtype)
    pages = rows * 8 + 16
    # HF's forward (fused=False): its modules are what the eager parts are timed around; the
    # fused forward (the default) calls its GEMMs and layer ops directly (see docs/performance.md)
    engine = Engine(
        model, tokenizer, num_pages=pages, prefix_cache=False, compile=compile, fused=False
    )
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    for i in range(rows):
        engine.add_request([(7 * i + j) % 1000 for j in range(PROMPT_TOKENS)], params)
    while engine.stats.decode_steps < 2:
        engine.step()
    return engine


class Parts:
    """CPU time per part, per step: wrappers add to ``now``, ``close`` files it."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def timed(self, fn: Callable, part: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[part] += time.process_time() - t0

        return wrapper

    def close(self) -> None:
        self.steps.append(dict(self.now))
        self.now.clear()

    def medians(self) -> dict[str, float]:
        names = {n for s in self.steps for n in s}
        return {n: statistics.median(s.get(n, 0.0) for s in self.steps) for n in names}


def eager_parts(engine: Engine, steps: int) -> dict[str, float]:
    """Median ms per part of a decode step (eager: each part timed around its calls)."""
    model, parts = engine.model, Parts()
    head = model.get_output_embeddings()
    patched: list[tuple[object, str, Any]] = []  # (owner, name, its own attribute or None)

    def wrap(owner: object, name: str, part: str) -> None:
        patched.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, parts.timed(getattr(owner, name), part))

    for module in linear_modules(model):
        wrap(module, "forward", "lm_head" if module is head else "linear layers")
    for module in model.modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Embedding):
            wrap(module, "forward", "embedding")
        elif "Norm" in kind:
            wrap(module, "forward", "norms")
        elif "Rotary" in kind:
            wrap(module, "forward", "rotary tables")
        elif "Activation" in kind or isinstance(module, torch.nn.SiLU | torch.nn.GELU):
            wrap(module, "forward", "activation")
    wrap(hf_attention, "_attend_layer", "attention (with KV write)")
    wrap(engine.cache, "write", "KV write")
    wrap(model, "forward", "forward")
    wrap(engine.mgr, "plan", "plan + commit")
    wrap(engine.mgr, "commit", "plan + commit")
    wrap(engine.pipeline, "rows", "sampling")
    wrap(engine.emitter, "on_logits", "sampling")
    wrap(engine, "step", "step")
    try:
        for _ in range(steps):
            engine.step()
            parts.close()
    finally:
        for owner, name, own in reversed(patched):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
    m = parts.medians()
    m["attention"] = m.pop("attention (with KV write)", 0.0) - m.get("KV write", 0.0)
    inner = ("linear layers", "lm_head", "embedding", "norms", "rotary tables", "activation",
             "attention", "KV write")  # fmt: skip
    m["rest of the forward (HF Python, rotary, adds, mul)"] = m["forward"] - sum(
        m.get(k, 0.0) for k in inner
    )
    m["rest of the step (pack, detokenize, completions)"] = (
        m["step"] - m["forward"] - sum(m.get(k, 0.0) for k in ("plan + commit", "sampling"))
    )
    return {k: v * 1e3 for k, v in m.items()}


# Profiler op names by part of a compiled step (the graph's own kernels are its call's self time).
COMPILED_PARTS = {
    "mkldnn::_linear_pointwise": "linear layers + lm_head",
    "aten::mm": "linear layers + lm_head",
    "aten::addmm": "linear layers + lm_head",
    "mstar::paged_attention": "attention op (with KV write)",
    "## Call CompiledFxGraph": "graph kernels (embedding, norms, rotary, silu*mul, adds)",
    "TorchDynamo Cache Lookup": "dynamo guards + pregraph",
    "Pregraph bytecode": "dynamo guards + pregraph",
}


def compiled_parts(engine: Engine, steps: int) -> dict[str, float]:
    """Median-free: total self time per part over ``steps`` steps, in ms per step."""
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - t0) / steps
    parts: dict[str, float] = defaultdict(float)
    total = 0.0
    for event in prof.key_averages():
        total += event.self_cpu_time_total
        part = next((p for k, p in COMPILED_PARTS.items() if event.key.startswith(k)), None)
        if part == "attention op (with KV write)":
            parts[part] += event.cpu_time_total  # its aten calls are its own
        elif part is not None:
            parts[part] += event.self_cpu_time_total
    parts = {k: v / 1e3 / steps for k, v in parts.items()}
    parts["step (wall, under the profiler)"] = wall * 1e3
    parts["rest (host work, other ops)"] = wall * 1e3 - sum(
        v for k, v in parts.items() if not k.startswith("step")
    )
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_info().describe()}; load {os.getloadavg()[0]:.1f}")
    for rows in args.rows:
        engine = decoding_engine(rows, args.compile, dtype)
        mode = engine.compiled or "eager"
        load_before = os.getloadavg()[0]
        parts = (compiled_parts if args.compile else eager_parts)(engine, args.steps)
        clock = time.perf_counter if args.compile else time.process_time  # as the parts'
        alone = linear_alone_s(engine.model, rows, clock=clock) * 1e3
        step = parts.get("step", parts.get("step (wall, under the profiler)"))
        print(
            f"\n{args.dtype} {mode}, {rows} rows decoding: step {step:.1f} ms, the linear layers"
            f" alone {alone:.1f} ms ({step / alone:.2f}x); load {load_before:.1f}"
            f" -> {os.getloadavg()[0]:.1f}"
        )
        for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {name:58s} {ms:8.2f} ms  {100 * ms / step:5.1f}%")
        engine.close()


if __name__ == "__main__":
    main()
