"""KVManager: the pages of every (request, label) stream, and the plans over them.

A step goes ``admit`` (reserve every page it will need, all or nothing) ->
``plan`` (apply pre-forks, hand out a ``KVPlanOutputs``) -> ``commit`` (advance
lengths, apply post-forks). Only ``admit`` allocates, so ``plan`` and
``commit`` never fail for memory.

Pages: a stream's pages hold its tokens in order, ``page_size`` each. A page
whose tokens are all stored is full and never written again, so forks share
full pages by reference count and copy only a partially filled last page.

State is struct-of-arrays by stream slot (stored length, page count,
generation, epoch) plus one growable int32 page table per stream, so a decode
step is array work: a step whose rows equal the previous decode step's is
admitted, planned and committed with a few vectorized ops, and only the rows
that crossed into a new page change the index arrays.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.plan import (
    HostLens,
    KVPlanOutput,
    KVPlanOutputs,
    PagedIndptrs,
    PinnedIndexRing,
    SequenceView,
    build_paged_indptrs,
    group_by_plan_label,
)
from mstar.engine.resources.step import KVStep, Segment


class KVError(Exception):
    """A request the manager refuses; it changed nothing."""

    def __init__(self, message: str, request_id: str | None = None, label: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.label = label


class AllocationFailed(KVError):
    """Not enough free pages for the step: ``pages_short`` more were needed,
    and (``request_id``, ``label``) is the first stream that did not fit."""

    def __init__(self, pages_short: int, request_id: str, label: str):
        super().__init__(
            f"out of KV pages: {pages_short} short at request {request_id!r}, label {label!r}",
            request_id,
            label,
        )
        self.pages_short = pages_short


class InvalidStep(KVError, ValueError):
    """A step (or a call order) the manager cannot accept."""


class UnknownStream(KVError, LookupError):
    """A (request, label) stream the manager does not hold."""


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class _Recycler:
    """int32 arrays whose memory is reused once nothing outside holds it.

    A repeated decode step makes one new index array; fresh multi-MB memory
    costs more in page faults than the copy into it (2 MB: ~1 ms of faults
    against ~0.2 ms of copying). An array is handed out again only when this
    pool's reference is its last: a published tensor, a view or a lazy view
    builder keeps its base alive, so memory a plan still uses is never reused.
    """

    def __init__(self, keep: int = 4) -> None:
        self._arrays: list[np.ndarray] = []
        self._keep = keep

    def empty(self, n: int) -> np.ndarray:
        arrays = self._arrays
        free = [i for i in range(len(arrays)) if sys.getrefcount(arrays[i]) == 2]
        for i in free:
            if len(arrays[i]) >= n:
                return arrays[i][:n]
        fresh = np.empty(n + n // 8 + 64, dtype=np.int32)  # room for steps to come
        if free:
            arrays[free[0]] = fresh
        elif len(arrays) < self._keep:
            arrays.append(fresh)
        return fresh[:n]


@dataclass(eq=False)
class _DecodeLabel:
    """One plan label of the last decode step: what the next identical step
    is planned off. Arrays are owned here and never written in place."""

    rows: list[tuple[str, str]]
    slots: np.ndarray  # int64 [B], plan order
    qo_indptr: np.ndarray  # int32 [B + 1], arange
    num_pages: np.ndarray  # int64 [B]
    kv_indptr: np.ndarray  # int32 [B + 1]
    indices: np.ndarray  # int32 [kv_indptr[-1]]

    @classmethod
    def of(
        cls, rows: list[tuple[str, str]], slots: np.ndarray, indptrs: PagedIndptrs
    ) -> _DecodeLabel:
        """From a freshly built plan (copied: a ring's buffers get reused)."""
        kv_indptr = indptrs.paged_kv_indptr.numpy().copy()
        return cls(
            rows,
            slots,
            indptrs.qo_indptr.numpy().copy(),
            np.diff(kv_indptr).astype(np.int64),
            kv_indptr,
            indptrs.paged_kv_indices.numpy().copy(),
        )

    def write_pages(self) -> np.ndarray:
        """Each row's last page, where its one new token goes: int64 [B]."""
        return self.indices[self.kv_indptr[1:] - 1].astype(np.int64)


@dataclass(eq=False)
class _DecodeCache:
    segments: tuple[Segment, ...]
    combined_labels: dict[tuple[str, ...], str]
    slots: np.ndarray  # int64 [B], batch order
    epochs: np.ndarray  # int64 [B]: the streams' epochs when cached
    labels: dict[str, _DecodeLabel]
    requests: dict[str, None]  # the step's requests, ordered


@dataclass(eq=False)
class _Admitted:
    """An admitted step: its reserved pages (handed out as forks and spans
    apply) and, for a repeated decode step, the cache it is planned off."""

    pool: np.ndarray
    groups: dict[str, list[Segment]] | None = None
    decode: _DecodeCache | None = None
    grow: np.ndarray | None = None  # bool [B]: rows that take a new page (fast path)
    used: int = 0
    planned: bool = False
    requests: dict[str, None] = field(default_factory=dict)  # ordered, O(1) membership


class KVManager:
    """Pages, streams and forks -> plans. Thread-safe: one lock guards the
    state, and nothing blocks while holding it (the ring's wait for its
    buffers happens before ``plan`` takes the lock)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        cache: Any | None = None,
        ring: PinnedIndexRing | None = None,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"expected num_pages, page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.cache = cache
        self.ring = ring
        self._lock = threading.Lock()
        self._pages = PagePool(num_pages)
        self._streams: dict[str, dict[str, int]] = {}  # request -> label -> slot
        self._tables: list[np.ndarray | None] = []
        self._stored = np.zeros(0, dtype=np.int64)
        self._npages = np.zeros(0, dtype=np.int64)
        self._gen = np.zeros(0, dtype=np.int64)
        self._epoch = np.zeros(0, dtype=np.int64)
        self._free_slots: list[int] = []
        self._tick = 0
        self._admitted: dict[KVStep, _Admitted] = {}
        self._decode: _DecodeCache | None = None
        self._recycler = _Recycler()

    # --- queries -----------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return self._pages.num_free

    def stored_len(self, request_id: str, label: str) -> int:
        """Tokens committed to the stream."""
        with self._lock:
            return int(self._stored[self._slot(request_id, label)])

    def labels(self, request_id: str) -> list[str]:
        """The labels of the request's streams (empty for an unknown request)."""
        with self._lock:
            return list(self._streams.get(request_id, ()))

    def shared_pages(self) -> int:
        """Page references saved by sharing: sum over pages of owners - 1."""
        with self._lock:
            return self._pages.shared()

    # --- the step protocol -------------------------------------------------------------

    def admit(self, step: KVStep) -> None:
        """Reserve every page ``step`` will need. Raises ``AllocationFailed``
        (or another ``KVError`` for a bad step) and then changes nothing."""
        with self._lock:
            if step in self._admitted:
                raise InvalidStep(f"step already admitted ({_describe(step)})", *_first_row(step))
            cache = self._repeated_decode(step)
            if cache is not None:
                self._admit_repeated_decode(step, cache)
                return
            groups = self._validate(step)
            need, short_at = self._pages_needed(step)
            if need > self._pages.num_free:
                raise AllocationFailed(need - self._pages.num_free, *short_at)
            requests = dict.fromkeys(s.request_id for s in step.segments)
            self._admitted[step] = _Admitted(self._pages.alloc(need), groups, requests=requests)

    def plan(self, step: KVStep) -> KVPlanOutputs:
        """Apply the pre-forks and return one ``KVPlanOutput`` per plan label,
        in ``group_by_plan_label`` order."""
        if self.ring is not None:
            self.ring.begin_plan()  # may wait for the buffers: before taking the lock
        with self._lock:
            rec = self._get_admitted(step)
            if rec.planned:
                raise InvalidStep(f"step already planned ({_describe(step)})", *_first_row(step))
            self._apply_spans(step, rec)
            if rec.decode is not None:
                outs = self._plan_repeated_decode(rec)
            else:
                outs = self._plan_general(step, rec)
            return KVPlanOutputs(outs, step.pre_forks, step.post_forks)

    def commit(self, step: KVStep) -> None:
        """Advance each stream by its span (unless ``step.commit`` is False:
        then the reservation stays), then apply the post-forks."""
        with self._lock:
            rec = self._get_admitted(step)
            self._apply_spans(step, rec)
            if rec.decode is not None:
                if step.commit:
                    self._stored[rec.decode.slots] += 1
                    self._touch(rec.decode.slots)
            else:
                if step.commit:
                    for seg in step.segments:
                        slot = self._streams[seg.request_id][seg.label]
                        self._stored[slot] += seg.span
                        self._touch(slot)
                for src, dst in step.post_forks:
                    for request_id in rec.requests:
                        self._fork(request_id, src, dst, rec)
            assert rec.used == len(rec.pool), "a step must use exactly the pages it reserved"
            del self._admitted[step]

    def release(self, request_id: str, label: str | None = None) -> None:
        """Free every stream of the request, or just ``label``'s. A page goes
        back to the pool when its last owner lets go."""
        with self._lock:
            if self._in_flight(request_id):
                raise InvalidStep(
                    f"request {request_id!r} is in an admitted step: commit it first",
                    request_id,
                    label,
                )
            if request_id not in self._streams:
                raise UnknownStream(f"unknown request {request_id!r}", request_id, label)
            labels = list(self._streams[request_id]) if label is None else [label]
            self._slot(request_id, labels[0])  # an unknown label raises before any change
            for name in labels:
                self._drop(request_id, name)

    # --- invariants --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken rule."""
        with self._lock:
            pool = self._pages
            free = pool.free_pages()
            owners = [self._tables[s][: self._npages[s]] for s in self._live_slots()]
            owners += [rec.pool[rec.used :] for rec in self._admitted.values()]
            held = np.concatenate([np.zeros(0, np.int32), *owners])
            counts = np.bincount(held, minlength=self.num_pages)
            if len(np.unique(free)) != len(free) or counts[free].any():
                raise AssertionError("broken rule: every page is free xor owned")
            if not np.array_equal(counts, pool.refcount):
                bad = int(np.flatnonzero(counts != pool.refcount)[0])
                raise AssertionError(
                    f"broken rule: owner counts equal the streams naming each page"
                    f" (page {bad}: refcount {pool.refcount[bad]}, named {counts[bad]} times)"
                )
            for slot in self._live_slots():
                full = self._stored[slot] // self.page_size
                if self._npages[slot] < _pages_for(int(self._stored[slot]), self.page_size):
                    raise AssertionError("broken rule: a stream holds the pages of its length")
                if (pool.refcount[self._tables[slot][full : self._npages[slot]]] != 1).any():
                    raise AssertionError("broken rule: no stream's still-writable page is shared")
            if pool.num_free + np.count_nonzero(counts) != self.num_pages:
                raise AssertionError("broken rule: free + owned == num_pages")

    # --- admission ---------------------------------------------------------------------

    def _validate(self, step: KVStep) -> dict[str, list[Segment]]:
        seen = set()
        for seg in step.segments:
            key = (seg.request_id, seg.label)
            if seg.span < 0:
                raise InvalidStep(
                    f"expected span >= 0, got {seg.span} for request {seg.request_id!r},"
                    f" label {seg.label!r}",
                    *key,
                )
            if key in seen:
                raise InvalidStep(
                    f"expected one segment per stream, got two for request {seg.request_id!r},"
                    f" label {seg.label!r}",
                    *key,
                )
            seen.add(key)
            if self._in_flight(seg.request_id):
                raise InvalidStep(
                    f"request {seg.request_id!r} (label {seg.label!r}) is already in an"
                    " admitted step",
                    *key,
                )
        for src, dst in step.pre_forks + step.post_forks:
            if src == dst:
                raise InvalidStep(
                    f"expected a fork between two labels, got {src!r} -> {dst!r}",
                    _first_row(step)[0],
                    src,
                )
        try:
            return group_by_plan_label(step.segments, step.combined_labels)
        except (KeyError, ValueError) as err:
            raise InvalidStep(f"bad combined_labels: {err}", *_first_row(step)) from err

    def _pages_needed(self, step: KVStep) -> tuple[int, tuple[str, str] | None]:
        """Pages the step will take, and the first (request, label) that would
        not fit in the free pool (None when all fit)."""
        need, short_at = 0, None
        by_request: dict[str, list[Segment]] = {}
        for seg in step.segments:
            by_request.setdefault(seg.request_id, []).append(seg)
        for request_id, segs in by_request.items():
            for label, pages in self._request_pages(step, request_id, segs):
                need += pages
                if need > self._pages.num_free and short_at is None:
                    short_at = (request_id, label)
        return need, short_at

    def _request_pages(
        self, step: KVStep, request_id: str, segs: list[Segment]
    ) -> list[tuple[str, int]]:
        """(label, new pages) for each fork and span of one request, in the
        order they apply, simulated on (stored, pages) pairs without touching
        state."""
        ps = self.page_size
        sim = {
            label: (int(self._stored[slot]), int(self._npages[slot]))
            for label, slot in self._streams.get(request_id, {}).items()
        }
        out = []

        def fork(src: str, dst: str, when: str) -> None:
            if src not in sim:
                raise UnknownStream(
                    f"{when} {src!r} -> {dst!r}: request {request_id!r} has no stream {src!r}",
                    request_id,
                    src,
                )
            stored = sim[src][0]
            sim[dst] = (stored, _pages_for(stored, ps))
            out.append((dst, int(stored % ps != 0)))  # a partial last page is copied

        for src, dst in step.pre_forks:
            fork(src, dst, "pre-fork")
        for seg in segs:
            stored, pages = sim.get(seg.label, (0, 0))
            want = _pages_for(stored + seg.span, ps)
            sim[seg.label] = (stored + seg.span * step.commit, max(pages, want))
            out.append((seg.label, max(want - pages, 0)))
        for src, dst in step.post_forks:
            fork(src, dst, "post-fork")
        return out

    def _repeated_decode(self, step: KVStep) -> _DecodeCache | None:
        """The cached decode step ``step`` repeats, if it can be planned off it."""
        cache = self._decode
        if (
            cache is None
            or self._admitted  # another step is in flight: take the checked path
            or step.pre_forks
            or step.post_forks
            or step.segments != cache.segments
            or step.combined_labels != cache.combined_labels
            or (self._epoch[cache.slots] != cache.epochs).any()
        ):
            return None
        return cache

    def _admit_repeated_decode(self, step: KVStep, cache: _DecodeCache) -> None:
        grow = self._stored[cache.slots] >= self._npages[cache.slots] * self.page_size
        need = int(np.count_nonzero(grow))
        free = self._pages.num_free
        if need > free:
            row = cache.segments[int(np.flatnonzero(grow)[free])]
            raise AllocationFailed(need - free, row.request_id, row.label)
        self._admitted[step] = _Admitted(
            self._pages.alloc(need), decode=cache, grow=grow, requests=cache.requests
        )

    # --- applying a step -----------------------------------------------------------------

    def _apply_spans(self, step: KVStep, rec: _Admitted) -> None:
        """Pre-forks, then each segment's new pages: once, by plan or commit."""
        if rec.planned:
            return
        rec.planned = True
        if rec.decode is not None:  # one page for each row that starts one
            if not len(rec.pool):
                return
            slots = rec.decode.slots[rec.grow]
            pages = self._reserved(rec, len(slots))
            for slot, n, page in zip(slots.tolist(), self._npages[slots].tolist(), pages.tolist()):
                self._table_with_room(slot, n + 1)[n] = page
            self._npages[slots] += 1
            self._touch(slots)
            return
        for src, dst in step.pre_forks:
            for request_id in rec.requests:
                self._fork(request_id, src, dst, rec)
        for seg in step.segments:
            slot = self._streams.get(seg.request_id, {}).get(seg.label)
            if slot is None:
                slot = self._new_stream(seg.request_id, seg.label, np.zeros(0, np.int32), 0)
            want = _pages_for(int(self._stored[slot]) + seg.span, self.page_size)
            if want > self._npages[slot]:
                self._append(slot, self._reserved(rec, want - int(self._npages[slot])))

    def _plan_general(self, step: KVStep, rec: _Admitted) -> dict[str, KVPlanOutput]:
        """Views per plan label, then ``build_paged_indptrs``; a decode step
        is also cached for the next one to be planned off."""
        decode = bool(step.segments) and all(s.span == 1 for s in step.segments)
        outs, labels = {}, {}
        for plan_label, segs in rec.groups.items():
            slots = self._slots(segs)
            views = self._views(segs, slots)
            indptrs = build_paged_indptrs(views, self.page_size, self.ring)
            rows = [(s.request_id, s.label) for s in segs]
            if not decode:
                outs[plan_label] = KVPlanOutput(indptrs, views=views, rows=rows)
                continue
            lab = labels[plan_label] = _DecodeLabel.of(rows, slots, indptrs)
            outs[plan_label] = KVPlanOutput(
                indptrs,
                views=views,
                decode_pages=lab.write_pages(),
                decode_offsets=self._stored[slots] % self.page_size,
                rows=rows,
            )
        if decode:
            slots = self._slots(step.segments)
            epochs = self._epoch[slots]
            self._decode = _DecodeCache(
                step.segments, dict(step.combined_labels), slots, epochs, labels, rec.requests
            )
        return outs

    def _slots(self, segs: Sequence[Segment]) -> np.ndarray:
        """The segments' stream slots, int64."""
        return np.array([self._streams[s.request_id][s.label] for s in segs], dtype=np.int64)

    def _views(self, segs: Sequence[Segment], slots: np.ndarray) -> list[SequenceView]:
        """The segments' views; ``page_idxs`` are read-only slices of the page
        tables, which are only ever appended to (so a view stays valid)."""
        views = []
        for seg, slot in zip(segs, slots.tolist()):
            length = int(self._stored[slot]) + seg.span
            pages = self._tables[slot][: _pages_for(length, self.page_size)]
            pages.flags.writeable = False
            gen = int(self._gen[slot])
            views.append(SequenceView(seg.request_id, seg.label, pages, length, seg.span, 0, gen))
        return views

    def _plan_repeated_decode(self, rec: _Admitted) -> dict[str, KVPlanOutput]:
        """A decode step with the previous one's rows: each label's index arrays
        are the previous ones, changed only where a row took a new page."""
        ps = self.page_size
        outs = {}
        for plan_label, lab in rec.decode.labels.items():
            stored = self._stored[lab.slots]
            num_pages = stored // ps + 1
            delta = num_pages - lab.num_pages
            if delta.any():
                lab.kv_indptr, lab.indices = self._regrow(lab, num_pages, delta)
                lab.num_pages = num_pages
            last = (stored % ps + 1).astype(np.int32)
            kv_lens = (stored // ps * ps).astype(np.int32)
            kv_lens += last
            arrays = (lab.qo_indptr, lab.kv_indptr, lab.indices, last)
            if self.ring is None:
                tensors = [torch.from_numpy(a) for a in arrays]
            else:
                tensors = [self.ring.take(a) for a in arrays]
            indptrs = PagedIndptrs(*tensors, HostLens(kv_lens))
            outs[plan_label] = KVPlanOutput(
                indptrs,
                decode_pages=lab.write_pages(),
                decode_offsets=stored % ps,
                rows=list(lab.rows),
                view_builder=_DecodeViews(
                    lab.rows, lab.indices, lab.kv_indptr, stored + 1, self._gen[lab.slots]
                ),
            )
        return outs

    def _regrow(
        self, lab: _DecodeLabel, num_pages: np.ndarray, delta: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The label's (kv_indptr, indices) after its rows' page counts moved by
        ``delta``: one slice copy per run between rows that took a page."""
        kv_indptr = np.zeros_like(lab.kv_indptr)
        np.cumsum(num_pages, out=kv_indptr[1:])
        if delta.min() < 0 or delta.max() > 1:  # not one decode step on: rebuild the label
            parts = [self._tables[s][:n] for s, n in zip(lab.slots.tolist(), num_pages.tolist())]
            return kv_indptr, np.concatenate(parts).astype(np.int32, copy=False)
        rows = np.flatnonzero(delta)
        ends = lab.kv_indptr[rows + 1].tolist()  # where each such row's old pages end
        tables = self._tables
        new_pages = [
            tables[s][n - 1] for s, n in zip(lab.slots[rows].tolist(), num_pages[rows].tolist())
        ]
        old, indices = lab.indices, self._recycler.empty(int(kv_indptr[-1]))
        src = dst = 0
        for end, page in zip(ends, new_pages):
            indices[dst : dst + end - src] = old[src:end]
            dst += end - src
            indices[dst] = page
            dst += 1
            src = end
        indices[dst:] = old[src:]
        return kv_indptr, indices

    # --- forks and streams ---------------------------------------------------------------

    def _fork(self, request_id: str, src: str, dst: str, rec: _Admitted) -> None:
        """``dst`` becomes a copy of ``src`` as stored now: full pages shared,
        a partially filled last page copied into a reserved page."""
        ps = self.page_size
        src_slot = self._streams[request_id][src]
        stored = int(self._stored[src_slot])
        full, tail = divmod(stored, ps)
        table = self._tables[src_slot][: full + (tail > 0)].copy()
        self._pages.share(table[:full])
        if tail:
            page = self._reserved(rec, 1)
            if self.cache is not None:
                self.cache.copy_pages(table[full:], page)
            table[full] = page[0]
        if dst in self._streams[request_id]:
            self._drop(request_id, dst)
        self._new_stream(request_id, dst, table, stored)

    def _new_stream(self, request_id: str, label: str, table: np.ndarray, stored: int) -> int:
        if not self._free_slots:
            self._grow_slots()
        slot = self._free_slots.pop()
        self._tables[slot] = table
        self._npages[slot] = len(table)
        self._stored[slot] = stored
        self._epoch[slot] = self._next_tick()
        self._touch(slot)
        self._streams.setdefault(request_id, {})[label] = slot
        return slot

    def _drop(self, request_id: str, label: str) -> None:
        labels = self._streams[request_id]
        slot = labels.pop(label)
        if not labels:
            del self._streams[request_id]
        self._pages.release(self._tables[slot][: self._npages[slot]])
        self._tables[slot] = None
        self._npages[slot] = self._stored[slot] = 0
        self._epoch[slot] = -1
        self._free_slots.append(slot)

    def _append(self, slot: int, pages: np.ndarray) -> None:
        n = int(self._npages[slot])
        self._table_with_room(slot, n + len(pages))[n : n + len(pages)] = pages
        self._npages[slot] = n + len(pages)
        self._touch(slot)

    def _table_with_room(self, slot: int, size: int) -> np.ndarray:
        """The slot's page table, grown (geometrically) to hold ``size`` pages."""
        table = self._tables[slot]
        if size > len(table):
            grown = np.empty(max(2 * len(table), size, 16), dtype=np.int32)
            grown[: len(table)] = table
            self._tables[slot] = table = grown
        return table

    def _grow_slots(self) -> None:
        old = len(self._tables)
        new = max(2 * old, 64)
        self._tables.extend([None] * (new - old))
        for name in ("_stored", "_npages", "_gen", "_epoch"):
            arr = np.zeros(new, dtype=np.int64)
            arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        self._free_slots.extend(range(new - 1, old - 1, -1))

    def _live_slots(self) -> list[int]:
        return [slot for labels in self._streams.values() for slot in labels.values()]

    # --- lookups -----------------------------------------------------------------------------

    def _reserved(self, rec: _Admitted, n: int) -> np.ndarray:
        pages = rec.pool[rec.used : rec.used + n]
        assert len(pages) == n, "a step takes only the pages it reserved"
        rec.used += n
        return pages

    def _slot(self, request_id: str, label: str) -> int:
        slot = self._streams.get(request_id, {}).get(label)
        if slot is None:
            raise UnknownStream(
                f"no stream for request {request_id!r}, label {label!r}", request_id, label
            )
        return slot

    def _in_flight(self, request_id: str) -> bool:
        return any(request_id in rec.requests for rec in self._admitted.values())

    def _get_admitted(self, step: KVStep) -> _Admitted:
        rec = self._admitted.get(step)
        if rec is None:
            raise InvalidStep(f"step was not admitted ({_describe(step)})", *_first_row(step))
        return rec

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _touch(self, slots: int | np.ndarray) -> None:
        """A new generation for streams whose pages or length changed."""
        n = np.size(slots)
        self._gen[slots] = (
            np.arange(self._tick + 1, self._tick + 1 + n) if n > 1 else self._tick + 1
        )
        self._tick += n


class _DecodeViews:
    """Builds a decode plan's views on first use, from that plan's own arrays
    (a plain class, not a closure, so nothing else of the manager is held)."""

    def __init__(self, rows, indices, kv_indptr, lengths, generations):
        self.args = (rows, indices, kv_indptr, lengths, generations)

    def __call__(self) -> list[SequenceView]:
        rows, indices, kv_indptr, lengths, generations = self.args
        views = []
        bounds = kv_indptr.tolist()
        for i, ((request_id, label), length, gen) in enumerate(
            zip(rows, lengths.tolist(), generations.tolist())
        ):
            pages = indices[bounds[i] : bounds[i + 1]]
            pages.flags.writeable = False
            views.append(SequenceView(request_id, label, pages, length, 1, 0, gen))
        return views


def _first_row(step: KVStep) -> tuple[str | None, str | None]:
    return (step.segments[0].request_id, step.segments[0].label) if step.segments else (None, None)


def _describe(step: KVStep) -> str:
    rows = ", ".join(f"{s.request_id!r}/{s.label!r}" for s in step.segments[:3])
    more = f" and {len(step.segments) - 3} more" if len(step.segments) > 3 else ""
    return f"rows {rows}{more}" if rows else "no rows"
