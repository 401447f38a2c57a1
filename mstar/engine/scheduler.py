"""What one step computes: decode rows first, then chunked prefill, under a
token budget. Pure: it reads requests and returns the step (segments, and
their new tokens as one array)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress

import numpy as np

from mstar.engine.request import Request
from mstar.engine.resources.step import KVStep, Segment

PLAN_LABEL = "step"


def schedule(requests: Iterable[Request], budget: int, max_chunk: int | None = None) -> KVStep:
    """The step for ``requests`` (oldest first): streams with one token left
    to feed decode, then streams with more left take prefill chunks (of at
    most ``max_chunk`` tokens), in order until ``budget`` tokens are spent. The segments carry no tokens; the
    step carries them all (``KVStep.tokens``), so a decode step's segments
    equal the last step's and the KV manager reuses their rows. (A guided
    request's two streams need not decode in the same step: the first one's
    logits wait for its twin's.)"""
    requests = list(requests)
    segments: list[Segment] = []
    ids: list[int] = []
    for req in requests:
        for label, toks in req.streams.items():
            if budget and len(toks) - req.fed[label] == 1:
                segments.append(Segment(req.id, label, 1))
                ids.append(toks[-1])
                budget -= 1
    for req in requests:
        for label, toks in req.streams.items():
            fed = req.fed[label]
            span = min(len(toks) - fed, budget, max_chunk or budget)
            if len(toks) - fed > 1 and span > 0:
                segments.append(Segment(req.id, label, span))
                ids += toks[fed : fed + span]
                budget -= span
    return kv_step(segments, np.array(ids, dtype=np.int64))


def kv_step(segments: Sequence[Segment], tokens: np.ndarray) -> KVStep:
    """The step of ``segments`` and their new ``tokens`` (in segment order),
    every stream under one plan label: one packed forward (a guided
    request's cond/uncond streams included)."""
    labels = tuple(dict.fromkeys(s.label for s in segments))
    return KVStep(
        tuple(segments), combined_labels={labels: PLAN_LABEL} if labels else {}, tokens=tokens
    )


def requests_before(step: KVStep, request_id: str) -> KVStep | None:
    """``step`` (segments and their tokens, as ``schedule`` makes it) cut to
    the requests whose first segment comes before ``request_id``'s (None
    when there are none)."""
    order = list(dict.fromkeys(s.request_id for s in step.segments))
    keep = set(order[: order.index(request_id)])
    kept = [s.request_id in keep for s in step.segments]
    if not any(kept):
        return None
    spans = [s.span for s in step.segments]
    return kv_step(list(compress(step.segments, kept)), step.tokens[np.repeat(kept, spans)])
