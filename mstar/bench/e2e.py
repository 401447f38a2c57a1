"""End to end on SmolLM2: chat prompts through ``Engine.generate`` against
Hugging Face ``generate`` (one left-padded batch) and HF's own continuous
batching (``generate_batch``), same run, same greedy workload with EOS.

Every path's tokens are compared with HF ``generate`` on each prompt alone
(the oracle, untimed). The paths run in turn, once to warm up and then
``repeat`` rounds; each path's best run counts.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

NEW_TOKENS = 32


def run_e2e(
    *, quick: bool = False, repeat: int = 3, stage: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Figures as a dict: the workload, and per path its seconds, tokens/s and
    exact matches (plus, for the engine, the plan layer's share of the step).
    ``stage`` hears what is running (for a progress display)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from mstar.cli.demo import CHAT_QUESTIONS
    from mstar.engine import Engine, EngineStats, SamplingParams
    from mstar.engine.prompts import chat_prompt
    from mstar.models.loader import load

    stage("loading SmolLM2")
    model, tokenizer = load("smollm2")
    questions = CHAT_QUESTIONS[:4] if quick else CHAT_QUESTIONS
    prompts = [chat_prompt(tokenizer, q) for q in questions]
    eos = tokenizer.eos_token_id
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )
    oracle = []
    for i, p in enumerate(prompts):
        stage(f"the oracle: HF generate on prompt {i + 1} of {len(prompts)} alone")
        oracle.append(hf_one(model, p, config))
    paged = copy.deepcopy(model)
    engine = Engine(paged, tokenizer)  # defaults: page_size 16, budget 256, prefix cache on
    engine_stats: list[EngineStats] = []
    computed: dict[bool, int] = {}  # prefix cache on/off -> prompt tokens computed

    def ours(prefix_cache: bool = True) -> Callable[[], list[list[int]]]:
        # a fresh engine (an empty cache) each run, built before the clock
        # starts (a server allocates its pool once): only what the run shares
        eng = Engine(paged, tokenizer, prefix_cache=prefix_cache)

        def serve() -> list[list[int]]:
            done = eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
            if prefix_cache:
                engine_stats.append(eng.stats)
            hit = eng.mgr.prefix_stats()["tokens_hit"]
            computed[prefix_cache] = sum(map(len, prompts)) - hit
            return [c.outputs[0].token_ids for c in done]

        return serve

    def hf_padded() -> list[list[int]]:
        return _hf_padded(model, prompts, config)

    blocks = sum(
        engine.peak_pages(len(p), SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts
    )

    def hf_batch() -> list[list[int]]:
        cb = ContinuousBatchingConfig(  # sized like the engine's pool and budget
            page_size=engine.mgr.page_size,
            num_blocks=blocks,
            max_batch_tokens=engine.budget,
            allow_block_sharing=False,
        )
        out = model.generate_batch(
            inputs=prompts, generation_config=config, continuous_batching_config=cb
        )
        by_prompt = {tuple(o.prompt_ids): o.generated_tokens for o in out.values()}
        return [list(by_prompt[tuple(p)]) for p in prompts]

    # Each path's setup (untimed) returns what the clock times.
    paths: list[tuple[str, Callable[[], Callable[[], list[list[int]]]]]] = [
        ("Engine.generate", ours),
        ("Engine.generate, no prefix cache", lambda: ours(prefix_cache=False)),
        ("HF generate (left-padded batch)", lambda: hf_padded),
        ("HF generate_batch", lambda: hf_batch),
    ]
    best = dict.fromkeys((name for name, _ in paths), float("inf"))
    tokens: dict[str, list[list[int]]] = {}
    for run in range(repeat + 1):  # round-robin, so load changes hit every path alike
        for name, setup in paths:
            stage(f"{name}: {'warm-up' if run == 0 else f'run {run} of {repeat}'}")
            timed = setup()
            t0 = time.perf_counter()
            tokens[name] = timed()
            if run:
                best[name] = min(best[name], time.perf_counter() - t0)
    rows = []
    for name, _ in paths:
        generated = sum(len(t) for t in tokens[name])
        rows.append(
            {
                "path": name,
                "seconds": best[name],
                "tokens": generated,
                "tokens_per_s": generated / best[name],
                "prompts": len(prompts),
                "exact": sum(t == want for t, want in zip(tokens[name], oracle)),
            }
        )
    fastest = min(engine_stats[1:], key=lambda s: s.step_s)  # not the warm-up
    rows[0]["plan_share"] = fastest.plan_s / fastest.step_s
    rows[0]["steps"] = fastest.steps
    rows[0]["prompt_tokens_computed"] = computed[True]
    rows[1]["prompt_tokens_computed"] = computed[False]
    return {
        "workload": f"{len(prompts)} chat prompts, {NEW_TOKENS} new tokens, greedy, EOS on",
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def format_e2e(result: dict[str, Any]) -> str:
    """A plain-text table: seconds, tokens/s, ours against each path, exact matches."""
    title = (
        f"{result['workload']} ({result['threads']} threads); exact: == HF generate alone;"
        " prompt: prompt tokens computed"
    )
    table = format_rows(
        result["rows"],
        ("plan share", lambda r: f"{100 * r['plan_share']:.1f}%" if "plan_share" in r else ""),
        ("prompt", lambda r: str(r.get("prompt_tokens_computed", ""))),
    )
    return "\n".join([title, table])


def format_rows(rows: list[dict[str, Any]], *extra: tuple[str, Callable[[dict], str]]) -> str:
    """Paths as a table: seconds, tokens, tokens/s, the first row's tokens/s
    over each, exact matches, then each ``(heading, cell)`` of ``extra``."""
    ours = rows[0]["tokens_per_s"]
    head = ("path", "seconds", "tokens", "tokens/s", "ours / this", "exact", *(h for h, _ in extra))
    body = [
        (
            r["path"],
            f"{r['seconds']:.2f}",
            str(r["tokens"]),
            f"{r['tokens_per_s']:.1f}",
            f"{ours / r['tokens_per_s']:.2f}x",
            f"{r['exact']}/{r['prompts']}",
            *(cell(r) for _, cell in extra),
        )
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [
        "  ".join(
            x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths))
        )
        for line in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@torch.no_grad()
def hf_one(model: Any, prompt: list[int], config: Any) -> list[int]:
    """HF ``generate`` on ``prompt`` alone: its new tokens."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def _hf_padded(model: Any, prompts: list[list[int]], config: Any) -> list[list[int]]:
    """One left-padded batch; each row cut after its first EOS (pad == EOS)."""
    width = max(len(p) for p in prompts)
    pad = config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
    return [
        row[: row.index(config.eos_token_id) + 1] if config.eos_token_id in row else row
        for row in out
    ]
