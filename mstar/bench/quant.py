"""Quantization's speed and accuracy on SmolLM2 (``python -m mstar.bench.quant``).

- ``layers``: SmolLM2's 211 linear layers (the head once) back to back at
  batch 1 and 32, min of ``repeats``: float32 ``F.linear``, the packed
  kernels on the file's own weights, torch's ``_weight_int4pack_mm_for_cpu``
  (bfloat16 activations), in the same run, alternating.
- ``steps``: the eager engine's decode step at batch 1 and 32 per quantization.
- ``accuracy``: per quantization (``gguf bfloat16``: the file's own weights in
  bfloat16 arithmetic: the panels where the CPU has AVX512-BF16, int16
  activations at few rows on any; ``none bfloat16``: the model in bfloat16;
  ``bf16``: its float weights as bfloat16 panels), greedy agreement with
  float32 on the demo's prompts (tokens equal before the first difference) and
  the log-likelihood of a fixed passage (lm-eval-style echo scoring: sum of
  log p(token)), scored at once (a prefill's many rows) and one token a
  forward (a decode step's one row: the bfloat16 mode's int16 activations).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from mstar.cpu.quant.at_load import quantize_int4
from mstar.cpu.quant.linear import PackedLinear
from mstar.engine import Engine, SamplingParams
from mstar.models.loader import load

# quantization [dtype]: ``none bfloat16`` the model in bfloat16, ``bf16`` its float weights as
# bfloat16 panels (float32 activations)
MODES = ("none", "gguf", "gguf bfloat16", "int8", "int4", "none bfloat16", "bf16")
PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France."
    " It is named after the engineer Gustave Eiffel, whose company designed and built the"
    " tower from 1887 to 1889. Locally nicknamed 'La dame de fer', it was constructed as the"
    " centrepiece of the 1889 World's Fair, and to crown the centennial anniversary of the"
    " French Revolution."
)


def best_of(fn: Any, repeats: int, clock: Any = time.perf_counter) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def layers(repeats: int = 9, cpu_time: bool = False) -> dict[str, float]:
    """Milliseconds for the 211 linear layers back to back, per path and
    batch: wall time, or with ``cpu_time`` one thread's ``process_time``."""
    model, _ = load("smollm2", quantization="gguf")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    dense = [m.packed().dequantize() for m in packed]
    int4 = [_int4pack(w) for w in dense]
    clock = time.process_time if cpu_time else time.perf_counter
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if cpu_time else threads)
    out = {}
    for batch in (1, 32):
        x = {k: torch.randn(batch, k) for k in (576, 1536)}
        xb = {k: v.bfloat16() for k, v in x.items()}
        paths = {
            "float32 F.linear": lambda x=x: [F.linear(x[w.shape[1]], w) for w in dense],
            "packed kernels (float32 act.)": lambda x=x: [m(x[m.in_features]) for m in packed],
            "torch int4pack (bfloat16 act.)": lambda xb=xb: [
                torch._weight_int4pack_mm_for_cpu(xb[k], w, 32, sz) for k, w, sz in int4
            ],
        }
        times = {name: float("inf") for name in paths}
        with torch.no_grad():
            for _ in range(repeats):  # alternating, min of each
                for name, fn in paths.items():
                    times[name] = min(times[name], best_of(fn, 1, clock))
        out.update({f"{name} @ batch {batch}": t * 1e3 for name, t in times.items()})
    torch.set_num_threads(threads)
    return out


