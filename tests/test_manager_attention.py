"""Paged attention over plans from the real KVManager, against a dense oracle
that keeps every (request, label) stream's whole K/V history.

Random keys and values make the pages' contents checkable through attention:
a fork that shares a page it should copy, a decode fast path that plans a stale
page, or a ``commit=False`` step whose tokens stay visible gives a wrong row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from oracles import dense_attention

from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import paged_attention
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.kv.plan import (
    KVPlanOutput,
    KVPlanOutputs,
    build_paged_indptrs,
    context_only_views,
)
from mstar.engine.resources.step import KVStep, Segment

HEAD_DIM = 8
TOL = 1e-5
NUM_PAGES = 1024  # enough that no workload here runs out
REQUESTS = ("r0", "r1", "r2")
LABELS = ("cond", "uncond", "x")
CFG = {("cond", "uncond"): "cfg"}
Stream = tuple[str, str]  # (request_id, label)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= TOL, f"{what}: max abs error {err}"


class Workload:
    """A KVManager over a real KVCache (so forks copy tail pages through
    ``copy_pages``), and the oracle: each stream's K/V ``[2, L, H_kv, D]``.

    ``run`` drives one step and checks, for every plan label, causal attention
    over history + the step's tokens and context-only attention over the
    history alone."""

    def __init__(self, page_size: int, heads: tuple[int, int], seed: int) -> None:
        self.page_size = page_size
        self.num_qo_heads, num_kv_heads = heads
        self.cache = KVCache(1, NUM_PAGES, page_size, num_kv_heads, HEAD_DIM)
        self.mgr = KVManager(NUM_PAGES, page_size, cache=self.cache)
        self.gen = torch.Generator().manual_seed(seed)
        self.history: dict[Stream, torch.Tensor] = {}
        self.empty = torch.zeros(2, 0, num_kv_heads, HEAD_DIM)
        self.fast_steps = 0  # steps planned off the previous decode step

    def run(self, step: KVStep) -> KVPlanOutputs:
        self.mgr.admit(step)
        plans = self.mgr.plan(step)
        self.fast_steps += any(out._views is None for out in plans.values())
        requests = list(dict.fromkeys(s.request_id for s in step.segments))
        self._fork(step.pre_forks, requests)
        spans = {(s.request_id, s.label): s.span for s in step.segments}
        assert sorted(row for out in plans.values() for row in out.rows) == sorted(spans)
        new = {}
        for out in plans.values():
            new.update(self._check(out, spans))
        self.mgr.commit(step)
        if step.commit:
            for key, kv in new.items():
                self.history[key] = torch.cat([self.history[key], kv], dim=1)
        self._fork(step.post_forks, requests)
        return plans

    def release(self, request_id: str, label: str | None = None) -> None:
        self.mgr.release(request_id, label)
        for key in [k for k in self.history if k[0] == request_id and label in (None, k[1])]:
            del self.history[key]

    def _fork(self, forks: tuple[tuple[str, str], ...], requests: list[str]) -> None:
        for src, dst in forks:
            for request_id in requests:
                self.history[(request_id, dst)] = self.history[(request_id, src)]

    def _check(self, out: KVPlanOutput, spans: dict[Stream, int]) -> dict[Stream, torch.Tensor]:
        """Write the label's new tokens, check both attentions, and return
        each row's new K/V."""
        rows = out.rows
        counts = [spans[row] for row in rows]
        assert np.diff(out.cpu_indptrs.qo_indptr.numpy()).tolist() == counts
        past = [self.history.setdefault(row, self.empty) for row in rows]
        new = [self._randn(2, n, self.cache.num_kv_heads) for n in counts]
        k, v = torch.cat(new, dim=1)
        self.cache.write(0, out, k, v)
        layer = self.cache.layer(0)

        q = self._randn(sum(counts), self.num_qo_heads)
        expected = [
            dense_attention(qr, *torch.cat([h, kv], dim=1))
            for qr, h, kv in zip(q.split(counts), past, new)
        ]
        _assert_close(paged_attention(q, layer, out.cpu_indptrs), torch.cat(expected), "causal")

        queries = [
            int(torch.randint(0, min(h.shape[1], 3) + 1, (), generator=self.gen)) for h in past
        ]
        views = context_only_views(out.views, queries, self.page_size)
        q = self._randn(sum(queries), self.num_qo_heads)
        got = paged_attention(
            q, layer, build_paged_indptrs(views, self.page_size), AttentionOptions(causal=False)
        )
        expected = [dense_attention(qr, *h, causal=False) for qr, h in zip(q.split(queries), past)]
        _assert_close(got, torch.cat(expected), "context-only")
        return dict(zip(rows, new))

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, HEAD_DIM, generator=self.gen)


def _step(*segments: tuple[str, str, int], **kwargs) -> KVStep:
    return KVStep(tuple(Segment(*s) for s in segments), **kwargs)


