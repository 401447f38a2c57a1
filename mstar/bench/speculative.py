"""``mstar-kv bench --speculative``: SmolLM2 with n-gram drafts against the
same engine without, in the same run (interleaved turns), on prompts that
copy their input (a rewrite/copy workload) and on chat questions, at batch 1
and batch 32. Greedy outputs are compared token for token."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

TEXTS = (
    "The city council met on Tuesday to discuss the new park. Residents asked for more"
    " trees, a playground and longer opening hours. The council agreed to publish a plan"
    " by the end of the month and to hold a second meeting in the spring. Several"
    " speakers raised the question of parking near the entrance, and the mayor promised"
    " a study of traffic in the area before any decision is made. The budget for the"
    " first phase of the work is two million euros, paid for by the city and a regional"
    " grant. Work could begin next year if the plan is approved.",
    "Our library opens at nine in the morning and closes at six in the evening from"
    " Monday to Friday. On Saturdays it opens at ten and closes at four. It is closed on"
    " Sundays and public holidays. Members may borrow up to ten books at a time for three"
    " weeks, and may renew them twice online or at the front desk. Late returns cost"
    " twenty cents a day for each book. Children under twelve need a parent or guardian"
    " to sign their membership form. Computers and printers are available on the first"
    " floor, and the reading room on the second floor is kept quiet at all times.",
    "To reset your password, open the settings page and choose the security tab. Click"
    " the button that says change password, enter your current password, and then type"
    " the new password twice. The new password must have at least twelve characters,"
    " including one number and one symbol. When you are done, click save. You will be"
    " signed out of every device, and you will need to sign in again with the new"
    " password. If you have forgotten your current password, click the link on the sign"
    " in page instead, and we will send you an email with a reset link.",
)


def copy_prompt(text: str) -> str:
    return f"Repeat the following text exactly, without any comment:\n\n{text}"


def run_speculative(
    *, k: int = 4, quick: bool = False, repeat: int = 3, stage: Callable[[str], None] = print
) -> dict[str, Any]:
    """Per workload: tokens/s with and without drafts (the best of ``repeat``
    turns each), their ratio, acceptance and whether the outputs agree."""
    from mstar.cli.demo import CHAT_QUESTIONS
    from mstar.engine import Engine, SamplingParams
    from mstar.engine.prompts import chat_prompt
    from mstar.models.loader import load

    model, tokenizer = load("smollm2")
    copy_prompts = [chat_prompt(tokenizer, copy_prompt(t)) for t in TEXTS]
    chat = [chat_prompt(tokenizer, q) for q in CHAT_QUESTIONS]
    workloads = [  # (name, prompts, batch, new tokens)
        ("copy, batch 1", copy_prompts[:2] if quick else copy_prompts, 1, 160),
        ("chat, batch 1", chat[:2] if quick else chat[:4], 1, 64),
        ("chat, batch 32", (chat * 32)[:32], 32, 16 if quick else 32),
    ]
    rows = []
    for name, prompts, batch, new in workloads:
        params = SamplingParams(max_new_tokens=new)
        best: dict[bool, float] = {}
        outs: dict[bool, list] = {}
        spec_stats = None
        for turn in range(repeat):
            for spec in (False, True):
                stage(f"{name}: turn {turn + 1} of {repeat}, {'drafts' if spec else 'no drafts'}")
                eng = Engine(
                    model, tokenizer, speculative="ngram" if spec else None,
                    num_speculative_tokens=k,
                )  # fmt: skip
                start = time.perf_counter()
                done = []
                for i in range(0, len(prompts), batch):
                    done += eng.generate(prompts[i : i + batch], params)
                seconds = time.perf_counter() - start
                tokens = sum(len(c.outputs[0].token_ids) for c in done)
                best[spec] = max(best.get(spec, 0.0), tokens / seconds)
                outs[spec] = [c.outputs[0].token_ids for c in done]
                if spec:
                    spec_stats = eng.spec
        rows.append(
            {
                "workload": name,
                "requests": len(prompts),
                "new_tokens": new,
                "tokens_per_s": best[False],
                "spec_tokens_per_s": best[True],
                "speedup": best[True] / best[False],
                "acceptance": spec_stats.accepted / max(1, spec_stats.proposed),
                "mean_accepted": spec_stats.accepted / max(1, spec_stats.rows),
                "drafted_rows": spec_stats.rows,
                "same_tokens": outs[False] == outs[True],
            }
        )
    return {"k": k, "repeat": repeat, "rows": rows}


def format_speculative(result: dict[str, Any]) -> str:
    lines = [
        f"n-gram drafts, k = {result['k']}, best of {result['repeat']} turns each",
        "| workload | requests x new | tokens/s, no drafts | with drafts | speedup |"
        " acceptance | accepted a verify row | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['workload']} | {r['requests']} x {r['new_tokens']} | {r['tokens_per_s']:.1f} |"
            f" {r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance']:.0%} |"
            f" {r['mean_accepted']:.2f} ({r['drafted_rows']} rows) | {r['same_tokens']} |"
        )
    return "\n".join(lines)
