"""KVManager: scenario tests for each rule: the protocol, forks, decode steps."""

import queue
import threading

import numpy as np
import pytest
from kvsteps import (
    TokenCache,
    assert_same_as_fresh_build,
    decode_step,
    run_step,
    snapshot,
)

from mstar.engine.resources.kv.manager import (
    AllocationFailed,
    InvalidStep,
    KVError,
    KVManager,
    UnknownStream,
)
from mstar.engine.resources.kv.plan import (
    KVPlanOutputs,
    PinnedIndexRing,
    build_paged_indptrs,
    group_by_plan_label,
)
from mstar.engine.resources.step import KVStep, Segment

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
