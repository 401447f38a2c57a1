"""The scheduler's steps: segments without tokens, the tokens on the step."""

from __future__ import annotations

import numpy as np

from mstar.engine.request import Request
from mstar.engine.resources.step import Segment
from mstar.engine.sampling.params import SamplingParams
from mstar.engine.scheduler import PLAN_LABEL, requests_before, schedule


def request(rid: str, streams: dict[str, list[int]], fed: dict[str, int]) -> Request:
    return Request(rid, [], SamplingParams(), [], streams=streams, fed=fed)


def running() -> dict[str, Request]:
    return {
        "p": request("p", {"main": [10, 11, 12, 13, 14]}, {"main": 1}),  # prefilling
        "d": request("d", {"main": [1, 2, 3, 4]}, {"main": 3}),  # decoding
        "g": request("g", {"cond": [5, 6], "uncond": [7, 8, 9]}, {"cond": 1, "uncond": 0}),
    }


def test_a_step_carries_each_streams_next_tokens_in_segment_order():
    step = schedule(running().values(), budget=7)
    assert step.segments == (
        Segment("d", "main", 1),
        Segment("g", "cond", 1),
        Segment("p", "main", 4),
        Segment("g", "uncond", 1),  # the budget's last
    )
    assert step.tokens.dtype == np.int64
    assert step.tokens.tolist() == [4, 6, 11, 12, 13, 14, 7]
    assert step.combined_labels == {("main", "cond", "uncond"): PLAN_LABEL}


def test_a_step_cut_before_a_request_keeps_the_others_tokens():
    step = schedule(running().values(), budget=7)  # requests in order d, g, p
    cut = requests_before(step, "p")
    assert [s[:3] for s in cut.segments] == [("d", "main", 1), ("g", "cond", 1), ("g", "uncond", 1)]
    assert cut.tokens.tolist() == [4, 6, 7]
    assert requests_before(cut, "d") is None
