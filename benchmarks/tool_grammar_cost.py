"""What the tool-call grammar adds to a decode step at batch 8 on SmolLM2.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/tool_grammar_cost.py [--rounds 5]

Two measurements, in alternating rounds (A/B, so load moves both alike):

1. The grammar's own host work per step: ``Grammars.mask`` over 8 rows
   (fill 8 bitmask rows, one apply on ``[8, vocab]`` float logits) and the
   8 matchers' ``accept_token``, the matchers walking a real call's tokens
   (hermes ``required``: calls alone; ``auto``: text, then a call).
2. ``Engine.step`` while 8 requests decode, plain against the same 8 as
   required tool calls (hermes, the two test tools): the whole step.

Reported: medians (and minima) in ms and the grammar's share of a plain
decode step. Times are process CPU time (all threads, as
``step_costs.py``), so other jobs on a shared machine move them less than
wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from toolcases import TOOLS

from mstar.engine import Engine, SamplingParams
from mstar.engine.loader import load
from mstar.serve.tools.calls import ParsedCall
from mstar.serve.tools.hermes import Hermes
from mstar.serve.tools.plan import ToolPlan

ROWS = 8
FUNCTIONS = [(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
CALL = ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def spec(choice: str):
    return ToolPlan(Hermes(), TOOLS, FUNCTIONS, choice, True).structured()


def mask_round(engine: Engine, tokenizer, choice: str) -> list[float]:
    """ms per step of mask + accepts over ROWS matchers along one call's tokens."""
    grammars = engine.pipeline.grammars
    text = ("Let me check. " if choice == "auto" else "") + Hermes().write([CALL])
    ids = tokenizer.encode(text)
    matchers = [grammars.matcher(spec(choice)) for _ in range(ROWS)]
    logits = torch.randn(ROWS, grammars.vocab_size)
    out = []
    for token in ids:
        t0 = time.process_time()
        grammars.mask(logits, matchers)
        for m in matchers:
            assert m.accept_token(token)
        out.append((time.process_time() - t0) * 1e3)
    return out


def step_round(engine: Engine, constrained: bool, steps: int) -> list[float]:
    """ms per decode step of ROWS requests (after their prefill)."""
    so = spec("required") if constrained else None
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0, structured_outputs=so)
    prompt = engine.encode_chat(QUESTION)
    for i in range(ROWS):
        engine.add_request(prompt, params, request_id=f"{constrained}-{i}-{time.time_ns()}")
    while engine.has_unfinished() and not all(
        r.samples[0].token_ids for r in engine._running.values()
    ):
        engine.step()  # prefill
    out = []
    for _ in range(steps):
        t0 = time.process_time()
        engine.step()
        out.append((time.process_time() - t0) * 1e3)
    while engine.has_unfinished():
        engine.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    model, tokenizer = load("smollm2")
    engine = Engine(model, tokenizer, num_pages=256, page_size=16)
    got: dict[str, list[float]] = {"mask required": [], "mask auto": [], "plain": [], "tools": []}
    for _ in range(args.rounds):
        got["plain"] += step_round(engine, False, args.steps)
        got["mask required"] += mask_round(engine, tokenizer, "required")
        got["tools"] += step_round(engine, True, args.steps)
        got["mask auto"] += mask_round(engine, tokenizer, "auto")
    plain = statistics.median(got["plain"])
    for name, values in got.items():
        med = statistics.median(values)
        print(
            f"{name:14s} median {med:7.3f} ms  min {min(values):7.3f} ms"
            f"  ({med / plain:6.1%} of a plain decode step at batch {ROWS}; n={len(values)})"
        )


if __name__ == "__main__":
    main()
