"""Admission and preemption: which of the engine's running requests hold KV pages.

Each step schedules the running requests under the token budget and admits
the step into the KV manager. With the prefix cache, a stream that has
computed nothing yet and whose next full page another stream computes in
the same step (the same tokens from the start: requests arriving together
with one system prompt) waits a step and takes that page from the cache
when it commits, instead of computing it too. When the pool refuses it, the requests before
the one refused are admitted; when none of it fits, the youngest request
holding KV is preempted (it keeps its generated tokens and recomputes prompt
+ generated later) and the step is scheduled again. Streams that ended give
their pages back after the step; finished and aborted requests leave.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from mstar.engine.intake import RequestTooLarge
from mstar.engine.records import EngineStats, StepFailed
from mstar.engine.request import Request, Sample
from mstar.engine.resources.groups import KVGroups
from mstar.engine.resources.kv.manager import AllocationFailed, KVManager
from mstar.engine.resources.step import KVStep, Segment
from mstar.engine.scheduler import requests_before, schedule


class Admitter:
    """One engine's admission policy over ``running`` (its unfinished
    requests, oldest first: the engine's own dict, from which this removes
    the requests that finish or are dropped) and the pool of ``mgr``. A step
    feeds at most ``budget`` tokens, at most ``max_chunk`` to one stream
    (None: the budget's); with ``prefix_cache`` a stream about to start first
    takes its longest cached prefix (and a stream whose next page another
    computes in the same step waits for it: ``_waits_for_shared``), and with
    ``tiers`` (a ``KVTiers``, set by
    ``kv.tiers.attach``) the pages below the pool that continue it: a request
    whose pages are being fetched is not scheduled until they are in the
    pool. Counts go to the ``EngineStats`` each call is given."""

    def __init__(
        self,
        mgr: KVManager | KVGroups,
        running: dict[str, Request],
        budget: int,
        max_chunk: int | None,
        prefix_cache: bool,
    ) -> None:
        self.mgr, self.running = mgr, running
        self.budget, self.max_chunk, self.prefix_cache = budget, max_chunk, prefix_cache
        self.tiers = None
        self._loading: set[str] = set()  # requests whose pages the tiers are fetching
        # streams holding a matched prefix and nothing computed: they may match more
        self._unstarted: set[tuple[str, str]] = set()

    def next_step(self, stats: EngineStats) -> KVStep | None:
        """The step to run, admitted: everything scheduled, or the requests
        before the first that did not fit; with nothing fitting, preempt the
        youngest request holding KV and schedule again. None when nothing is
        running. A request preempted here takes no cached prefix again until
        the next step (it would hold the pages it just gave back: a livelock).
        A request that cannot fit even alone is dropped: ``StepFailed`` names
        it, its cause is the ``RequestTooLarge``; the others go on at the next
        step. The time spent counts to ``stats.plan_s``."""
        t0 = time.perf_counter()
        preempted: set[str] = set()
        try:
            while self.running:
                waiting: set[str] = set()  # for a page another stream computes this step
                tried: set[tuple[str, str]] = set()  # streams matched in this call
                step = schedule(self._schedulable(waiting), self.budget, self.max_chunk)
                while self._reuse_prefixes(
                    step.segments, preempted, tried
                ) or self._waits_for_shared(step, waiting):  # less to compute:
                    step = schedule(self._schedulable(waiting), self.budget, self.max_chunk)
                if not step.segments and self._loading:  # all wait for the tiers
                    self.tiers.wait(0.05)
                    continue
                assert step.segments, "every running request has a token to feed"
                owner = self.running[step.segments[0].request_id]
                try:
                    step, victim = self._admit_or_preempt(step, owner, stats)
                except RequestTooLarge as err:
                    raise StepFailed((owner.id,)) from err
                if step is not None:
                    if self._unstarted:  # the streams in the step start now
                        self._unstarted.difference_update(
                            (s.request_id, s.label) for s in step.segments
                        )
                    return step
                preempted.add(victim.id)
            return None
        finally:
            stats.plan_s += time.perf_counter() - t0

    def fork(self, req: Request, stats: EngineStats) -> list[Sample] | None:
        """Admit and commit the step that forks ``req``'s prompt stream
        ``main`` into the first stream of each unfinished sample (full pages
        shared, the partial tail copied), preempting others as it must; those
        samples, or None when ``req`` itself was preempted (it is recomputed
        later, and forked then). A fork that cannot fit even alone raises
        ``RequestTooLarge`` (the request is dropped)."""
        live = [s for s in req.samples if s.finish_reason is None]
        forks = tuple(("main", s.labels[0]) for s in live)
        step = KVStep((Segment(req.id, "main", 0, ()),), post_forks=forks)
        while True:
            admitted, victim = self._admit_or_preempt(step, req, stats)
            if admitted is not None:
                break
            if victim is req:
                return None
        try:
            self.mgr.commit(step)
        except BaseException:
            self.mgr.abort(step)
            raise
        return live

    def release_unused(self, req: Request) -> None:
        """Give back the pages of streams the request no longer has; a finished
        request leaves the engine."""
        held = self.mgr.labels(req.id)
        if req.finished:
            if held:
                self.mgr.release(req.id)
            del self.running[req.id]
            return
        for label in held:
            if label not in req.streams:
                self.mgr.release(req.id, label)

    def abort(self, request_id: str) -> None:
        """Drop a running request; its pages return at once. ``KeyError``
        when no running request has that id."""
        req = self.running.pop(request_id, None)
        if self.tiers is not None:
            self.tiers.cancel(request_id)
            self._loading.discard(request_id)
        if req is None:
            raise KeyError(f"expected a running request id, got {request_id!r}")
        if self.mgr.labels(request_id):
            self.mgr.release(request_id)

    def _admit_or_preempt(
        self, step: KVStep, owner: Request, stats: EngineStats
    ) -> tuple[KVStep | None, Request | None]:
        """Admit ``step`` or, when the pool refuses it, the segments of its
        requests before the one refused (``owner``'s come first). When none of
        it fits, preempt the youngest request holding KV and return it: the
        caller builds its step again. ``(admitted step, None)`` or ``(None,
        preempted request)``. When no request but ``owner`` holds KV, it can
        never fit (it would hold as much again the next time it got here): it
        is dropped and ``RequestTooLarge`` raised, nothing else changed."""
        while True:
            try:
                self.mgr.admit(step)
                return step, None
            except AllocationFailed as err:
                stats.refused += 1
                step = requests_before(step, err.request_id)
                if step is None:
                    break
        holding = [r for r in self.running.values() if r.holds_kv()]
        if not holding or holding == [owner]:
            self.abort(owner.id)
            raise RequestTooLarge(
                f"request {owner.id!r} does not fit the pool of {self.mgr.num_pages} KV pages"
                " even with every other request preempted; dropped"
            )
        return None, self._preempt(holding[-1], stats)

    def _reuse_prefixes(
        self, segments: tuple[Segment, ...], skip: set[str], tried: set[tuple[str, str]]
    ) -> bool:
        """Streams about to start (scheduled, nothing computed yet) take their
        longest cached prefix, the requests in ``skip`` and the streams in
        ``tried`` (added to) excepted; True when one took more than it held.
        Matched only when scheduled: pages are registered as steps commit, so
        a stream matched early would miss them; one that waited a step
        (``_waits_for_shared``) matches anew."""
        if not self.prefix_cache:
            return False
        matched = False
        for rid, label, _, _ in segments:
            req = self.running[rid]
            fed = req.fed[label]
            if fed and (not self._unstarted or (rid, label) not in self._unstarted):
                continue  # started (the common case: a decode row)
            if rid in skip or (rid, label) in tried or req.prompt_logprobs is not None:
                # (prompt logprobs need every prompt position computed)
                self._start_unmatched(req, label)
                continue
            if label in self.mgr.labels(rid):  # matched before: match anew
                self.mgr.release(rid, label)
            tiers = self.tiers if fed == 0 else None  # (asked once a stream starts)
            space = req.cache_namespace
            if tiers is not None and not tiers.load((rid, label), req.streams[label], space):
                self._loading.add(rid)  # its pages are on their way: schedule the others
                matched = True  # (asked again once they are: they install then)
                continue
            tried.add((rid, label))
            req.fed[label] = self.mgr.match_prefix(rid, label, req.streams[label], space)
            if label in ("main", "cond") and not any(s.token_ids for s in req.samples):
                req.cached_tokens = min(req.fed[label], len(req.prompt))
            self._unstarted.add((rid, label))
            matched = matched or req.fed[label] > fed
        return matched

    def _start_unmatched(self, req: Request, label: str) -> None:
        """A stream of a request with a ``cache_namespace`` that takes no cached
        prefix starts in that namespace all the same (matching its first token
        alone reuses nothing), so the pages it computes are cached there, never
        in the default one; a no-op for any other stream."""
        rid = req.id
        if req.cache_namespace and req.fed[label] == 0 and label not in self.mgr.labels(rid):
            self.mgr.match_prefix(rid, label, req.streams[label][:1], req.cache_namespace)

    def _waits_for_shared(self, step: KVStep, waiting: set[str]) -> bool:
        """Requests with a stream about to start whose next full page (its
        tokens from position 0 to the page boundary after what it holds, a
        matched partial page's included) a stream of another request
        scheduled before it computes whole in ``step``: added to
        ``waiting``, to match that page once it commits; True when one was.
        (Nothing to do in a decode step: one token a row.)"""
        if not self.prefix_cache or len(step.tokens) == len(step.segments):
            return False
        size, added = self.mgr.page_size, False
        computing: list[tuple[list[int], int, int, str]] = []  # tokens, from, to, request
        for rid, label, span, _ in step.segments:
            req = self.running[rid]
            tokens, start = req.streams[label], req.fed[label]
            end = (start // size + 1) * size
            if (
                req.prompt_logprobs is None
                and (start == 0 or (rid, label) in self._unstarted)
                and end < len(tokens)
                and any(
                    other != rid and lo <= start and end <= hi and seen[:end] == tokens[:end]
                    for seen, lo, hi, other in computing
                )
            ):
                waiting.add(rid)
                added = True
            elif span >= size:
                computing.append((tokens, start, start + span, rid))
        return added

    def _schedulable(self, waiting: set[str]) -> Iterable[Request]:
        """The running requests, less those waiting for pages from the tiers
        or for a page another computes (``waiting``)."""
        if self._loading:
            self._loading = {r for r in self._loading if self.tiers.busy(r)}
        if self._unstarted:
            self._unstarted = {k for k in self._unstarted if k[0] in self.running}
        if not self._loading and not waiting:
            return self.running.values()
        return [
            r for r in self.running.values() if r.id not in self._loading and r.id not in waiting
        ]

    def _preempt(self, req: Request, stats: EngineStats) -> Request:
        """Free ``req``'s KV; it is recomputed later."""
        self.mgr.release(req.id)
        req.restart()
        stats.preemptions += 1
        return req
