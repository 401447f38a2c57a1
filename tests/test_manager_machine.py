"""KVManager against a model of its rules: random steps from a state machine."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvsteps import (
    CopyFailed,
    TokenCache,
    assert_same_as_fresh_build,
    run_step,
)

from mstar.engine.resources.kv.invariants import check_owners
from mstar.engine.resources.kv.manager import (
    AllocationFailed,
    InvalidStep,
    KVManager,
    UnknownStream,
)
from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.plan import (
    build_paged_indptrs,
    group_by_plan_label,
)
from mstar.engine.resources.step import KVStep, Segment

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
