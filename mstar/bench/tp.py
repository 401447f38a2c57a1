"""``mstar-kv bench --tp``: what tensor parallelism adds to a decode step.

A seeded Llama (8 heads, 4 KV heads) serves the same decode batches at TP=1
and TP=2 (gloo, this machine's cores) in one run. For each batch: the
driver's per-step message to the workers (bytes; microseconds to broadcast
it, header and payload), the whole step at TP=2 and at TP=1, and the
message's share of the TP=2 step. The model's own all-reduces are part of
the step, not of the message.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable

import numpy as np

from mstar.engine import Engine, SamplingParams

PROMPT = 48  # tokens per request, fed before the timed decode steps
PAGE_SIZE = 16


def bench_llama(layers: int = 4):
    """A seeded random Llama that divides by 2 (saved by the caller)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def decode_steps(engine: Engine, batch: int, steps: int) -> tuple[list[float], float, int]:
    """Feed ``batch`` prompts, then time ``steps`` decode-only steps: each
    step's seconds, and the broadcast seconds and bytes of those steps
    (0 without tensor parallelism)."""
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
    ids = [engine.add_request(rng.integers(1, 2048, PROMPT).tolist(), params) for _ in range(batch)]
    while engine.stats.decode_steps == 0 or engine.stats.prefill_tokens < batch * PROMPT:
        engine.step()
    sent = engine.tp.stats if engine.tp is not None else None
    s0, b0 = (sent.seconds, sent.bytes) if sent else (0.0, 0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    s1, b1 = (sent.seconds, sent.bytes) if sent else (0.0, 0)
    for rid in ids:
        with contextlib.suppress(KeyError):  # the finished ones left already
            engine.abort(rid)
    return times, s1 - s0, b1 - b0


def run(
    batches: tuple[int, ...] = (1, 8, 32, 128),
    steps: int = 20,
    stage: Callable[[str], None] = print,
) -> list[dict]:
    """One row per batch: the figures of the module docstring, medians over ``steps``."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="mstar-bench-tp-") as folder:
        bench_llama().save_pretrained(folder)
        pages = max(batches) * (PROMPT + steps + 2 + PAGE_SIZE) // PAGE_SIZE + 1
        options = {"num_pages": pages, "page_size": PAGE_SIZE, "token_budget": 4096}
        stage("starting TP=2 (2 gloo ranks)")
        one = Engine.from_pretrained(folder, **options)
        with Engine.from_pretrained(folder, tensor_parallel_size=2, **options) as two:
            for batch in batches:
                stage(f"decode batch {batch}")
                # in turns, so the machine's load hits both
                t1, _, _ = decode_steps(one, batch, steps)
                t2, sent_s, sent_b = decode_steps(two, batch, steps)
                step1, step2 = float(np.median(t1)), float(np.median(t2))
                rows.append(
                    {
                        "batch": batch,
                        "message_bytes": sent_b // steps,
                        "broadcast_us": sent_s / steps * 1e6,
                        "tp2_step_ms": step2 * 1e3,
                        "tp1_step_ms": step1 * 1e3,
                        "tp2_over_tp1": step2 / step1,
                        "broadcast_share": sent_s / steps / step2,
                    }
                )
    return rows


def format_tp(rows: list[dict]) -> str:
    head = (
        f"{'decode batch':>12} {'message':>9} {'broadcast':>10} {'TP=2 step':>10}"
        f" {'TP=1 step':>10} {'TP=2/TP=1':>9} {'broadcast share':>16}"
    )
    lines = ["tensor parallelism: the driver's per-step message (2 gloo ranks)", head]
    for r in rows:
        lines.append(
            f"{r['batch']:>12} {r['message_bytes']:>7} B {r['broadcast_us']:>7.0f} µs"
            f" {r['tp2_step_ms']:>7.2f} ms {r['tp1_step_ms']:>7.2f} ms {r['tp2_over_tp1']:>8.2f}x"
            f" {r['broadcast_share']:>15.1%}"
        )
    return "\n".join(lines)
