"""KVManager refuses bad input with a typed error naming the row, and rolls a
failed step back: either way nothing changes."""

import numpy as np
import pytest
from kvsteps import (
    CopyFailed,
    TokenCache,
    one_view,
    run_step,
)

from mstar.engine.resources.kv.manager import (
    InvalidStep,
    KVManager,
)
from mstar.engine.resources.kv.plan import PinnedIndexRing
from mstar.engine.resources.step import KVStep, Segment


def full_state(mgr, keys):
    """Free pages, sharing, and every stream's length and page indices."""
    streams = {}
    for key in keys:
        step = KVStep((Segment(*key, 0),))
        mgr.admit(step)
        (view,) = [v for out in mgr.plan(step).values() for v in out.views]
        mgr.abort(step)
        streams[key] = (view.length, list(view.page_idxs))
    mgr.check_invariants()
    return mgr.num_free_pages, mgr.shared_pages(), streams


def filled(page_size=4, num_pages=32):
    cache = TokenCache(num_pages, page_size)
    mgr = KVManager(num_pages=num_pages, page_size=page_size, cache=cache)
    plans = run_step(mgr, ("r1", "a", 120 // 8), ("r2", "a", 6))
    return mgr, cache, plans


@pytest.mark.parametrize(
    "segment, error, match",
    [
        (("r1", "a", np.int8(100)), None, None),  # a small numpy int is fine: no wrap
        (("r1", "a", np.uint64(3)), None, None),
        (("r1", "a", 1.5), TypeError, "span an int, got 1.5"),
        (("r1", "a", 2.0), TypeError, "span an int, got 2.0"),
        (("r1", "a", np.float64(2.0)), TypeError, "span an int"),
        (("r1", "a", True), TypeError, "span an int, got True"),
        (("r1", "a", "3"), TypeError, "span an int, got '3'"),
        (("r1", "a", None), TypeError, "span an int, got None"),
        (("r1", "a", -1), InvalidStep, "span >= 0"),
        (("r1", "a", 2**31), InvalidStep, "< 2\\*\\*31"),
        (("r1", "a", np.uint64(2**63 + 5)), InvalidStep, "< 2\\*\\*31"),
        (("r1", "a", 2**31 - 10), InvalidStep, "length < 2\\*\\*31"),
        ((None, "a", 1), TypeError, "request_id and label to be str"),
        (("r9", None, 1), TypeError, "request_id and label to be str"),
    ],
)
def test_a_bad_span_or_key_is_refused_naming_the_row(segment, error, match):
    mgr, _, _ = filled()
    before = full_state(mgr, [("r1", "a"), ("r2", "a")])
    step = KVStep((Segment("r2", "a", 1), Segment(*segment)))
    if error is None:
        mgr.admit(step)
        mgr.plan(step)
        mgr.commit(step)
        assert mgr.stored_len("r1", "a") == 15 + int(segment[2])
        mgr.check_invariants()
        return
    with pytest.raises(error, match=match) as err:
        mgr.admit(step)
    if segment[0] is not None and segment[1] is not None:
        assert repr(segment[0]) in str(err.value) and repr(segment[1]) in str(err.value)
    assert full_state(mgr, [("r1", "a"), ("r2", "a")]) == before
    run_step(mgr, ("r1", "a", 3))  # a valid step still works
    assert mgr.stored_len("r1", "a") == 18


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"post_forks": ("a", "z")}, InvalidStep, "post-fork a \\(src, dst\\) pair"),
        ({"pre_forks": (("a", 3),)}, InvalidStep, "pre-fork a \\(src, dst\\) pair"),
        ({"combined_labels": [("a", "b")]}, TypeError, "combined_labels a dict"),
    ],
)
def test_malformed_forks_and_labels_are_refused(kwargs, error, match):
    mgr, _, _ = filled()
    before = full_state(mgr, [("r1", "a")])
    with pytest.raises(error, match=match):
        mgr.admit(KVStep((Segment("r1", "a", 1), Segment("r1", "b", 1)), **kwargs))
    assert full_state(mgr, [("r1", "a")]) == before


def test_rows_must_be_segments_and_steps_kvsteps():
    mgr, _, _ = filled()
    with pytest.raises(TypeError, match="expected Segment rows, got tuple"):
        mgr.admit(KVStep((("r1", "a", 1),)))
    with pytest.raises(TypeError, match="expected a KVStep"):
        mgr.admit((Segment("r1", "a", 1),))
    with pytest.raises(TypeError, match="label a str or None"):
        mgr.release("r1", 3)


@pytest.mark.parametrize(
    "num_pages, page_size, match",
    [
        (16, 2.5, "page_size an int"),
        (16, 4.0, "page_size an int"),
        ("16", 4, "num_pages an int"),
        (16, True, "page_size an int"),
        (16, 2**31, "page_size an int in"),
        (2**20, 2**12, "num_pages \\* page_size < 2\\*\\*31"),
        (0, 4, "num_pages an int in"),
    ],
)
def test_constructor_refuses_bad_sizes(num_pages, page_size, match):
    with pytest.raises(ValueError, match=match):
        KVManager(num_pages, page_size)


def test_a_refused_plan_does_not_advance_the_ring():
    ring = PinnedIndexRing()
    mgr = KVManager(num_pages=32, page_size=4, ring=ring)
    first = run_step(mgr, ("r1", "a", 5))["a"].cpu_indptrs.paged_kv_indices
    kept = first.tolist()
    for _ in range(3):
        with pytest.raises(InvalidStep, match="not admitted"):
            mgr.plan(KVStep((Segment("r1", "a", 1),)))
    run_step(mgr, ("r2", "a", 9))  # the one plan after the first: a different set
    assert first.tolist() == kept


def test_a_failed_fork_copy_leaks_nothing():
    mgr, cache, _ = filled()
    before = full_state(mgr, [("r1", "a"), ("r2", "a")])
    for when in ("pre_forks", "post_forks"):
        step = KVStep((Segment("r2", "a", 1),), **{when: (("a", "b"),)})
        mgr.admit(step)
        cache.fail = True
        with pytest.raises(CopyFailed):
            mgr.plan(step) if when == "pre_forks" else mgr.commit(step)
        mgr.check_invariants()
        mgr.abort(step)
        assert full_state(mgr, [("r1", "a"), ("r2", "a")]) == before
    mgr.release("r1")
    mgr.release("r2")
    assert mgr.num_free_pages == mgr.num_pages  # every page came back


def test_abort_restores_a_replaced_fork_target_and_lengths():
    mgr, _, _ = filled()
    run_step(mgr, ("r2", "b", 3))
    before = full_state(mgr, [("r2", "a"), ("r2", "b")])
    step = KVStep((Segment("r2", "a", 5),), pre_forks=(("a", "b"),))
    mgr.admit(step)
    plans = mgr.plan(step)
    assert one_view(plans, "r2", "a").length == 11
    mgr.abort(step)  # the forward failed
    assert full_state(mgr, [("r2", "a"), ("r2", "b")]) == before
    assert mgr.stored_len("r2", "b") == 3
    with pytest.raises(InvalidStep, match="not admitted"):
        mgr.commit(step)
    plans = run_step(mgr, ("r2", "a", 2))  # scheduled again at once
    view = one_view(plans, "r2", "a")
    assert (view.length, view.to_compute) == (8, 2)
