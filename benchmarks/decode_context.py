"""One request's decode step against its context length, on SmolLM2.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/decode_context.py [--context 32 1024 2048]
        [--steps 30] [--kv-cache-dtype auto bfloat16]

An ``Engine`` in the default serving mode (``--dtype auto``, the GGUF's own
weights), one request at a time: a prompt of ``--context`` tokens, its
prefill (in chunks) and four decode steps to warm, then ``--steps`` timed
ones; per context the median step and the layer stack's share of it
(``LayerStack.__call__``: the 30 layers in one C++ call, their attention
included), so the growth over the first context is the attention's. One
engine per ``--kv-cache-dtype`` (``auto``: float32 here; ``bfloat16``: half
the bytes a key), in turns at each context, with the step's ratio to the
first's. Prints the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mstar.engine import Engine, SamplingParams
from mstar.engine.cpu import cpu_info
from mstar.integrations.layer_stack import LayerStack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[32, 1024, 2048])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "bfloat16"])
    args = parser.parse_args()
    print(cpu_info().describe())
    spent = [0.0]
    call = LayerStack.__call__

    def timed(self, *a, **k):
        start = time.perf_counter()
        try:
            return call(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - start

    LayerStack.__call__ = timed
    pages = max(args.context) // 16 + args.steps // 16 + 8
    engines = {
        kv: Engine.from_pretrained(
            "smollm2", dtype="auto", quantization="auto", num_pages=pages, prefix_cache=False,
            kv_cache_dtype=kv,
        )
        for kv in args.kv_cache_dtype
    }  # fmt: skip
    print(f"{'context':>8} {'KV cache':>9} {'step ms':>8} {'layers ms':>10} {'x first':>8}")
    for context in args.context:
        prompt = [(7 * j) % 1000 + 5 for j in range(context)]
        first = None
        for engine in engines.values():
            params = SamplingParams(max_new_tokens=args.steps + 6, ignore_eos=True)
            engine.add_request(prompt, params)
            warm = engine.stats.decode_steps + 4
            while engine.stats.decode_steps < warm:  # the prefill (in chunks), four decode steps
                engine.step()
            steps, spent[0] = [], 0.0
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            step, layers = statistics.median(steps), spent[0] / args.steps
            first = first or step
            kv = str(engine.cache.dtype).removeprefix("torch.")
            print(f"{context:>8} {kv:>9} {step * 1e3:>8.2f} {layers * 1e3:>10.2f}"
                  f" {first / step:>7.2f}x")  # fmt: skip
            while engine.has_unfinished():
                engine.step()
    LayerStack.__call__ = call


if __name__ == "__main__":
    main()
