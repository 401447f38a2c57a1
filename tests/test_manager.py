"""KVManager: scenario tests for each rule, and a state machine against a model."""

import queue
import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mstar.engine.resources.kv.invariants import check_owners
from mstar.engine.resources.kv.manager import (
    AllocationFailed,
    InvalidStep,
    KVError,
    KVManager,
    UnknownStream,
)
from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.plan import (
    KVPlanOutputs,
    PinnedIndexRing,
    build_paged_indptrs,
    group_by_plan_label,
)
from mstar.engine.resources.step import KVStep, Segment


class CopyFailed(RuntimeError):
    pass


class TokenCache:
    """A fake KV cache holding a token id per slot, so a stream's pages can be
    read back and compared with the tokens it was given."""

    def __init__(self, num_pages, page_size):
        self.page_size = page_size
        self.slots = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.copies = []
        self.fail = False  # the next copy_pages raises CopyFailed

    def copy_pages(self, src, dst):
        if self.fail:
            self.fail = False
            raise CopyFailed("copy_pages failed")
        self.copies.append((list(src), list(dst)))
        self.slots[np.asarray(dst)] = self.slots[np.asarray(src)]

    def write(self, view, tokens):
        assert len(tokens) == view.to_compute
        for j, token in enumerate(tokens):
            pos = view.length - view.to_compute + j
            self.slots[view.page_idxs[pos // self.page_size], pos % self.page_size] = token

    def read(self, view, n):
        return [
            int(self.slots[view.page_idxs[p // self.page_size], p % self.page_size])
            for p in range(n)
        ]


def run_step(mgr, *segments, **kwargs):
    step = KVStep(segments=tuple(Segment(*s) for s in segments), **kwargs)
    mgr.admit(step)
    plans = mgr.plan(step)
    mgr.commit(step)
    return plans


def one_view(plans, request_id, label):
    for out in plans.values():
        for view in out.views:
            if (view.request_id, view.label) == (request_id, label):
                return view
    raise AssertionError(f"no view for {request_id}/{label}")


def snapshot(mgr, streams):
    return mgr.num_free_pages, [mgr.stored_len(r, label) for r, label in streams]


# --- the basic protocol ------------------------------------------------------------------


def test_admit_plan_commit_views_and_indices():
    mgr = KVManager(num_pages=64, page_size=4)
    plans = run_step(mgr, ("r1", "main", 7), ("r2", "main", 1))
    assert isinstance(plans, KVPlanOutputs) and list(plans) == ["main"]
    out = plans["main"]
    v1, v2 = out.views
    assert (v1.length, v1.to_compute, len(v1.page_idxs)) == (7, 7, 2)
    assert (v2.length, v2.to_compute, len(v2.page_idxs)) == (1, 1, 1)
    assert out.rows == [("r1", "main"), ("r2", "main")]
    assert out.cpu_indptrs.qo_indptr.tolist() == [0, 7, 8]
    assert out.cpu_indptrs.paged_kv_last_page_len.tolist() == [3, 1]
    assert mgr.stored_len("r1", "main") == 7 and mgr.stored_len("r2", "main") == 1
    assert mgr.num_free_pages == 61
    plans = run_step(mgr, ("r1", "main", 2))
    v = plans["main"].views[0]
    assert (v.length, v.to_compute, list(v.page_idxs[:2])) == (9, 2, list(v1.page_idxs))
    assert v.generation != v1.generation
    mgr.check_invariants()


def test_zero_span_reads_without_extending():
    mgr = KVManager(num_pages=8, page_size=4)
    run_step(mgr, ("r", "a", 6))
    free = mgr.num_free_pages
    plans = run_step(mgr, ("r", "a", 0))
    v = plans["a"].views[0]
    assert (v.length, v.to_compute, len(v.page_idxs)) == (6, 0, 2)
    assert plans["a"].get_total_len() == 0
    assert mgr.stored_len("r", "a") == 6 and mgr.num_free_pages == free


def test_commit_false_keeps_the_reservation_not_the_tokens():
    mgr = KVManager(num_pages=8, page_size=4)
    run_step(mgr, ("r", "a", 4))
    plans = run_step(mgr, ("r", "a", 3), commit=False)
    assert mgr.stored_len("r", "a") == 4 and mgr.num_free_pages == 6
    again = run_step(mgr, ("r", "a", 3))
    assert mgr.num_free_pages == 6  # the reserved page was reused, not allocated again
    assert list(again["a"].views[0].page_idxs) == list(plans["a"].views[0].page_idxs)
    assert mgr.stored_len("r", "a") == 7
    mgr.check_invariants()


def test_combined_labels_order_and_outputs_carry_forks():
    mgr = KVManager(num_pages=32, page_size=4)
    run_step(mgr, ("r1", "cond", 3), ("r1", "uncond", 2), ("r2", "main", 1))
    segs = (Segment("r2", "main", 1), Segment("r1", "uncond", 1), Segment("r1", "cond", 1))
    step = KVStep(segs, combined_labels={("cond", "uncond"): "cfg"})
    mgr.admit(step)
    plans = mgr.plan(step)
    assert list(plans) == list(group_by_plan_label(segs, step.combined_labels)) == ["cfg", "main"]
    assert plans["cfg"].rows == [("r1", "cond"), ("r1", "uncond")]
    mgr.commit(step)
    plans = run_step(
        mgr, ("r2", "main", 1), pre_forks=(("main", "x"),), post_forks=(("main", "y"),)
    )
    assert plans.pre_forks == (("main", "x"),) and plans.post_forks == (("main", "y"),)


# --- refusals change nothing -------------------------------------------------------------


def test_allocation_failed_is_all_or_nothing():
    mgr = KVManager(num_pages=5, page_size=4)
    run_step(mgr, ("r1", "a", 8))
    before = snapshot(mgr, [("r1", "a")])
    step = KVStep((Segment("r1", "a", 4), Segment("r2", "a", 9)))
    with pytest.raises(AllocationFailed) as err:
        mgr.admit(step)
    assert isinstance(err.value, KVError)
    assert err.value.pages_short == 1
    assert (err.value.request_id, err.value.label) == ("r2", "a")
    assert "'r2'" in str(err.value) and "'a'" in str(err.value)
    assert snapshot(mgr, [("r1", "a")]) == before and mgr.labels("r2") == []
    mgr.check_invariants()
    with pytest.raises(InvalidStep, match="not admitted"):
        mgr.plan(step)


def test_fork_pages_count_at_admit():
    mgr = KVManager(num_pages=3, page_size=4)
    run_step(mgr, ("r", "a", 6))  # two pages, the last partial
    with pytest.raises(AllocationFailed) as err:  # the copied tail and b's new span: 2 > 1
        mgr.admit(KVStep((Segment("r", "b", 3),), pre_forks=(("a", "b"),)))
    assert (err.value.pages_short, err.value.label) == (1, "b")
    with pytest.raises(UnknownStream):  # b does not exist before the pre-fork creates it
        mgr.admit(KVStep((Segment("r", "a", 0),), pre_forks=(("b", "c"),)))
    run_step(mgr, ("r", "a", 0), pre_forks=(("a", "b"),))
    assert mgr.num_free_pages == 0 and mgr.stored_len("r", "b") == 6


@pytest.mark.parametrize(
    "segments, kwargs, match",
    [
        ((("r1", "a", -1),), {}, "span >= 0"),
        ((("r1", "a", 1), ("r1", "a", 2)), {}, "one segment per stream"),
        ((("r1", "a", 1),), {"pre_forks": (("zz", "b"),)}, "no stream 'zz'"),
        ((("r1", "a", 1),), {"post_forks": (("a", "a"),)}, "between two labels"),
        ((("r1", "a", 1),), {"combined_labels": {("a", "b"): "ab"}}, "combined_labels"),
    ],
)
def test_bad_steps_raise_naming_request_and_label(segments, kwargs, match):
    mgr = KVManager(num_pages=16, page_size=4)
    run_step(mgr, ("r1", "a", 5))
    before = snapshot(mgr, [("r1", "a")])
    with pytest.raises(KVError, match=match) as err:
        mgr.admit(KVStep(tuple(Segment(*s) for s in segments), **kwargs))
    assert err.value.request_id == "r1" and err.value.label is not None
    assert snapshot(mgr, [("r1", "a")]) == before
    mgr.check_invariants()
    run_step(mgr, ("r1", "a", 1))  # and the manager still works


def test_plan_or_commit_of_a_step_not_admitted():
    mgr = KVManager(num_pages=16, page_size=4)
    step = KVStep((Segment("r1", "a", 1),))
    for call in (mgr.plan, mgr.commit):
        with pytest.raises(InvalidStep, match="not admitted") as err:
            call(step)
        assert (err.value.request_id, err.value.label) == ("r1", "a")
    mgr.admit(step)
    with pytest.raises(InvalidStep, match="already admitted"):
        mgr.admit(step)
    with pytest.raises(InvalidStep, match="already in an admitted step"):
        mgr.admit(KVStep((Segment("r1", "b", 1),)))
    with pytest.raises(InvalidStep, match="commit or abort it first"):
        mgr.release("r1")
    mgr.plan(step)
    with pytest.raises(InvalidStep, match="already planned"):
        mgr.plan(step)
    mgr.commit(step)
    with pytest.raises(InvalidStep, match="not admitted"):
        mgr.commit(step)


def test_commit_without_plan_applies_the_step():
    mgr = KVManager(num_pages=16, page_size=4)
    run_step(mgr, ("r", "a", 6))
    step = KVStep((Segment("r", "a", 2),), pre_forks=(("a", "b"),))
    mgr.admit(step)
    mgr.commit(step)
    assert mgr.stored_len("r", "a") == 8 and mgr.stored_len("r", "b") == 6
    mgr.check_invariants()


def test_release_unknown_request_or_label():
    mgr = KVManager(num_pages=16, page_size=4)
    run_step(mgr, ("r", "a", 6))
    with pytest.raises(UnknownStream, match="'nobody'"):
        mgr.release("nobody")
    with pytest.raises(UnknownStream, match=r"'r'.*'zz'"):
        mgr.release("r", "zz")
    with pytest.raises(UnknownStream, match=r"'r'.*'zz'"):
        mgr.stored_len("r", "zz")
    assert mgr.stored_len("r", "a") == 6


# --- forks -------------------------------------------------------------------------------


def test_pre_fork_shares_full_pages_and_copies_the_tail():
    cache = TokenCache(16, 4)
    mgr = KVManager(num_pages=16, page_size=4, cache=cache)
    src = run_step(mgr, ("r", "a", 6))["a"].views[0]
    plans = run_step(mgr, ("r", "b", 1), pre_forks=(("a", "b"),))
    dst = plans["b"].views[0]
    assert plans.pre_forks == (("a", "b"),)
    assert dst.length == 7 and dst.page_idxs[0] == src.page_idxs[0]  # the full page, shared
    assert dst.page_idxs[1] != src.page_idxs[1]  # the partial page, copied
    assert cache.copies == [([src.page_idxs[1]], [dst.page_idxs[1]])]
    assert mgr.shared_pages() == 1
    mgr.check_invariants()


def test_post_fork_copies_the_source_after_the_step():
    mgr = KVManager(num_pages=16, page_size=4)
    run_step(mgr, ("r", "a", 6), post_forks=(("a", "b"), ("a", "c")))
    assert mgr.stored_len("r", "b") == mgr.stored_len("r", "c") == 6
    run_step(mgr, ("r", "a", 2), post_forks=(("a", "d"),), commit=False)
    assert mgr.stored_len("r", "d") == 6  # not committed: the source as stored
    mgr.check_invariants()


def test_fork_replaces_an_existing_target_and_frees_its_pages():
    mgr = KVManager(num_pages=16, page_size=4)
    run_step(mgr, ("r", "a", 4), ("r", "b", 12))
    assert mgr.num_free_pages == 12
    run_step(mgr, ("r", "a", 0), post_forks=(("a", "b"),))
    assert mgr.stored_len("r", "b") == 4 and mgr.num_free_pages == 15  # b's 3 pages went back
    mgr.check_invariants()


def test_fork_applies_to_every_request_of_the_step():
    mgr = KVManager(num_pages=16, page_size=4)
    run_step(mgr, ("r1", "a", 3), ("r2", "a", 5), post_forks=(("a", "s"),))
    assert mgr.stored_len("r1", "s") == 3 and mgr.stored_len("r2", "s") == 5


def test_a_page_returns_when_its_last_owner_releases():
    mgr = KVManager(num_pages=8, page_size=4)
    run_step(mgr, ("r", "a", 8), post_forks=(("a", "b"),))
    assert mgr.num_free_pages == 6  # two full pages, shared
    mgr.release("r", "a")
    assert mgr.num_free_pages == 6 and mgr.labels("r") == ["b"]
    mgr.release("r")
    assert mgr.num_free_pages == 8 and mgr.labels("r") == []
    mgr.check_invariants()


# --- decode ------------------------------------------------------------------------------


def decode_step(rows, label="main"):
    return KVStep(tuple(Segment(r, label, 1) for r in rows))


def assert_same_as_fresh_build(out, page_size):
    """A decode output equals the index arrays built from its own views."""
    views = out.views
    fresh = build_paged_indptrs(views, page_size)
    for a, b in zip(out.cpu_indptrs, fresh):
        assert a.tolist() == b.tolist()
    assert out.rows == [(v.request_id, v.label) for v in views]
    for view, page, offset in zip(views, out.decode_pages, out.decode_offsets):
        pos = view.length - 1
        assert (page, offset) == (view.page_idxs[pos // page_size], pos % page_size)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_repeated_decode_steps_plan_off_the_previous_one(page_size):
    mgr = KVManager(num_pages=512, page_size=page_size)
    rows = [f"r{i}" for i in range(5)]
    run_step(mgr, *((r, "main", 3 * i + 1) for i, r in enumerate(rows)))
    for k in range(2 * page_size + 3):
        step = decode_step(rows)
        mgr.admit(step)
        plans = mgr.plan(step)
        out = plans["main"]
        assert out.is_decode and out.decode_pages.dtype == np.int64
        assert out.decode_offsets.dtype == np.int64
        if k:  # from the second decode step on, views are built lazily
            assert out._views is None
        mgr.commit(step)
        assert_same_as_fresh_build(out, page_size)
        mgr.check_invariants()
    assert [mgr.stored_len(r, "main") for r in rows] == [
        3 * i + 1 + 2 * page_size + 3 for i in range(5)
    ]


def test_repeated_decode_after_commit_false_and_allocation_failure():
    mgr = KVManager(num_pages=4, page_size=2)
    run_step(mgr, ("a", "main", 1), ("b", "main", 1))
    run_step(mgr, ("a", "main", 1), ("b", "main", 1))  # cached
    run_step(mgr, ("a", "main", 1), ("b", "main", 1), commit=False)  # repeat, not kept
    assert mgr.stored_len("a", "main") == 2 and mgr.num_free_pages == 0
    plans = run_step(mgr, ("a", "main", 1), ("b", "main", 1))  # the reserved pages serve
    assert_same_as_fresh_build(plans["main"], 2)
    step = decode_step(["a", "b"])
    mgr.admit(step)
    mgr.commit(step)  # a decode step committed without a plan
    with pytest.raises(AllocationFailed) as err:
        mgr.admit(decode_step(["a", "b"]))
    assert (err.value.pages_short, err.value.request_id) == (2, "a")
    mgr.release("b")
    plans = run_step(mgr, ("a", "main", 1))
    assert_same_as_fresh_build(plans["main"], 2)
    mgr.check_invariants()


@pytest.mark.parametrize("few_rows", [0, 8])
def test_an_equal_step_after_its_stream_was_replaced_reads_the_new_stream(few_rows):
    """Equal rows reuse the last step's resolution only while its streams are
    the same: a stream released and made again (here by an aborted step, then
    by a prefix match) is resolved anew."""
    mgr = KVManager(num_pages=64, page_size=4, prefix_cache=True)
    mgr._paths.few_rows = few_rows
    prompt = list(range(9))
    step = KVStep((Segment("a", "main", 9, prompt), Segment("b", "main", 9, prompt)))
    for s in (step, KVStep(step.segments)):  # the second: equal segments, reused rows
        mgr.admit(s)
        mgr.plan(s)
        mgr.commit(s)
    mgr.release("b")
    again = KVStep((Segment("b", "main", 3, [1, 2, 3]),))
    mgr.admit(again)
    mgr.abort(again)  # b made and freed: no stream
    decode = (Segment("a", "main", 1, [5]), Segment("b", "main", 1, [5]))
    out = run_step(mgr, *decode)["main"]
    assert [v.length for v in out.views] == [19, 1]  # b is a new stream
    mgr.release("b")
    assert mgr.match_prefix("b", "main", prompt) == 8  # b again, on a's cached pages
    out = run_step(mgr, *decode)["main"]
    assert [v.length for v in out.views] == [20, 9]
    assert_same_as_fresh_build(out, 4)
    mgr.check_invariants()


def test_equal_steps_with_numpy_tokens_and_many_rows():
    """Segments whose numpy tokens cannot be compared as a whole take the
    checked path; a wide batch takes the array path, spliced."""
    mgr = KVManager(num_pages=2048, page_size=4, prefix_cache=True)
    rows = [f"r{i}" for i in range(80)]
    run_step(mgr, *((r, "main", 2 + i % 5, np.arange(2 + i % 5)) for i, r in enumerate(rows)))
    for k in range(6):
        for tokens in (np.array([k, k]), np.array([k, k])):  # equal, not identical
            out = run_step(mgr, *((r, "main", 2, tokens) for r in rows))["main"]
            fresh = build_paged_indptrs(out.views, 4)
            assert all(a.tolist() == b.tolist() for a, b in zip(out.cpu_indptrs, fresh))
    assert [mgr.stored_len(r, "main") for r in rows[:5]] == [26, 27, 28, 29, 30]
    mgr.check_invariants()


@pytest.mark.parametrize("tail_rows", [0, 8])
def test_spliced_plans_with_rows_joining_and_leaving_at_the_end(tail_rows):
    """A plan spliced from the label's last: rows that kept their place, then
    rows that joined (a prefill chunk, new requests) or left; each plan
    equals the arrays built from its own views."""
    mgr = KVManager(num_pages=1024, page_size=4)
    mgr._paths.few_rows, mgr._paths.splice_rows, mgr._paths.tail_rows = 0, 0, tail_rows
    rows = [f"r{i}" for i in range(6)]
    run_step(mgr, *((r, "main", 3 + 2 * i) for i, r in enumerate(rows)))
    joined = []
    for k in range(12):
        if k % 3 == 0:  # two requests join at the end, one with a long prefill
            joined += [(f"j{k}", 9), (f"q{k}", 1)]
        elif k % 3 == 2:  # the last joined leave
            for r, _ in joined[-2:]:
                mgr.release(r)
            joined = joined[:-2]
        step = [(r, "main", 1) for r in rows] + [(r, "main", n) for r, n in joined]
        out = run_step(mgr, *step)["main"]
        fresh = build_paged_indptrs(out.views, 4)
        assert all(a.tolist() == b.tolist() for a, b in zip(out.cpu_indptrs, fresh))
        joined = [(r, 1) for r, _ in joined]  # from now on they decode
        mgr.check_invariants()


def test_decode_with_combined_labels_and_a_ring():
    ring = PinnedIndexRing(numel=4, depth=2, per_plan=2)
    mgr = KVManager(num_pages=64, page_size=2, ring=ring)
    run_step(mgr, ("g", "cond", 3), ("g", "uncond", 2), ("x", "main", 1))
    combined = {("cond", "uncond"): "cfg"}
    segs = (Segment("g", "cond", 1), Segment("x", "main", 1), Segment("g", "uncond", 1))
    previous, previous_indices = None, None
    for _ in range(5):
        plans = run_step(mgr, *segs, combined_labels=combined)
        assert list(plans) == ["cfg", "main"]
        assert plans["cfg"].rows == [("g", "cond"), ("g", "uncond")]
        for out in plans.values():
            assert_same_as_fresh_build(out, 2)
        if previous is not None:  # a ring set is not rewritten by the very next plan
            assert previous["cfg"].cpu_indptrs.paged_kv_indices.tolist() == previous_indices
        previous = plans
        previous_indices = plans["cfg"].cpu_indptrs.paged_kv_indices.tolist()


def test_threads_admit_and_commit_while_another_plans():
    # Up to two other plans run between the thread's plan and its check: a ring
    # deep enough that they never take the thread's buffer set.
    mgr = KVManager(num_pages=256, page_size=4, ring=PinnedIndexRing(depth=3))
    planned_rows, other_rows = ["p0", "p1", "p2"], ["o0", "o1"]
    run_step(mgr, *((r, "main", 5) for r in planned_rows + other_rows))
    to_plan, done = queue.Queue(), queue.Queue()

    def planner():
        while (step := to_plan.get()) is not None:
            try:
                done.put(mgr.plan(step))
            except Exception as e:  # handed back to the main thread
                done.put(e)

    thread = threading.Thread(target=planner)
    thread.start()
    for i in range(100):
        step = decode_step(planned_rows)
        mgr.admit(step)
        to_plan.put(step)
        run_step(mgr, *((r, "main", 1 + i % 3) for r in other_rows))  # while the plan runs
        mgr.release("tmp") if i % 2 else run_step(mgr, ("tmp", "main", 7))
        plans = done.get()
        assert not isinstance(plans, Exception), plans
        assert_same_as_fresh_build(plans["main"], 4)
        mgr.commit(step)
    to_plan.put(None)
    thread.join()
    assert [mgr.stored_len(r, "main") for r in planned_rows] == [105] * 3
    assert mgr.stored_len("o0", "main") == 5 + sum(1 + i % 3 for i in range(100))
    mgr.check_invariants()


# --- the invariant checker itself ---------------------------------------------------------


def test_check_invariants_names_the_broken_rule():
    mgr = KVManager(num_pages=8, page_size=4)
    run_step(mgr, ("r", "a", 6), post_forks=(("a", "b"),))
    mgr.check_invariants()
    mgr._pages.refcount[mgr._pages.free_pages()[0]] = 1
    with pytest.raises(AssertionError, match="owner counts"):
        mgr.check_invariants()


# --- the state machine ---------------------------------------------------------------------

REQUESTS = ["r0", "r1", "r2"]
LABELS = ["a", "b", "c"]


class ManagerMachine(RuleBasedStateMachine):
    """Random steps against a model of the rules: each stream's token history
    and page count. A TokenCache makes the pages' contents checkable, so a
    fork that shares the wrong page, or a step that writes a shared page,
    shows up as a wrong history."""

    @initialize(
        page_size=st.sampled_from([1, 2, 3, 5]),
        num_pages=st.integers(3, 30),
        path=st.sampled_from(["few", "copy", "splice", "splice kept rows"]),
        sibling=st.integers(0, 2),
    )
    def setup(self, page_size, num_pages, path, sibling):
        """``sibling``: pages a second manager holds on a pool shared with
        this one (a hybrid's KV groups), 0: a pool of its own."""
        self.ps = page_size
        self.cache = TokenCache(num_pages, page_size)
        self.sibling, self.pool = None, PagePool(num_pages, page_size) if sibling else None
        if sibling:
            self.sibling = KVManager(num_pages, page_size, pool=self.pool)
            run_step(self.sibling, ("other", "main", sibling * page_size))
        self.mgr = KVManager(
            num_pages=num_pages, page_size=page_size, cache=self.cache, pool=self.pool
        )
        if path != "few":  # the array path, however few the rows
            self.mgr._paths.few_rows = 0
        if path.startswith("splice"):  # every plan spliced from the label's last
            self.mgr._paths.splice_rows = 0
        if path == "splice":  # by runs, unless every row kept its place
            self.mgr._paths.tail_rows = 0
        self.hist = {}  # (request, label) -> token ids
        self.pages = {}  # (request, label) -> pages held
        self.next_token = 0
        self.last_decode = None

    # -- the model of admission ------------------------------------------------------

    def model_need(self, step):
        """Pages the step needs, or the (request, label) of a missing fork source."""
        need = 0
        for request in dict.fromkeys(s.request_id for s in step.segments):
            sim = {
                lab: (len(h), self.pages[(r, lab)])
                for (r, lab), h in self.hist.items()
                if r == request
            }
            for src, dst in step.pre_forks:
                if src not in sim:
                    return None, (request, src)
                need += sim[src][0] % self.ps != 0
                sim[dst] = (sim[src][0], -(-sim[src][0] // self.ps))
            for seg in (s for s in step.segments if s.request_id == request):
                stored, pages = sim.get(seg.label, (0, 0))
                want = -(-(stored + seg.span) // self.ps)
                need += max(want - pages, 0)
                sim[seg.label] = (stored + seg.span * step.commit, max(pages, want))
            for src, dst in step.post_forks:
                if src not in sim:
                    return None, (request, src)
                need += sim[src][0] % self.ps != 0
                sim[dst] = (sim[src][0], -(-sim[src][0] // self.ps))
        return need, None

    def apply_fork(self, request, src, dst):
        self.hist[(request, dst)] = list(self.hist[(request, src)])
        self.pages[(request, dst)] = -(-len(self.hist[(request, dst)]) // self.ps)

    # -- rules ---------------------------------------------------------------------------

    @rule(data=st.data())
    def step(self, data):
        segments = []
        for request in data.draw(st.lists(st.sampled_from(REQUESTS), unique=True, max_size=3)):
            for label in data.draw(
                st.lists(st.sampled_from(LABELS), unique=True, min_size=1, max_size=2)
            ):
                segments.append(Segment(request, label, data.draw(st.integers(0, 7))))
        if data.draw(st.booleans()):  # a decode step
            segments = [s._replace(span=1) for s in segments]
        present = list(dict.fromkeys(s.label for s in segments))
        combined = {}
        if len(present) >= 2 and data.draw(st.booleans()):
            combined = {tuple(present[:2]): "combo"}

        def forks():  # mostly none; a source the step names, so most are valid
            if not present or data.draw(st.integers(0, 2)):
                return ()
            src = data.draw(st.sampled_from(present))
            return ((src, data.draw(st.sampled_from([lab for lab in LABELS if lab != src]))),)

        step = KVStep(
            tuple(segments),
            combined_labels=combined,
            pre_forks=forks(),
            post_forks=forks(),
            commit=data.draw(st.integers(0, 3)) > 0,
        )
        self.run(step, data)

    @rule(data=st.data())
    def repeat_decode(self, data):
        if self.last_decode is not None:
            self.run(
                KVStep(self.last_decode.segments, combined_labels=self.last_decode.combined_labels),
                data,
            )

    @rule(data=st.data())
    def release(self, data):
        request = data.draw(st.sampled_from(REQUESTS))
        labels = [lab for (r, lab) in self.hist if r == request]
        label = data.draw(st.sampled_from([None, *LABELS]))
        if not labels or (label is not None and label not in labels):
            before = self.mgr.num_free_pages
            with pytest.raises(UnknownStream):
                self.mgr.release(request, label)
            assert self.mgr.num_free_pages == before
            return
        self.mgr.release(request, label)
        for lab in labels if label is None else [label]:
            del self.hist[(request, lab)], self.pages[(request, lab)]

    @rule(data=st.data())
    def rewind(self, data):
        if not self.hist:
            return
        key = data.draw(st.sampled_from(sorted(self.hist)))
        n = data.draw(st.integers(0, len(self.hist[key])))
        before, new = self.state(), len(self.hist[key]) - n
        tail = self.mgr.page_ids(*key)[new // self.ps :][:1]
        shared = n and new % self.ps and self.mgr._pages.refcount[tail].item() > 1
        if shared:  # it would write over a page another stream reads
            with pytest.raises(InvalidStep, match="shared"):
                self.mgr.rewind(*key, n)
            assert self.state() == before
            return
        self.mgr.rewind(*key, n)
        del self.hist[key][new:]
        if n:  # a rewind of nothing changes nothing
            self.pages[key] = min(self.pages[key], -(-new // self.ps))
        assert self.mgr.held_pages(*key) == self.pages[key]

    # -- running one step against the model ------------------------------------------------

    def state(self):
        """Everything a refused or undone call must leave as it was."""
        streams = {
            key: (self.mgr.stored_len(*key), sorted(self.mgr.labels(key[0]))) for key in self.hist
        }
        return self.mgr.num_free_pages, self.mgr.shared_pages(), streams

    def run(self, step, data):
        need, missing = self.model_need(step)
        free = self.mgr.num_free_pages
        if missing is not None:
            with pytest.raises(UnknownStream) as err:
                self.mgr.admit(step)
            assert (err.value.request_id, err.value.label) == missing
            assert self.mgr.num_free_pages == free
            return
        if need > free:
            with pytest.raises(AllocationFailed) as err:
                self.mgr.admit(step)
            assert err.value.pages_short == need - free
            assert self.mgr.num_free_pages == free
            return
        before = self.state()
        self.mgr.admit(step)
        assert self.mgr.num_free_pages == free - need
        if data.draw(st.integers(0, 9)) == 0:  # abandoned after admit
            self.mgr.abort(step)
            assert self.state() == before
            return
        self.cache.fail = data.draw(st.integers(0, 3)) == 0
        try:
            plans = self.mgr.plan(step)
        except CopyFailed:  # a pre-fork's copy: the step is as admitted
            assert self.mgr.num_free_pages == free - need
            self.mgr.check_invariants()
            self.mgr.abort(step)
            assert self.state() == before
            return
        self.cache.fail = False
        requests = list(dict.fromkeys(s.request_id for s in step.segments))
        kept = {key: list(h) for key, h in self.hist.items()}  # the model before the step
        kept_pages = dict(self.pages)
        for src, dst in step.pre_forks:
            for request in requests:
                self.apply_fork(request, src, dst)
        assert list(plans) == list(group_by_plan_label(step.segments, step.combined_labels))
        assert (plans.pre_forks, plans.post_forks) == (step.pre_forks, step.post_forks)
        decode = bool(step.segments) and all(s.span == 1 for s in step.segments)
        new_tokens = {}
        for plan_label, segs in group_by_plan_label(step.segments, step.combined_labels).items():
            out = plans[plan_label]
            assert out.rows == [(s.request_id, s.label) for s in segs]
            assert (out.decode_pages is not None) == out.is_decode == all(s.span == 1 for s in segs)
            for seg, view in zip(segs, out.views):
                key = (seg.request_id, seg.label)
                stored = self.hist.setdefault(key, [])
                self.pages[key] = max(
                    self.pages.get(key, 0), -(-(len(stored) + seg.span) // self.ps)
                )
                assert (view.length, view.to_compute) == (len(stored) + seg.span, seg.span)
                assert len(view.page_idxs) == -(-view.length // self.ps)
                assert self.cache.read(view, len(stored)) == stored, (
                    "a stream's pages lost its tokens"
                )
                tokens = list(range(self.next_token, self.next_token + seg.span))
                self.next_token += seg.span
                self.cache.write(view, tokens)
                new_tokens[key] = tokens
            fresh = build_paged_indptrs(out.views, self.ps)
            for a, b in zip(out.cpu_indptrs, fresh):
                assert a.tolist() == b.tolist()
            if decode:
                assert_same_as_fresh_build(out, self.ps)
        if data.draw(st.integers(0, 9)) == 0:  # the forward failed: abandoned after plan
            self.mgr.abort(step)
            self.hist, self.pages = kept, kept_pages  # pre-forks and new streams undone
            assert self.state() == before
            return
        self.cache.fail = data.draw(st.integers(0, 3)) == 0
        keep = None  # a verify step: each row commits a prefix of its span
        if step.commit and not step.post_forks and data.draw(st.integers(0, 2)) == 0:
            keep = [data.draw(st.integers(0, s.span)) for s in step.segments]
        try:
            self.mgr.commit(step, keep)
        except CopyFailed:  # a post-fork's copy: nothing committed; then abandoned
            self.mgr.check_invariants()
            self.mgr.abort(step)
            self.hist, self.pages = kept, kept_pages
            assert self.state() == before
            return
        self.cache.fail = False
        if step.commit:
            for key, tokens in new_tokens.items():
                self.hist[key].extend(tokens)
        if keep is not None and any(k < s.span for k, s in zip(keep, step.segments)):
            for seg, k in zip(step.segments, keep):  # a short commit trims every row
                key = (seg.request_id, seg.label)
                del self.hist[key][len(self.hist[key]) - seg.span + k :]
                self.pages[key] = -(-len(self.hist[key]) // self.ps)
        for src, dst in step.post_forks:
            for request in requests:
                self.apply_fork(request, src, dst)
        self.last_decode = step if decode else self.last_decode

    @invariant()
    def consistent(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        if self.sibling is not None:  # the pool against both managers' owners
            check_owners(self.pool, self.mgr.owner_counts() + self.sibling.owner_counts())
        for (request, label), tokens in self.hist.items():
            assert self.mgr.stored_len(request, label) == len(tokens)
        for r in REQUESTS:
            assert set(self.mgr.labels(r)) == {lab for (q, lab) in self.hist if q == r}


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


# --- bad input never changes anything (issue: robustness) -----------------------------------


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


@pytest.mark.parametrize("splice_rows", [0, 64])
def test_a_held_plan_keeps_its_indices_while_later_plans_reuse_memory(monkeypatch, splice_rows):
    """Index arrays large enough to be recycled are reused only once nothing
    outside holds them: plans a consumer keeps never change under it."""
    monkeypatch.undo()  # the real recycler, not the test suite's poisoned one
    mgr = KVManager(num_pages=40_000, page_size=1)
    mgr._paths.splice_rows = splice_rows
    rows = [f"r{i}" for i in range(20)]
    run_step(mgr, *((r, "main", 1000 + i) for i, r in enumerate(rows)))
    held = []
    for k in range(12):
        out = run_step(mgr, *((r, "main", 1) for r in rows))["main"]
        if k % 3 == 0:  # keep some plans, drop the others
            held.append((out, out.cpu_indptrs.paged_kv_indices.clone()))
        for plan, indices in held:
            assert plan.cpu_indptrs.paged_kv_indices.equal(indices)
    assert len(out.cpu_indptrs.paged_kv_indices) > 1 << 14  # large enough to be recycled
    assert_same_as_fresh_build(held[0][0], 1)


@pytest.mark.parametrize("path", ["few", "copy", "splice"])
def test_rows_leaving_ahead_and_joining_behind_keep_every_stream(path):
    """Churn as a scheduler makes it: the oldest rows finish, new ones join at
    the end; each row keeps its own stream and length, and a spliced plan
    copies the kept rows' old indices from where they sat."""
    mgr = KVManager(num_pages=4096, page_size=4)
    mgr._paths.few_rows = 8 if path == "few" else 0
    mgr._paths.splice_rows = 0 if path == "splice" else 64
    names = [f"r{i}" for i in range(10)]
    length = {r: 3 + i for i, r in enumerate(names)}
    first = run_step(mgr, *((r, "main", n) for r, n in length.items()))["main"]
    pages = {v.request_id: v.page_idxs for v in first.views}
    for k in range(8):
        for r in names[: k % 3]:  # 0, 1 or 2 leave ahead
            mgr.release(r)
            del length[r]
        names = [*names[k % 3 :], f"j{k}"]
        length[f"j{k}"] = 0
        out = run_step(mgr, *((r, "main", 1) for r in names))["main"]
        for r in names:
            length[r] += 1
        assert [v.length for v in out.views] == [length[r] for r in names]
        for v in out.views:  # a stream's pages only ever grow, and are its own
            assert v.page_idxs[: len(pages.get(v.request_id, []))] == pages.get(v.request_id, [])
            pages[v.request_id] = v.page_idxs
        held = [p for v in out.views for p in v.page_idxs]
        assert len(held) == len(set(held))
        assert_same_as_fresh_build(out, 4)
        mgr.check_invariants()
