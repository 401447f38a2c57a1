"""What a half-precision KV cache costs in accuracy, on SmolLM2.

    python benchmarks/kv_accuracy.py [--kv-cache-dtype auto bfloat16 float16]
        [--new-tokens 48]

One engine per ``--kv-cache-dtype`` in the default serving mode (``--dtype
auto``, the GGUF's own weights; ``auto``: a float32 cache, the reference),
each scoring through its own paged cache: greedy agreement with the first
on the demo's 16 chat prompts (``--new-tokens`` each, ignoring EOS: prompts
identical, tokens before the first difference) and the log-likelihood of
``mstar.bench.quant.PASSAGE`` echo-scored as lm-eval does (the sum of log
p(token) over its prompt tokens, ``prompt_logprobs``). Prints the CPU.
"""

from __future__ import annotations

import argparse

from mstar.bench.quant import PASSAGE
from mstar.cli.demo import CHAT_QUESTIONS
from mstar.cpu.info import cpu_info
from mstar.engine import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "bfloat16", "float16"])
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    print(cpu_info().describe())
    chats = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    greedy = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    echo = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    first: tuple[list[list[int]], float] | None = None
    for kv in args.kv_cache_dtype:
        with Engine.from_pretrained(
            "smollm2", dtype="auto", quantization="auto", kv_cache_dtype=kv
        ) as engine:
            tokens = [c.outputs[0].token_ids for c in engine.chat(chats, greedy)]
            (scored,) = engine.generate([engine.tokenizer.encode(PASSAGE)], echo)
            loglik = sum(r.chosen.logprob for r in scored.prompt_logprobs if r is not None)
            check = engine.mode_check.describe() if engine.mode_check else "the reference"
            name = str(engine.cache.dtype).removeprefix("torch.")
        first = first or (tokens, loglik)
        same = [_prefix(a, b) for a, b in zip(tokens, first[0], strict=True)]
        identical = sum(s == args.new_tokens for s in same)
        print(
            f"{name:9s} greedy: {identical}/{len(same)} prompts identical, {sum(same)}/"
            f"{args.new_tokens * len(same)} tokens before the first difference; passage"
            f" log-lik {loglik:.3f} (delta {loglik - first[1]:+.4f}); start-up check: {check}"
        )


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
