"""Where an engine decode step's time goes, by part of the step.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/step_costs.py [--rows 1 32] [--steps 8]
        [--compile] [--dtype float32] [--fused --dtype auto --quantization auto]

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
Prints the CPU (``mstar.cpu.info``) and the load. Without ``--fused`` it
breaks down HF's eager forward (``Engine(fused=False)``). ``--fused``: the
forward eager engines run by default (``serve``'s with ``--dtype auto
--quantization auto``), whose layers are one ``decode_layers`` call at a
few rows: that call, the head, the Python of the forward around them
(reading the layers' weights, checking them, the attention schedule, the
rotary tables) and the host's parts, in wall time (the kernels' helper
thread spins through the host's parts: CPU time would count them twice).
What the weights' stream leaves of the host's objects in cache shows in
those parts: each runs several times slower than warm.
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

import mstar.models.hf_attention as hf_attention
import mstar.models.llama.step as llama_step
from mstar.bench.roofline import linear_alone_s, linear_modules
from mstar.cpu.info import cpu_info
from mstar.engine import Engine, SamplingParams
from mstar.models.llama.layer import FusedLlamaLayer
from mstar.models.llama.step import fused_step
from mstar.models.loader import load

PROMPT_TOKENS = 32


def decoding_engine(
    rows: int, compile: bool, dtype: str, fused: bool = False, quantization: str = "none"
) -> Engine:
    """An engine with ``rows`` requests decoding, two decode steps warm."""
    pages = rows * 8 + 16
    if fused:
        engine = Engine.from_pretrained(
            "smollm2", dtype=dtype, quantization=quantization, num_pages=pages,
            prefix_cache=False,
        )  # fmt: skip
    else:
        model, tokenizer = load("smollm2", dtype=getattr(torch, dtype))
        # HF's forward (fused=False): its modules are what the eager parts are timed around
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
    """Time per part (``clock``: CPU time unless given), per step: wrappers
    add to ``now``, ``close`` files it."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.clock = clock
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def timed(self, fn: Callable, part: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[part] += self.clock() - t0

        return wrapper

    def close(self) -> None:
        self.steps.append(dict(self.now))
        self.now.clear()

    def medians(self) -> dict[str, float]:
        names = {n for s in self.steps for n in s}
        return {n: statistics.median(s.get(n, 0.0) for s in self.steps) for n in names}


class Patches:
    """Attributes replaced by ``parts``' timed wrappers, put back by ``undo``."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.patched: list[tuple[object, str, Any]] = []  # (owner, name, its own attribute)

    def wrap(self, owner: object, name: str, part: str) -> None:
        self.patched.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, self.parts.timed(getattr(owner, name), part))

    def steps(self, engine: Engine, steps: int) -> None:
        """``steps`` steps of ``engine``, each filed; then every attribute put back."""
        try:
            for _ in range(steps):
                engine.step()
                self.parts.close()
        finally:
            for owner, name, own in reversed(self.patched):
                if own is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, own)


def host_parts(engine: Engine, wrap: Callable[[object, str, str], None]) -> None:
    """The step's host parts around the forward: plan + commit, sampling, the step."""
    wrap(engine.mgr, "plan", "plan + commit")
    wrap(engine.mgr, "commit", "plan + commit")
    wrap(engine.pipeline, "rows", "sampling")
    wrap(engine.emitter, "on_logits", "sampling")
    wrap(engine, "step", "step")


def eager_parts(engine: Engine, steps: int) -> dict[str, float]:
    """Median ms per part of a decode step (eager: each part timed around its calls)."""
    model, parts = engine.model, Parts()
    head = model.get_output_embeddings()
    patches = Patches(parts)
    wrap = patches.wrap
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
    host_parts(engine, wrap)
    patches.steps(engine, steps)
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


def fused_parts(engine: Engine, steps: int) -> dict[str, float]:
    """Median ms per part of a decode step of the fused forward (wall time)."""
    fused = fused_step(engine.model)
    if fused is None or fused.stack is None:
        raise SystemExit("--fused: this model's forward is not fused or has no layer stack")
    parts = Parts(time.perf_counter)
    patches = Patches(parts)
    wrap = patches.wrap
    wrap(fused.stack, "_weights", "the stack's weights read (LayerStack._weights)")
    wrap(fused, "stack", "layer stack (one call: its Python and decode_layers)")
    wrap(FusedLlamaLayer, "__call__", "layers one by one (a step the stack does not serve)")
    wrap(fused.head, "forward", "lm_head")
    wrap(fused, "current", "the fused weights checked (FusedLlama.current)")
    wrap(fused, "_rotary", "rotary tables")
    wrap(llama_step, "StepAttention", "attention schedule (StepAttention)")
    wrap(engine, "_forward_step", "forward")
    host_parts(engine, wrap)
    patches.steps(engine, steps)
    m = parts.medians()
    stack = "layer stack (one call: its Python and decode_layers)"
    read = "the stack's weights read (LayerStack._weights)"
    m["layer stack: decode_layers and the rest of its Python"] = m.pop(stack, 0.0) - m.get(
        read, 0.0
    )
    inner = ("layer stack: decode_layers and the rest of its Python", read, "lm_head",
             "layers one by one (a step the stack does not serve)",
             "the fused weights checked (FusedLlama.current)", "rotary tables",
             "attention schedule (StepAttention)")  # fmt: skip
    m["rest of the forward (embedding, checks, norm)"] = m["forward"] - sum(
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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()
    if args.fused and args.compile:
        parser.error("--fused breaks down the eager fused forward: not with --compile")
    if not args.fused and (args.dtype == "auto" or args.quantization != "none"):
        parser.error("--dtype auto and --quantization are for the fused forward (--fused)")
    print(f"CPU: {cpu_info().describe()}; load {os.getloadavg()[0]:.1f}")
    for rows in args.rows:
        engine = decoding_engine(rows, args.compile, args.dtype, args.fused, args.quantization)
        mode = engine.compiled or ("eager, fused" if args.fused else "eager")
        load_before = os.getloadavg()[0]
        if args.fused:
            parts = fused_parts(engine, args.steps)
        else:
            parts = (compiled_parts if args.compile else eager_parts)(engine, args.steps)
        wall = args.compile or args.fused
        clock = time.perf_counter if wall else time.process_time  # as the parts'
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
