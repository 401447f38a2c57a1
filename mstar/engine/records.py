"""What the engine reports besides completions: its counters (``EngineStats``)
and a step that failed (``StepFailed``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mstar.engine.resources.groups import KVGroups
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.step import KVStep

PLAN_SAMPLES = 100_000


class StepFailed(RuntimeError):
    """The model's forward or the sampling failed inside ``step``: the
    requests that step scheduled (``request_ids``) were aborted, their pages
    freed; the cause is chained. The other requests go on at the next step."""

    def __init__(self, request_ids: tuple[str, ...]) -> None:
        super().__init__(f"step failed; aborted the requests it scheduled: {list(request_ids)}")
        self.request_ids = request_ids


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    refused: int = 0
    peak_pages: int = 0
    peak_shared: int = 0
    spec_proposed: int = 0  # speculative draft tokens verified
    spec_accepted: int = 0  # of them, accepted
    plan_s: float = 0.0  # admit + plan + commit (and forks), the plan layer
    step_s: float = 0.0  # whole steps
    # KVManager.plan per step, the latest PLAN_SAMPLES steps
    plan_us: deque[float] = field(default_factory=lambda: deque(maxlen=PLAN_SAMPLES))

    def account(self, step: KVStep, seconds: float, mgr: KVManager | KVGroups) -> None:
        """Count ``step``, done in ``seconds``, and the pages ``mgr`` holds after it."""
        spans = [seg.span for seg in step.segments]
        self.steps += 1
        self.step_s += seconds
        self.decode_steps += all(x == 1 for x in spans)
        self.mixed_steps += any(x == 1 for x in spans) and any(x > 1 for x in spans)
        self.prefill_tokens += sum(x for x in spans if x > 1)
        self.decode_tokens += sum(x for x in spans if x == 1)
        self.peak_pages = max(self.peak_pages, mgr.num_pages - mgr.num_free_pages)
        self.peak_shared = max(self.peak_shared, mgr.shared_pages())
