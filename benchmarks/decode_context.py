"""Decode steps against their context length, on SmolLM2.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/decode_context.py [--context 32 1024 2048]
        [--steps 30] [--kv-cache-dtype auto bfloat16] [--rows 1]

An ``Engine`` in the default serving mode (``--dtype auto``, the GGUF's own
weights), ``--rows`` requests at a time: prompts of ``--context`` tokens,
their prefill (in chunks) and four decode steps to warm, then ``--steps``
timed ones; per context the median step and the layer stack's share of it
(``LayerStack.__call__``: the 30 layers in one C++ call, their attention
included; steps of fewer than ``BF16_ROWS`` rows), so the growth over the
first context is the attention's, or at more rows the layer ops' attention
itself (``StepAttention.fused``, called layer by layer). One engine per
``--kv-cache-dtype`` (``auto``: float32 here; ``bfloat16``: half the bytes
a key), in turns at each context, with the step's ratio to the first's.
Prints the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from mstar.cpu.info import cpu_info
from mstar.engine import Engine, SamplingParams
from mstar.models.llama.attention import StepAttention
from mstar.models.llama.stack import LayerStack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[32, 1024, 2048])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "bfloat16"])
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    for name in ("rows", "steps"):  # none would leave the warm-up waiting on no decode step
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected at least 1, got {getattr(args, name)}")
    if min(args.context) < 1:
        parser.error(f"--context: expected at least 1 token, got {min(args.context)}")
    print(cpu_info().describe())
    spent = {"layers": 0.0, "attention": 0.0}  # the timed steps' seconds in each
    patched = [(LayerStack, "__call__", "layers"), (StepAttention, "fused", "attention")]
    originals = [getattr(cls, name) for cls, name, _ in patched]
    for (cls, name, part), call in zip(patched, originals):
        setattr(cls, name, _timed(call, spent, part))
    # the rows decode together from the first timed step to the last: each asks for more
    # tokens than it may make while the others prefill (a chunk of 64 tokens or more a
    # step) and the timed steps
    new_tokens = {c: args.steps + 16 + args.rows * c // 64 for c in args.context}
    pages = args.rows * max((c + new_tokens[c]) // 16 + 8 for c in args.context)
    engines = {
        kv: Engine.from_pretrained(
            "smollm2", dtype="auto", quantization="auto", num_pages=pages, prefix_cache=False,
            kv_cache_dtype=kv,
        )
        for kv in args.kv_cache_dtype
    }  # fmt: skip
    print(f"{args.rows} rows")
    print(f"{'context':>8} {'KV cache':>9} {'step ms':>8} {'layers ms':>10} {'attention ms':>13}"
          f" {'x first':>8}")  # fmt: skip
    for context in args.context:
        first = None
        for engine in engines.values():
            params = SamplingParams(max_new_tokens=new_tokens[context], ignore_eos=True)
            ids = [
                engine.add_request([(7 * j + 13 * row) % 1000 + 5 for j in range(context)], params)
                for row in range(args.rows)
            ]
            warm = engine.stats.decode_steps + 4
            while engine.stats.decode_steps < warm:  # the prefill (in chunks), four decode steps
                engine.step()
            steps = []
            spent.update(dict.fromkeys(spent, 0.0))
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            step = statistics.median(steps)
            layers, attention = (spent[part] / args.steps for part in ("layers", "attention"))
            first = first or step
            kv = str(engine.cache.dtype).removeprefix("torch.")
            print(f"{context:>8} {kv:>9} {step * 1e3:>8.2f} {layers * 1e3:>10.2f}"
                  f" {attention * 1e3:>13.2f} {first / step:>7.2f}x")  # fmt: skip
            for request_id in ids:
                engine.abort(request_id)
    for (cls, name, _), call in zip(patched, originals):
        setattr(cls, name, call)


def _timed(call: Callable, spent: dict[str, float], part: str) -> Callable:
    """``call``, its wall time added to ``spent[part]``."""

    def timed(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start

    return timed


if __name__ == "__main__":
    main()
