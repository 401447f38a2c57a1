"""The engine's admission (``mstar.engine.admitter``) counts into whatever
``engine.stats`` is at the time: ``compiled_or_why`` swaps it out and back."""

import copy

import pytest

pytest.importorskip("transformers")

from mstar.demo import build_model
from mstar.engine import Engine, EngineStats, SamplingParams


def test_counts_go_to_the_stats_the_engine_holds_now():
    _, twin = build_model(seed=0)
    eng = Engine(copy.deepcopy(twin), num_pages=6, page_size=8, token_budget=64)
    first = eng.stats
    eng.stats = EngineStats()  # as compiled_or_why restores its copy
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    done = eng.generate([[i + 1] * 14 for i in range(3)], params)  # 3 x 3 pages at the peak
    assert [len(c.outputs[0].token_ids) for c in done] == [10] * 3
    assert eng.stats.preemptions > 0 and eng.stats.refused > 0 and eng.stats.plan_s > 0
    assert (first.preemptions, first.refused, first.plan_s) == (0, 0, 0.0)