@pytest.mark.parametrize(("page_size", "heads"), [(3, (4, 2)), (1, (4, 1)), (16, (4, 2))])
def test_scripted_workload(page_size, heads):
    """Every feature once, in an order that makes each one matter: forks with
    partial tails that both sides then write, repeated decode steps across
    page boundaries, a dropped step, and pages reused after a release."""
    w = Workload(page_size, heads, seed=0)
    w.run(_step(("r0", "cond", 5), ("r0", "uncond", 4), ("r1", "x", 7), combined_labels=CFG))
    w.run(_step(("r1", "x", 4), ("r0", "cond", 1), ("r0", "uncond", 1), combined_labels=CFG))
    decode = (("r0", "cond", 1), ("r1", "x", 1), ("r0", "uncond", 1))
    for i in range(5):  # the second on runs off the decode cache; one is dropped
        w.run(_step(*decode, combined_labels=CFG, commit=i != 2))
    # A pre-fork: x copies cond before cond's chunk; then both write their tails.
    w.run(_step(("r0", "cond", 2), pre_forks=(("cond", "x"),)))
    w.run(_step(("r0", "x", 1), ("r0", "cond", 1), ("r1", "x", 4)))
    # A fork-only step for one request (r0 has an x and a cond too), then the
    # fork and its source decode into their own copies of the tail page.
    w.run(_step(("r1", "x", 0), post_forks=(("x", "cond"),)))
    assert w.mgr.shared_pages() > 0
    for _ in range(page_size + 2):
        w.run(_step(("r1", "x", 1), ("r1", "cond", 1)))
    # A post-fork of a dropped step copies the source as stored.
    w.run(_step(("r0", "x", 3), post_forks=(("x", "uncond"),), commit=False))
    w.run(_step(("r0", "uncond", 2), ("r0", "x", 1)))
    w.release("r1")
    w.run(_step(("r2", "x", 6), ("r0", "cond", 1)))  # r1's pages, reused
    w.release("r0", "uncond")
    for _ in range(3):
        w.run(_step(("r2", "x", 1), ("r0", "cond", 1)))
    assert w.fast_steps >= 4 + page_size  # the decode cache served the repeats


class WorkloadMachine(RuleBasedStateMachine):
    """Random steps: mixed chunks, decode rows and zero-span reads, combined
    labels, pre- and post-forks, dropped steps, bursts of identical decode
    steps (the fast path) and releases. Every step is checked by ``run``."""

    @initialize(
        page_size=st.sampled_from([1, 3, 16]),
        heads=st.sampled_from([(4, 2), (4, 1)]),
        seed=st.integers(0, 2**16),
    )
    def setup(self, page_size, heads, seed):
        self.w = Workload(page_size, heads, seed)
        self.last_decode = None

    def _labels(self, request_id: str) -> set[str]:
        return {label for r, label in self.w.history if r == request_id}

    def _forks(self, data, labels: dict[str, set[str]]) -> tuple[tuple[str, str], ...]:
        """Mostly none; else one from a label every request of the step has."""
        common = set.intersection(*labels.values())
        if not common or data.draw(st.integers(0, 2)):
            return ()
        src = data.draw(st.sampled_from(sorted(common)))
        dst = data.draw(st.sampled_from([label for label in LABELS if label != src]))
        for names in labels.values():
            names.add(dst)
        return ((src, dst),)

    @rule(data=st.data())
    def step(self, data):
        """Any mix of chunks, decode rows and zero-span reads, new streams included."""
        requests = data.draw(
            st.lists(st.sampled_from(REQUESTS), min_size=1, max_size=3, unique=True)
        )
        labels = {r: self._labels(r) for r in requests}
        pre_forks = self._forks(data, labels)
        segments = []
        for r in requests:
            for label in data.draw(st.lists(st.sampled_from(LABELS), min_size=1, unique=True)):
                segments.append(Segment(r, label, data.draw(st.sampled_from([0, 1, 1, 2, 4, 7]))))
                labels[r].add(label)
        present = {s.label for s in segments}
        combined = CFG if {"cond", "uncond"} <= present and data.draw(st.booleans()) else {}
        self.w.run(
            KVStep(
                tuple(segments),
                combined_labels=combined,
                pre_forks=pre_forks,
                post_forks=self._forks(data, labels),
                commit=data.draw(st.integers(0, 3)) > 0,
            )
        )

    @precondition(lambda self: self.w.history)
    @rule(data=st.data(), repeats=st.integers(2, 4))
    def decode_burst(self, data, repeats):
        """Identical decode steps: the first planned in full, the rest off it."""
        rows = data.draw(st.lists(st.sampled_from(sorted(self.w.history)), min_size=1, unique=True))
        present = {label for _, label in rows}
        combined = CFG if {"cond", "uncond"} <= present and data.draw(st.booleans()) else {}
        segments = tuple(Segment(r, label, 1) for r, label in rows)
        for _ in range(repeats):
            self.w.run(KVStep(segments, combined, commit=data.draw(st.integers(0, 4)) > 0))
        self.last_decode = segments, combined

    @precondition(lambda self: self.last_decode is not None)
    @rule()
    def repeat_decode(self):
        """The last decode burst's step again, after whatever came between."""
        self.w.run(KVStep(*self.last_decode))

    @precondition(lambda self: self.w.history)
    @rule(data=st.data())
    def fork_one(self, data):
        """A zero-span step for one request, so only its streams fork."""
        request_id, src = data.draw(st.sampled_from(sorted(self.w.history)))
        fork = ((src, data.draw(st.sampled_from([lab for lab in LABELS if lab != src]))),)
        when = data.draw(st.sampled_from(["pre_forks", "post_forks"]))
        self.w.run(KVStep((Segment(request_id, src, 0),), **{when: fork}))

    @precondition(lambda self: self.w.history)
    @rule(data=st.data())
    def release(self, data):
        request_id, label = data.draw(st.sampled_from(sorted(self.w.history)))
        self.w.release(request_id, label if data.draw(st.booleans()) else None)


TestWorkloadMachine = WorkloadMachine.TestCase
TestWorkloadMachine.settings = settings(max_examples=20, stateful_step_count=25, deadline=None)
