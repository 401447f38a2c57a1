"""What one step computes: decode rows first, then chunked prefill, under a
token budget. Pure: it reads requests and returns segments."""

from __future__ import annotations

from collections.abc import Iterable

from mstar.engine.request import Request
from mstar.engine.resources.step import KVStep, Segment

PLAN_LABEL = "step"


def schedule(requests: Iterable[Request], budget: int) -> list[Segment]:
    """Segments for ``requests`` (oldest first): streams with one token left
    to feed decode, then streams with more left take prefill chunks, in order
    until ``budget`` tokens are spent. Each segment carries its token ids.
    (A guided request's two streams need not decode in the same step: the
    first one's logits wait for its twin's.)"""
    requests = list(requests)
    segments: list[Segment] = []
    for req in requests:
        for label, toks in req.streams.items():
            if budget and len(toks) - req.fed[label] == 1:
                segments.append(Segment(req.id, label, 1, (toks[-1],)))
                budget -= 1
    for req in requests:
        for label, toks in req.streams.items():
            fed = req.fed[label]
            span = min(len(toks) - fed, budget)
            if len(toks) - fed > 1 and span > 0:
                segments.append(Segment(req.id, label, span, tuple(toks[fed : fed + span])))
                budget -= span
    return segments


def kv_step(segments: list[Segment]) -> KVStep:
    """The step, every stream under one plan label: one packed forward (a
    guided request's cond/uncond streams included)."""
    labels = tuple(dict.fromkeys(s.label for s in segments))
    return KVStep(tuple(segments), combined_labels={labels: PLAN_LABEL} if labels else {})
