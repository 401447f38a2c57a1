"""positions: each query token's position, read from the plan."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.engine.resources.kv.plan import KVPlanOutput, SequenceView, build_paged_indptrs
from mstar.engine.resources.position import positions

PAGE_SIZE = 4


def _plan(views: list[SequenceView]) -> KVPlanOutput:
    return KVPlanOutput(build_paged_indptrs(views, PAGE_SIZE), views=views)


@st.composite
def views(draw):
    out = []
    for i in range(draw(st.integers(0, 5))):
        to_compute = draw(st.integers(0, 7))
        length = to_compute + draw(st.integers(0, 30))
        start = draw(st.integers(0, 9))
        pages = list(range(-(-(start + length) // PAGE_SIZE)))
        out.append(SequenceView(f"r{i}", "text", pages, length, to_compute, start))
    return out


@settings(max_examples=30, deadline=None)
@given(views=views())
def test_positions_continue_each_stream(views):
    expected = [view.length - view.to_compute + j for view in views for j in range(view.to_compute)]
    got = positions(_plan(views))
    assert got.dtype == torch.int64
    assert got.device.type == "cpu"
    assert got.tolist() == expected


def test_fork_continues_the_source_positions():
    """A fork shares the source's pages and length, so both continue alike."""
    source = SequenceView("r", "text", [3, 7], 6, 2)
    fork = source._replace(label="fork")
    assert positions(_plan([source, fork])).tolist() == [4, 5, 4, 5]


@settings(max_examples=30, deadline=None)
@given(history=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=4), max_size=6))
def test_a_manager_plan_gives_positions_without_building_views(history):
    """Read from the index arrays while views are unbuilt, equal to the views'."""
    from mstar.engine.resources.kv.manager import KVManager
    from mstar.engine.resources.step import KVStep, Segment

    mgr = KVManager(num_pages=256, page_size=PAGE_SIZE)
    for spans in history:
        step = KVStep(tuple(Segment(f"r{i}", "text", n) for i, n in enumerate(spans)))
        mgr.admit(step)
        for plan in mgr.plan(step).values():
            fast = positions(plan)
            assert not plan.views_built
            expected = [
                v.length - v.to_compute + j for v in plan.views for j in range(v.to_compute)
            ]
            assert fast.tolist() == expected == positions(plan).tolist()
        mgr.commit(step)
