"""KVManager's prefix cache: pages reused by content across requests.

The oracle is a token store: every page slot holds the token id written
there, so a stream that starts on cached pages must read back exactly the
prompt prefix it was matched on, and every registered page must hold the
tokens its key claims.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvsteps import TokenCache

from mstar.engine.resources.kv.manager import AllocationFailed, InvalidStep, KVManager
from mstar.engine.resources.step import KVStep, Segment


def serve(mgr, cache, rows, flat=False, **kwargs):
    """One step; ``rows`` is [(request, label, tokens)], the tokens on the
    segments or (``flat``) one array on the step; each view is checked
    against nothing here, the tokens are written where the plan says."""
    if flat:
        ids = np.array([t for _, _, tokens in rows for t in tokens], dtype=np.int64)
        segments = tuple(Segment(r, lab, len(t)) for r, lab, t in rows)
        step = KVStep(segments, tokens=ids, **kwargs)
    else:
        step = KVStep(tuple(Segment(r, lab, len(t), t) for r, lab, t in rows), **kwargs)
    mgr.admit(step)
    plans = mgr.plan(step)
    views = {(v.request_id, v.label): v for out in plans.values() for v in out.views}
    for r, lab, t in rows:
        cache.write(views[r, lab], list(t))
    mgr.commit(step)
    return views


def test_a_shared_prompt_is_served_from_cache():
    cache = TokenCache(64, 4)
    mgr = KVManager(64, 4, cache=cache, prefix_cache=True)
    system = list(range(100, 110))  # 10 tokens: two full pages and a partial one
    serve(mgr, cache, [("a", "main", [*system, 1, 2, 3])])
    assert mgr.prefix_stats()["pages_cached"] == 3  # 13 tokens: three full pages
    assert mgr.match_prefix("b", "main", [*system, 7, 8]) == 10  # two pages and 2 of a's third
    view = serve(mgr, cache, [("b", "main", [7, 8])])["b", "main"]
    assert cache.read(view, 12) == [*system, 7, 8]
    mgr.release("a")
    mgr.release("b")
    assert mgr.num_free_pages == 64 and mgr.num_cached_pages > 0  # cached, yet free
    assert mgr.match_prefix("c", "main", [*system, 1, 2, 3]) == 12
    stats = mgr.prefix_stats()
    assert (stats["tokens_queried"], stats["tokens_hit"]) == (25, 22)
    mgr.check_invariants()


def test_equal_tokens_after_different_prefixes_or_namespaces_never_match():
    cache = TokenCache(32, 2)
    mgr = KVManager(32, 2, cache=cache, prefix_cache=True)
    serve(mgr, cache, [("a", "main", [1, 2, 3, 4, 5])])
    assert mgr.match_prefix("b", "main", [9, 9, 3, 4, 5]) == 0
    assert mgr.match_prefix("c", "main", [1, 2, 3, 4, 5], namespace="lora-1") == 0
    assert mgr.match_prefix("d", "main", [1, 2, 3, 4, 5]) == 4
    assert mgr.match_prefix("e", "main", [1, 2, 3, 4]) == 3  # one token left to compute


def test_eviction_frees_cached_pages_least_recently_used_and_never_fails_a_step():
    cache = TokenCache(6, 2)
    mgr = KVManager(6, 2, cache=cache, prefix_cache=True)
    serve(mgr, cache, [("a", "main", [1, 2, 3, 4, 5, 6])])  # 3 full pages
    mgr.release("a")
    assert mgr.num_free_pages == 6 and mgr.num_cached_pages == 3
    serve(mgr, cache, [("b", "main", list(range(10, 20)))])  # needs 5 pages: evicts 2
    assert mgr.prefix_stats()["pages_evicted"] == 2
    assert mgr.match_prefix("c", "main", [1, 2, 3, 4, 5, 6, 7]) == 2  # the first page is left
    mgr.check_invariants()
    with pytest.raises(AllocationFailed):  # as with the cache off: 6 pages, 5 + 1 held
        serve(mgr, cache, [("d", "main", [0] * 3)])


def test_a_fork_continues_its_sources_chain():
    cache = TokenCache(32, 4)
    mgr = KVManager(32, 4, cache=cache, prefix_cache=True)
    serve(mgr, cache, [("a", "p", [1, 2, 3, 4, 5, 6])], post_forks=(("p", "s"),))
    serve(mgr, cache, [("a", "s", [7, 8, 9])])  # the copied tail page fills
    assert mgr.match_prefix("b", "main", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_decode_steps_extend_a_matched_chain_and_a_forks_chain():
    """Pages that decode steps fill (recorded in batches) hang off the right
    parent: after a stream started on cached pages, and after a fork."""
    cache = TokenCache(32, 2)
    mgr = KVManager(32, 2, cache=cache, prefix_cache=True)
    serve(mgr, cache, [("a", "main", [1, 2, 3, 4, 9])])
    assert mgr.match_prefix("b", "main", [1, 2, 3, 4, 5]) == 4  # starts on two cached pages
    for t in (5, 6):
        serve(mgr, cache, [("a", "main", [9]), ("b", "main", [t])], flat=True)
    assert mgr.match_prefix("c", "main", [1, 2, 3, 4, 5, 6, 0]) == 6
    serve(mgr, cache, [("b", "main", [7])], flat=True, post_forks=(("main", "f"),))
    serve(mgr, cache, [("b", "f", [8])], flat=True)
    assert mgr.match_prefix("d", "main", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    mgr.check_invariants()


@pytest.mark.parametrize(
    "tokens, match",
    [([1, 2], "tokens 3 integer ids"), ([1.5, 2, 3], "integer ids"), ("abc", "integer ids")],
)
def test_tokens_must_match_the_span(tokens, match):
    mgr = KVManager(8, 4, prefix_cache=True)
    with pytest.raises(InvalidStep, match=match):
        mgr.admit(KVStep((Segment("a", "main", 3, tokens),)))
    assert mgr.num_free_pages == 8 and mgr.labels("a") == []


def test_match_prefix_refuses_what_it_cannot_do():
    mgr = KVManager(8, 4)
    with pytest.raises(InvalidStep, match="prefix cache is off"):
        mgr.match_prefix("a", "main", [1, 2, 3])
    mgr = KVManager(8, 4, prefix_cache=True)
    mgr.match_prefix("a", "main", [1, 2, 3])
    with pytest.raises(InvalidStep, match="existing request 'a', label 'main'"):
        mgr.match_prefix("a", "main", [1, 2, 3])
    with pytest.raises(TypeError, match="1-D sequence of int ids"):
        mgr.match_prefix("b", "main", [[1, 2]])


VOCAB = 3  # few token ids, so prompts share prefixes and diverge inside pages


class PrefixMachine(RuleBasedStateMachine):
    """Requests share random prefixes of each other's streams, start on what
    the cache holds, decode, fork, leave; the pool is small, so cached pages
    get evicted. Every stream reads back its exact tokens."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 40))
    def setup(self, page_size, num_pages):
        self.ps = page_size
        self.cache = TokenCache(num_pages, page_size)
        self.mgr = KVManager(num_pages, page_size, cache=self.cache, prefix_cache=True)
        self.hist: dict[tuple[str, str], list[int]] = {}
        self.count = 0

    def run(self, data, rows, **kwargs):
        free = self.mgr.num_free_pages
        flat = data.draw(st.booleans())  # tokens on the step or on its segments: the same cache
        try:
            views = serve(self.mgr, self.cache, rows, flat, **kwargs)
        except AllocationFailed:
            assert self.mgr.num_free_pages == free
            return
        for r, lab, t in rows:
            assert self.cache.read(views[r, lab], len(self.hist[r, lab])) == self.hist[r, lab]
            self.hist[r, lab] += list(t)
        for src, dst in kwargs.get("post_forks", ()):
            for r in dict.fromkeys(r for r, _, _ in rows):
                self.hist[r, dst] = list(self.hist[r, src])

    @rule(data=st.data())
    def arrive(self, data):
        self.count += 1
        key = (f"q{self.count}", "a")
        base = data.draw(st.sampled_from([[], *self.hist.values()]))
        cut = data.draw(st.integers(0, len(base)))
        tokens = base[:cut] + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
        stored = self.mgr.match_prefix(*key, tokens)
        assert stored < len(tokens)
        self.hist[key] = tokens[:stored]
        self.run(data, [(*key, tokens[stored:])])

    @rule(data=st.data())
    def decode(self, data):
        if self.hist:
            keys = data.draw(st.lists(st.sampled_from(sorted(self.hist)), unique=True, min_size=1))
            rows = [(*k, [data.draw(st.integers(0, VOCAB - 1))]) for k in keys]
            self.run(data, rows)

    @rule(data=st.data())
    def fork(self, data):
        mains = sorted(k for k in self.hist if k[1] == "a")
        if mains:
            key = data.draw(st.sampled_from(mains))
            self.run(
                data, [(*key, [data.draw(st.integers(0, VOCAB - 1))])], post_forks=(("a", "b"),)
            )

    @rule(data=st.data())
    def leave(self, data):
        if self.hist:
            request = data.draw(st.sampled_from(sorted({r for r, _ in self.hist})))
            self.mgr.release(request)
            self.hist = {k: v for k, v in self.hist.items() if k[0] != request}

    @invariant()
    def consistent(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        for key, tokens in self.hist.items():  # every stream reads back its tokens
            assert self.mgr.stored_len(*key) == len(tokens)
            pages = self.mgr.page_ids(*key)
            at = np.arange(len(tokens))
            assert self.cache.slots[pages[at // self.ps], at % self.ps].tolist() == tokens
        pool = self.mgr._pages  # every registered page holds the tokens its key claims
        registered = np.flatnonzero(pool.registry.registered)
        assert (self.cache.slots[registered] == pool.registry.tokens[registered]).all()
        for _, page, held in pool.tails.entries():  # and every tail the tokens it claims
            assert self.cache.slots[page, : len(held)].tolist() == held.tolist()


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_pages_filled_by_decode_steps_are_cached(page_size):
    cache = TokenCache(64, page_size)
    mgr = KVManager(64, page_size, cache=cache, prefix_cache=True)
    serve(mgr, cache, [("a", "main", [1, 2, 3]), ("b", "main", [5])])
    for t in range(10, 20):  # decode steps: one token a row, pages fill one by one
        serve(mgr, cache, [("a", "main", [t]), ("b", "main", [t])])
    tokens = [1, 2, 3, *range(10, 20), 99]
    assert mgr.match_prefix("c", "main", tokens) == 13 // page_size * page_size
    assert mgr.match_prefix("d", "main", [5, *range(10, 20), 99]) == 11 // page_size * page_size
    mgr.check_invariants()


def test_step_tokens_must_be_one_integer_array():
    segments = (Segment("a", "main", 2),)
    for bad, what in (
        ([1, 2], "list"),
        (np.array([1.0, 2.0]), "float64"),
        (np.array([[1, 2]]), r"\(1, 2\)"),
        (np.array([True, False]), "bool"),
    ):
        with pytest.raises(TypeError, match=f"1-D integer numpy array.*{what}.*'a', 'main'"):
            KVStep(segments, tokens=bad)


@pytest.mark.parametrize("count", [2, 4])
def test_step_tokens_must_number_the_spans_sum(count):
    mgr = KVManager(8, 4, prefix_cache=True)
    step = KVStep((Segment("a", "main", 2), Segment("b", "main", 1)), tokens=np.arange(count))
    with pytest.raises(InvalidStep, match=f"3 ids \\(its spans' sum\\), got {count}.*'a'"):
        mgr.admit(step)
    assert mgr.num_free_pages == 8 and mgr.labels("a") == [] and mgr.labels("b") == []


def test_tokens_on_the_step_and_its_segments_are_refused():
    mgr = KVManager(8, 4, prefix_cache=True)
    segments = (Segment("a", "main", 1), Segment("b", "main", 2, [5, 6]))
    with pytest.raises(InvalidStep, match=r"got both.*request 'b', label 'main'"):
        mgr.admit(KVStep(segments, tokens=np.arange(3)))
    assert mgr.num_free_pages == 8 and mgr.labels("a") == [] and mgr.labels("b") == []


def test_a_stream_extended_without_tokens_registers_nothing():
    cache = TokenCache(16, 2)
    mgr = KVManager(16, 2, cache=cache, prefix_cache=True)
    step = KVStep((Segment("a", "main", 3),))  # no tokens anywhere
    mgr.admit(step)
    mgr.plan(step)
    mgr.commit(step)
    for t in range(4):  # later tokens on the step: the chain is broken for good
        serve(mgr, cache, [("a", "main", [t])], flat=True)
    assert mgr.prefix_stats()["pages_cached"] == 0
    serve(mgr, cache, [("b", "main", [1, 2, 3, 4])], flat=True)
    assert mgr.prefix_stats()["pages_cached"] == 2


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_step_tokens_cache_what_segment_tokens_do(page_size):
    """The same steps, tokens on the segments or on the step: the same pages
    are cached under the same keys, the same prompts hit alike."""
    rng = np.random.default_rng(page_size)
    managers = []
    for flat in (False, True):
        cache = TokenCache(128, page_size)
        mgr = KVManager(128, page_size, cache=cache, prefix_cache=True)
        serve(mgr, cache, [("a", "main", [1, 2, 3]), ("b", "main", [1, 2, 3, 4, 5])], flat)
        for t in range(9):  # decode steps, then a step of mixed spans (one of 0)
            serve(mgr, cache, [("a", "main", [t]), ("b", "main", [t + 1])], flat)
        rows = [("a", "main", [7, 8]), ("b", "main", []), ("c", "main", [1, 2, 3, 9])]
        serve(mgr, cache, rows, flat)
        managers.append(mgr)
    prompts = [[1, 2, 3, *range(9), 7, 8, 0], [1, 2, 3, 4, 5, *range(1, 10), 0], [1, 2, 3, 9, 0]]
    prompts.append(rng.integers(0, 10, 20).tolist())
    hits = [[m.match_prefix(f"q{i}", "main", p) for i, p in enumerate(prompts)] for m in managers]
    assert hits[0] == hits[1] and hits[0][:3] == [
        14 // page_size * page_size,
        14 // page_size * page_size,
        4 // page_size * page_size,
    ]
    (a, b) = (m._pages.registry for m in managers)
    assert (a.registered == b.registered).all() and (a.key == b.key).all()
    assert managers[0].prefix_stats() == managers[1].prefix_stats()


def test_the_manager_copies_the_step_tokens_it_keeps():
    cache = TokenCache(16, 4)
    mgr = KVManager(16, 4, cache=cache, prefix_cache=True)
    serve(mgr, cache, [("a", "main", [1, 2, 3])])
    ids = np.zeros(1, dtype=np.int64)
    for t in (4, 5, 6, 7, 8):  # one array, refilled each step (decode steps wait to be recorded)
        ids[0] = t
        step = KVStep((Segment("a", "main", 1),), tokens=ids)
        mgr.admit(step)
        mgr.plan(step)
        mgr.commit(step)
    ids[0] = 99
    assert mgr.match_prefix("b", "main", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
