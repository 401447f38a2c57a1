"""A plan's rows as one packed forward's inputs: the tokens each row feeds and
the packed positions to take logits at."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from mstar.engine.request import Request
from mstar.engine.resources.groups import GroupPlans
from mstar.engine.resources.kv.plan import KVPlanOutput


class Packed(NamedTuple):
    """``ids``: the tokens fed, row after row. ``at``: the packed positions
    to take logits at, first one per ``prompt`` entry (a request and the
    prompt position whose logits give the next prompt token's logprobs), then
    those of each ``chosen`` row (a request and the stream label whose logits
    choose its next token: the row's last position, and for a verify row the
    positions of its draft before it)."""

    ids: list[int]
    at: list[int]
    prompt: list[tuple[Request, int]]
    chosen: list[tuple[Request, str]]


def pack(
    plan: KVPlanOutput | GroupPlans, running: Mapping[str, Request], touched: dict[str, Request]
) -> Packed:
    """Feed each row of ``plan`` its next tokens (``Request.feed``), its
    request from ``running``; each of them goes into ``touched``."""
    ids: list[int] = []
    at: list[int] = []
    chosen: list[tuple[Request, str]] = []
    prompt_rows: list[tuple[Request, int]] = []  # logits at prompt positions
    at_prompt: list[int] = []
    starts = plan.cpu_indptrs.qo_indptr.tolist()
    for (rid, label), start, end in zip(plan.rows, starts, starts[1:]):
        req = touched[rid] = running[rid]
        fed = req.fed[label]
        for p in req.prompt_positions(label, fed, end - start):
            prompt_rows.append((req, p))
            at_prompt.append(start + p - fed)
        tokens, choose = req.feed(label, end - start)
        ids += tokens
        if choose:
            at.append(end - 1)
            chosen.append((req, label))
            if label in req.draft:  # a verify row: logits at its draft's positions too
                at[-1:] = range(end - 1 - len(req.draft[label]), end)
    return Packed(ids, at_prompt + at, prompt_rows, chosen)