def _int4pack(w: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``w`` as torch's own int4 groups of 32 (``quantize_int4``'s values;
    torch's form: ``w = (q - 8) * scale + zero``, bfloat16 scales and zeros)."""
    packed = quantize_int4(w)
    scale, zero = packed.scales.float(), packed.mins.float() + 8 * packed.scales.float()
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
    q = torch._convert_weight_to_int4pack_for_cpu(packed.values().to(torch.int32), 1)
    return w.shape[1], q, sz


def steps(modes: tuple[str, ...] = ("none", "gguf"), repeats: int = 9) -> dict[str, float]:
    """Milliseconds per eager decode step at batch 1 and 32, min of ``repeats``,
    the modes' engines stepping in turn."""
    engines = {mode: Engine.from_pretrained("smollm2", quantization=mode) for mode in modes}
    out = {}
    for batch in (1, 32):
        params = SamplingParams(max_new_tokens=repeats + 1, ignore_eos=True)
        for engine in engines.values():
            for i in range(batch):
                engine.add_request([1, 2, 3, 4 + i], params)
            engine.step()  # prefill
        best = dict.fromkeys(modes, float("inf"))
        while any(e.has_unfinished() for e in engines.values()):
            for mode, engine in engines.items():
                best[mode] = min(best[mode], best_of(engine.step, 1))
        out.update({f"{mode} step @ batch {batch}": t * 1e3 for mode, t in best.items()})
    for engine in engines.values():
        engine.close()
    return out


def accuracy(modes: tuple[str, ...] = MODES, new_tokens: int = 48) -> dict[str, dict[str, Any]]:
    """Per mode: greedy tokens agreeing with float32, and the passage's
    log-likelihood at once and one token a forward. A mode that needs what
    this CPU lacks (``ValueError``) is left out."""
    from mstar.cli.demo import CHAT_QUESTIONS

    results: dict[str, dict[str, Any]] = {}
    reference: list[list[int]] = []
    for mode in modes:
        quantization, _, arithmetic = mode.partition(" ")
        try:
            model, tokenizer = load(
                "smollm2", quantization=quantization, dtype=getattr(torch, arithmetic or "float32")
            )
        except ValueError:
            continue
        ids = torch.tensor([tokenizer.encode(PASSAGE)])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].log_softmax(-1)
        loglik = logp.gather(1, ids[0, 1:, None]).sum().item()
        chats = [[{"role": "user", "content": p}] for p in CHAT_QUESTIONS]
        with Engine(copy.deepcopy(model), tokenizer) as engine:
            params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
            tokens = [c.outputs[0].token_ids for c in engine.chat(chats, params)]
        reference = reference or tokens
        same = [_prefix(a, b) for a, b in zip(tokens, reference, strict=True)]
        results[mode] = {
            "loglik": loglik,
            "loglik_stepwise": _stepwise_loglik(model, ids),
            "same_prompts": sum(s == new_tokens for s in same),
            "prompts": len(same),
            "agreeing_tokens": sum(same),
            "tokens": new_tokens * len(same),
        }
    return results


def _stepwise_loglik(model: Any, ids: torch.Tensor) -> float:
    """Sum of log p(token) over ``ids`` [1, T], each token's from a forward of
    the one before it alone (HF's own cache): a decode step's row count."""
    cache = transformers.DynamicCache(config=model.config)
    total = 0.0
    with torch.no_grad():
        for i in range(ids.shape[1] - 1):
            logits = model(ids[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1]
            total += logits.log_softmax(-1)[ids[0, i + 1]].item()
    return total


def _prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def main() -> None:
    print("load", os.getloadavg())
    for name, ms in layers().items():
        print(f"{name:48s} {ms:8.1f} ms")
    for name, ms in layers(repeats=5, cpu_time=True).items():
        print(f"{name + ', 1 thread CPU time':48s} {ms:8.1f} ms")
    for name, ms in steps().items():
        print(f"{name:48s} {ms:8.1f} ms")
    base = None
    for mode, r in accuracy().items():
        base = base or r
        print(
            f"{mode:13s} greedy: {r['same_prompts']}/{r['prompts']} prompts identical,"
            f" {r['agreeing_tokens']}/{r['tokens']} tokens before the first difference;"
            f" passage log-lik {r['loglik']:.3f} (delta {r['loglik'] - base['loglik']:+.4f}),"
            f" a token a forward {r['loglik_stepwise']:.3f}"
            f" (delta {r['loglik_stepwise'] - base['loglik_stepwise']:+.4f})"
        )
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
