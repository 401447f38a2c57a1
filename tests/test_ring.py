"""PinnedIndexRing: page-locked index buffers, never aliased within a plan,
reused after depth plans."""

import itertools

import numpy as np
import pytest
import torch

from mstar.engine.resources.kv.plan import PinnedIndexRing


def _span(t):
    return t.data_ptr(), t.data_ptr() + 4 * t.numel()


def test_ring_takes_of_one_plan_never_alias():
    ring = PinnedIndexRing(numel=8, depth=2, per_plan=2)
    ring.begin_plan()
    taken = [ring.take(list(range(k, k + 5))) for k in range(7)]  # more takes than per_plan
    spans = sorted(_span(t) for t in taken)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert [t.tolist() for t in taken] == [list(range(k, k + 5)) for k in range(7)]
    assert all(t.dtype == torch.int32 and t.numel() == 5 for t in taken)


def test_ring_reuses_a_set_after_depth_plans():
    ring = PinnedIndexRing(numel=8, depth=3, per_plan=2)
    ptrs = []
    for _ in range(6):
        ring.begin_plan()
        ptrs.append((ring.take([1, 2]).data_ptr(), ring.take([3]).data_ptr()))
    assert ptrs[0] == ptrs[3] and ptrs[1] == ptrs[4] and ptrs[2] == ptrs[5]
    assert len({ptrs[0], ptrs[1], ptrs[2]}) == 3
    assert len({p for pair in ptrs[:3] for p in pair}) == 6


def test_ring_grows_a_buffer_for_a_long_value_and_takes_before_begin():
    ring = PinnedIndexRing(numel=4, depth=2, per_plan=1)
    values = np.arange(50, dtype=np.int64)
    got = ring.take(values)  # no begin_plan yet: behaves as if it had been called
    assert got.tolist() == values.tolist() and got.dtype == torch.int32
    assert ring.take([]).numel() == 0


@pytest.mark.parametrize(
    "values",
    [
        [2**40],
        [2**31],
        [-(2**31) - 1],
        [1.5],
        [1.0],
        ["1"],
        [None],
        [True],
        [np.float64(2.0)],
        [np.int64(2**32 + 1)],
        np.array([1.5]),
        np.array([True]),
        np.array([2**40]),
        np.array([2**31], dtype=np.uint32),
        np.array([[1, 2]], dtype=np.int32),
        np.array([[1, 2]], dtype=np.int64),
    ],
)
def test_ring_take_refuses_what_it_would_wrap_or_truncate(values):
    ring = PinnedIndexRing(numel=8, depth=2, per_plan=1)
    ring.begin_plan()
    first = ring.take([1, 2])
    with pytest.raises(ValueError, match="expected"):
        ring.take(values)
    assert ring._used == 1 and first.tolist() == [1, 2]  # nothing taken, nothing written


def test_ring_take_accepts_any_integer_in_int32_range():
    ring = PinnedIndexRing(numel=4, depth=2, per_plan=1)
    edge = [-(2**31), 2**31 - 1, 0]
    assert ring.take(edge).tolist() == edge
    assert ring.take([np.int64(5), np.uint8(7)]).tolist() == [5, 7]
    assert ring.take(np.array([2**31 - 1], dtype=np.uint64)).tolist() == [2**31 - 1]
    assert ring.take(np.array([-3, 4], dtype=np.int8)).tolist() == [-3, 4]
    assert ring.take(range(3)).tolist() == [0, 1, 2]


def test_ring_keeps_the_last_handed_out_plan_when_a_plan_is_refused():
    """A plan refused before its takes does not advance the ring; one that
    failed after some takes is dropped with ``discard_plan``: either way the
    next plan does not overwrite the last plan handed out."""
    ring = PinnedIndexRing(numel=8, depth=2, per_plan=1)
    ring.begin_plan()
    handed = ring.take([1, 2, 3])
    ring.begin_plan()  # a plan refused before any take
    ring.begin_plan()
    nxt = ring.take([9, 9, 9])
    assert _span(nxt) != _span(handed) and handed.tolist() == [1, 2, 3]
    ring.begin_plan()  # handed the plan above; this one fails after a take
    failed = ring.take([4, 4, 4])
    ring.discard_plan()
    ring.begin_plan()
    again = ring.take([5, 5, 5])
    assert _span(again) == _span(failed) and nxt.tolist() == [9, 9, 9]


@pytest.mark.parametrize("kwargs", [{"numel": 0}, {"depth": 0}, {"per_plan": 0}])
def test_ring_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="expected"):
        PinnedIndexRing(**kwargs)
