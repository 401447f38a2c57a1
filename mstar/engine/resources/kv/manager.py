"""KVManager: the pages of every (request, label) stream, and the plans over them.

A step goes ``admit`` (validate, reserve every page it will need, all or
nothing) -> ``plan`` (apply pre-forks and spans, hand out a ``KVPlanOutputs``)
-> ``commit`` (advance lengths, apply post-forks), or ``abort`` at any point
after ``admit``. Only ``admit`` allocates, so ``plan`` and ``commit`` never
fail for memory; if either raises anyway (a cache's ``copy_pages``), what it
did is undone and the step is as before the call.

Pages: a stream's pages hold its tokens in order, ``page_size`` each. A page
whose tokens are all stored is full and never written again, so forks share
full pages by reference count and copy only a partially filled last page.

Every step takes one path, vectorized over rows: stream state is
struct-of-arrays by slot (slot 0 is an empty stream that unknown rows read),
a step resolves its rows to slots with one dict lookup each, and page needs,
lengths and index arrays are array arithmetic. A plan label's
``paged_kv_indices`` is spliced from the previous plan of that label: rows
that kept their place are copied in runs (one slice copy per run), and only
rows that are new or took a page read their page table. Views are built
lazily, only for a consumer that reads them.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from itertools import accumulate
from operator import eq, itemgetter
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
    group_by_plan_label,
)
from mstar.engine.resources.kv.prefix import PrefixChains, TokenError, step_tokens
from mstar.engine.resources.step import KVStep, Segment

_KEY = itemgetter(0, 1)  # a segment's (request_id, label)
_INT32_MAX = 2**31 - 1
_LEFT_AHEAD = 8  # rows that may leave ahead of a step's reused rows


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


class _Slots(dict):
    """(request_id, label) -> slot; an unknown stream reads as slot 0."""

    def __missing__(self, key: tuple[str, str]) -> int:
        return 0


class _Recycler:
    """int32 arrays whose memory is reused once nothing outside holds it.

    Fresh multi-MB memory costs more in page faults than the copy into it (2 MB:
    ~1 ms of faults against ~0.2 ms of copying). An array is handed out again
    only when this pool's reference is its last: a published tensor, a view or
    a lazy view builder keeps its base alive, so memory in use is never reused.
    """

    def __init__(self, keep: int = 6) -> None:
        self._arrays: list[np.ndarray] = []
        self._keep = keep

    def empty(self, n: int) -> np.ndarray:
        if n < 1 << 14:  # small: fresh memory is cheap, not worth the search
            return np.empty(n, dtype=np.int32)
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
class _Index:
    """A plan label's last index arrays, what its next plan is spliced from.
    Owned here: never written in place."""

    slots: np.ndarray  # int64 [B]
    epochs: np.ndarray  # int64 [B]: the streams' epochs then (a new stream, a new epoch)
    num_pages: np.ndarray  # int64 [B]
    kv_indptr: np.ndarray  # int32 [B + 1]
    indices: np.ndarray  # int32 [kv_indptr[-1]]


@dataclass(eq=False)
class _Rows:
    """A step's rows, resolved: once it commits, a next step with the same
    rows (a decode step) reuses them while every stream is the same (its
    epoch)."""

    segments: tuple[Segment, ...]
    columns: tuple[tuple, ...]  # the segments' fields: request ids, labels, spans, tokens
    keys: list[tuple[str, str]]
    spans: np.ndarray  # int32 [B]
    combined: dict[tuple[str, ...], str]
    slots: np.ndarray  # int64 [B]
    requests: dict[str, None]
    groups: dict[str, np.ndarray | None]
    epochs: np.ndarray | None = None  # int64 [B], from the step's commit
    made: int = -1  # the manager's count of streams made and freed then


@dataclass(eq=False)
class _Admitted:
    """An admitted step: its rows, its reserved pages (handed out as forks and
    spans apply) and a journal of what applying it changed, for undo."""

    keys: list[tuple[str, str]]  # [B] (request_id, label), batch order
    columns: tuple[tuple, ...]  # the segments' fields (see ``_Rows``)
    new: list[int]  # rows whose stream the step creates
    slots: np.ndarray  # int64 [B]; 0 for a stream the step creates (until applied)
    spans: np.ndarray  # int32 [B]
    ends: np.ndarray  # int64 [B]: each stream's length with the span
    num_pages: np.ndarray  # int64 [B]: pages holding ``ends`` tokens
    grow: np.ndarray  # int64 [B]: pages each row takes
    requests: dict[str, None]  # ordered
    groups: dict[str, np.ndarray | None]  # plan label -> rows (None: all, in order)
    tokens: Any = None  # with a prefix cache: the rows' tokens (see ``step_tokens``)
    pool: np.ndarray | None = None  # the pages reserved (set by ``admit``)
    rows: _Rows | None = None  # its rows: the last step's, reused, or its own
    used: int = 0
    planned: bool = False
    # The journal: ("grow", slots, old page counts), ("new", key, slot),
    # ("replace", key, old slot) — a replaced fork target is kept until the step ends.
    journal: list[tuple] = field(default_factory=list)


class KVManager:
    """Pages, streams and forks -> plans. Thread-safe: one lock guards the state.

    With ``prefix_cache=True``, full pages are registered by content once
    committed (a stream's segments must carry their ``tokens``), stay cached
    after their last owner lets go until their memory is needed (cached pages
    count as free), and ``match_prefix`` starts a new stream on the longest
    cached run of a prompt's pages."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        cache: Any | None = None,
        ring: PinnedIndexRing | None = None,
        *,
        prefix_cache: bool = False,
    ) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if not _is_int(value) or not 1 <= value <= _INT32_MAX:
                raise ValueError(f"expected {name} an int in [1, 2**31), got {value!r}")
        if num_pages * page_size > _INT32_MAX:
            raise ValueError(
                f"expected num_pages * page_size < 2**31 (int32 slots), got {num_pages * page_size}"
            )
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.cache = cache
        self.ring = ring
        self._lock = threading.Lock()
        self._pages = PagePool(self.num_pages, self.page_size)
        self._slot_of = _Slots()
        self._streams: dict[str, dict[str, int]] = {}  # request -> label -> slot
        self._tables: list[np.ndarray | None] = [np.zeros(0, np.int32)]
        self._prefix = (
            PrefixChains(self._pages, self.page_size, self._tables) if prefix_cache else None
        )
        self._stored = np.zeros(1, dtype=np.int64)
        self._npages = np.zeros(1, dtype=np.int64)
        self._gen = np.zeros(1, dtype=np.int64)
        self._epoch = np.zeros(1, dtype=np.int64)
        self._free_slots: list[int] = []
        self._made = 0  # streams made and freed so far (a step's rows stay resolved until it moves)
        self._tick = 0
        self._admitted: dict[KVStep, _Admitted] = {}
        self._index: dict[str, _Index] = {}
        self._rows: _Rows | None = None  # the last committed step's rows, for the next
        self._recycler = _Recycler()
        self._few_rows = 8  # up to this many rows, per-row arithmetic runs on Python ints
        self._splice_rows = 64  # from this many rows a label's indices are spliced from its last
        self._tail_rows = 8  # rows after the last plan's that are spliced from their tables

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

    @property
    def num_cached_pages(self) -> int:
        """Free pages that still hold a cached prefix (evicted when needed)."""
        return self._pages.num_cached

    def prefix_stats(self) -> dict[str, int]:
        """Tokens queried and hit by ``match_prefix``, pages registered in the
        cache now, pages evicted so far."""
        with self._lock:
            p = self._prefix
            if p is not None:
                p.flush()
            return {
                "tokens_queried": p.queried if p else 0,
                "tokens_hit": p.hit if p else 0,
                "pages_cached": self._pages.num_registered,
                "pages_evicted": self._pages.num_evicted,
            }

    def match_prefix(self, request_id: str, label: str, tokens: Any, namespace: str = "") -> int:
        """Start the stream (request_id, label) on the longest run of cached
        full pages equal to a prefix of ``tokens`` (shared, leaving at least
        one token to compute) and return its stored length: a multiple of
        ``page_size``, 0 when nothing matches. The caller schedules the rest.
        ``namespace`` separates KV that equal tokens do not determine (an
        adapter, images, a salt)."""
        with self._lock:
            if self._prefix is None:
                raise InvalidStep(
                    "the prefix cache is off (KVManager(..., prefix_cache=True))", request_id, label
                )
            _check_key(request_id, label)
            if not isinstance(namespace, str):
                raise TypeError(f"expected namespace a str, got {namespace!r}")
            if (request_id, label) in self._slot_of:
                raise InvalidStep(
                    f"expected a new stream, got existing request {request_id!r}, label {label!r}",
                    request_id,
                    label,
                )
            if self._in_flight({request_id: None}):
                raise InvalidStep(
                    f"request {request_id!r} is in an admitted step", request_id, label
                )
            ids = np.asarray(tokens)
            if ids.ndim != 1 or (ids.dtype.kind not in "iu" and ids.size):
                raise TypeError(
                    f"expected tokens a 1-D sequence of int ids, got {ids.dtype} {ids.shape}"
                    f" for request {request_id!r}, label {label!r}"
                )
            pages, last = self._prefix.match(ids, namespace)
            self._pages.share(pages)
            stored = len(pages) * self.page_size
            slot = self._new_stream(request_id, label, pages.copy(), stored)
            self._prefix.start(slot, namespace, len(pages), last)
            return stored

    # --- the step protocol -------------------------------------------------------------

    def admit(self, step: KVStep) -> None:
        """Validate ``step`` and reserve every page it will need. Raises
        ``AllocationFailed``, ``InvalidStep``/``UnknownStream`` (a bad step) or
        ``TypeError`` (a value of the wrong type), and then changes nothing."""
        with self._lock:
            if not isinstance(step, KVStep):
                raise TypeError(f"expected a KVStep, got {type(step).__name__}")
            if step in self._admitted:
                raise InvalidStep(f"step already admitted ({_describe(step)})", *_first_row(step))
            rec = self._admission(step)
            if _has_forks(step):
                need = self._fork_pages(step, rec)
            else:
                need = sum(rec.grow) if isinstance(rec.grow, list) else int(np.add.reduce(rec.grow))
            self._pages_fit(rec, need)
            rec.pool = self._pages.alloc(need)
            self._admitted[step] = rec

    def plan(self, step: KVStep) -> KVPlanOutputs:
        """Apply the pre-forks and the spans' pages and return one
        ``KVPlanOutput`` per plan label, in ``group_by_plan_label`` order. If
        it raises, the step is as admitted (plan it again, or abort it)."""
        with self._lock:
            rec = self._get_admitted(step)
            if rec.planned:
                raise InvalidStep(f"step already planned ({_describe(step)})", *_first_row(step))
            mark = len(rec.journal), rec.used
            try:
                self._apply(step, rec)
                arrays = {
                    label: self._arrays(label, rows, rec) for label, rows in rec.groups.items()
                }
                if self.ring is not None:  # only a plan that is handed out advances the ring
                    self.ring.begin_plan()
                outs = {label: self._output(a) for label, a in arrays.items()}
            except BaseException:
                self._undo(rec, *mark)
                if self.ring is not None:  # its buffers were handed to no one
                    self.ring.discard_plan()
                raise
            rec.planned = True
            return KVPlanOutputs(outs, step.pre_forks, step.post_forks)

    def commit(self, step: KVStep) -> None:
        """Advance each stream by its span (unless ``step.commit`` is False:
        then the reservation stays), then apply the post-forks. If it raises,
        the step is as before the call (commit it again, or abort it)."""
        with self._lock:
            rec = self._get_admitted(step)
            mark = len(rec.journal), rec.used
            planned = rec.planned
            try:
                if not planned:
                    self._apply(step, rec)
                if step.commit:
                    self._stored[rec.slots] = rec.ends  # stored + span, rows being distinct
                    self._touch(rec.slots)
                try:
                    for src, dst in step.post_forks:
                        for request_id in rec.requests:
                            self._fork(request_id, src, dst, rec)
                except BaseException:
                    if step.commit:
                        self._stored[rec.slots] -= rec.spans
                    raise
            except BaseException:
                self._undo(rec, *mark)
                raise
            assert rec.used == len(rec.pool), "a step must use exactly the pages it reserved"
            if rec.tokens is not None:  # only now is the step's KV final
                self._record(step, rec)
            self._finish(rec)
            # The next step may reuse this one's rows; a step of new streams
            # only (newcomers' prefill) leaves the last rows, which come next.
            newcomers = self._rows is not None and len(rec.new) == len(rec.keys)
            if not _has_forks(step) and not newcomers:
                rows = rec.rows  # held by no other step in flight
                rows.segments, rows.columns, rows.spans = step.segments, rec.columns, rec.spans
                if rows is not self._rows or rows.slots is not rec.slots:  # (re)resolved
                    rows.slots, rows.epochs = rec.slots, self._epoch[rec.slots]
                rows.made, self._rows = self._made, rows
            del self._admitted[step]

    def abort(self, step: KVStep) -> None:
        """Abandon an admitted (possibly planned) step, e.g. when the model's
        forward failed: every page it reserved returns, the streams it created
        (its new rows, its pre-forks' targets) are gone, a fork target it
        replaced is back, and lengths are as before ``admit``. The requests can
        be scheduled again at once."""
        with self._lock:
            rec = self._get_admitted(step)
            self._undo(rec, 0, 0)
            self._pages.release(rec.pool)
            del self._admitted[step]

    def release(self, request_id: str, label: str | None = None) -> None:
        """Free every stream of the request, or just ``label``'s. A page goes
        back to the pool when its last owner lets go."""
        with self._lock:
            if not isinstance(request_id, str) or not (label is None or isinstance(label, str)):
                raise TypeError(
                    f"expected request_id a str and label a str or None,"
                    f" got {request_id!r}, {label!r}"
                )
            if self._in_flight({request_id: None}):
                raise InvalidStep(
                    f"request {request_id!r} is in an admitted step: commit or abort it first",
                    request_id,
                    label,
                )
            if request_id not in self._streams:
                raise UnknownStream(f"unknown request {request_id!r}", request_id, label)
            labels = list(self._streams[request_id]) if label is None else [label]
            self._slot(request_id, labels[0])  # an unknown label raises before any change
            for name in labels:
                self._free_slot(self._unmap(request_id, name))

    # --- invariants --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken rule."""
        with self._lock:
            pool = self._pages
            free = pool.free_pages()
            live = self._live_slots()
            held = [self._tables[s][: self._npages[s]] for s in live]
            held += [rec.pool[rec.used :] for rec in self._admitted.values()]
            held = np.concatenate([np.zeros(0, np.int32), *held])
            counts = np.bincount(held, minlength=self.num_pages)
            if len(np.unique(free)) != len(free) or counts[free].any():
                raise AssertionError("broken rule: every page is free xor owned")
            if not np.array_equal(counts, pool.refcount):
                bad = int(np.flatnonzero(counts != pool.refcount)[0])
                raise AssertionError(
                    f"broken rule: owner counts equal the streams naming each page"
                    f" (page {bad}: refcount {pool.refcount[bad]}, named {counts[bad]} times)"
                )
            for slot in live:
                full = self._stored[slot] // self.page_size
                if self._npages[slot] < _pages_for(int(self._stored[slot]), self.page_size):
                    raise AssertionError("broken rule: a stream holds the pages of its length")
                if (pool.refcount[self._tables[slot][full : self._npages[slot]]] != 1).any():
                    raise AssertionError("broken rule: no stream's still-writable page is shared")
            if pool.num_free + np.count_nonzero(counts) != self.num_pages:
                raise AssertionError("broken rule: free + owned == num_pages")
            if self._stored[0] or self._npages[0] or 0 in self._free_slots:
                raise AssertionError("broken rule: slot 0 is the empty stream")
            pool.check()

    # --- admission ---------------------------------------------------------------------

    def _admission(self, step: KVStep) -> _Admitted:
        """The step's rows, validated, as arrays; changes nothing."""
        segs = step.segments
        rows = self._rows
        reuse = (
            rows is not None
            and not self._admitted  # another step in flight: the checked path
            and not _has_forks(step)
            and step.combined_labels == rows.combined
        )
        if reuse and _equal_rows(segs, rows.segments) and self._same_streams(rows):
            # The last committed step's rows (a decode step): checked, resolved
            # and grouped then. Its slots are shared, never written in place.
            return self._sized(step, rows, rows.columns, rows.keys, [], rows.slots, rows.spans)
        if segs and set(map(type, segs)) != {Segment}:
            bad = next(s for s in segs if type(s) is not Segment)
            raise TypeError(f"expected Segment rows, got {type(bad).__name__} {bad!r}")
        n = len(segs)
        columns = tuple(zip(*segs)) or ((), (), (), ())  # one pass: ids, labels, spans, tokens
        request_ids, labels, span_values = columns[:3]
        if (
            reuse
            and request_ids == rows.columns[0]
            and labels == rows.columns[1]
            and self._same_streams(rows)
        ):  # the same streams with other spans or tokens
            spans = rows.spans if span_values == rows.columns[2] else _spans(span_values, rows.keys)
            return self._sized(step, rows, columns, rows.keys, [], rows.slots, spans)
        d, k = self._shared_rows(rows, request_ids, labels) if reuse else (0, 0)
        keys = (rows.keys[d : d + k] if k else []) + list(zip(request_ids[k:], labels[k:]))
        if k:  # the last step's rows again (rows left before them, joined or left after)
            kept = rows.slots[d : d + k]
            slots = np.concatenate((kept, self._resolve(keys[k:])))
            if span_values[:k] == rows.columns[2][d : d + k]:
                spans = np.concatenate((rows.spans[d : d + k], _spans(span_values[k:], keys[k:])))
            else:
                spans = _spans(span_values, keys)
            tail = slots[k:]
            repeated = not set(tail[tail != 0].tolist()).isdisjoint(kept.tolist())
        else:
            slots = self._resolve(keys)
            spans = _spans(span_values, keys)
            repeated = False
        new = (slots == 0).nonzero()[0].tolist()
        for i in new:  # a known stream's key was checked when it was made
            _check_key(*keys[i])
        if n > k + 1 or repeated:  # the rows it did not reuse are each one stream
            known = np.sort(slots[k:][slots[k:] != 0])
            if (
                repeated
                or (known[1:] == known[:-1]).any()
                or len({keys[i] for i in new}) < len(new)
            ):
                key = _first_repeat(keys)
                raise InvalidStep(
                    f"expected one segment per stream, got two for request {key[0]!r},"
                    f" label {key[1]!r}",
                    *key,
                )
        requests = dict.fromkeys(request_ids)
        if self._in_flight(requests):
            key = next(k for k in keys if self._in_flight({k[0]: None}))
            raise InvalidStep(
                f"request {key[0]!r} (label {key[1]!r}) is already in an admitted step", *key
            )
        _check_forks(step)
        groups = self._groups(step, keys, labels)
        combined = step.combined_labels
        rows = _Rows(step.segments, columns, keys, spans, combined, slots, requests, groups)
        return self._sized(step, rows, columns, keys, new, slots, spans)

    def _resolve(self, keys: list[tuple[str, str]]) -> np.ndarray:
        """The streams' slots, int64; 0 for a stream not made yet."""
        return np.fromiter(map(self._slot_of.__getitem__, keys), np.int64, len(keys))

    def _shared_rows(self, rows: _Rows, request_ids: tuple, labels: tuple) -> tuple[int, int]:
        """``(d, k)``: the last step's rows ``[d, d + k)`` are this step's first
        ``k``, on the same streams (rows that left before them, rows that
        joined or left after). Compared by column: the ids are mostly the very
        same objects."""
        old_ids = rows.columns[0]
        if not request_ids or not old_ids:
            return 0, 0
        try:  # a few rows ahead of it may have left
            d = old_ids.index(request_ids[0], 0, _LEFT_AHEAD + 1)
        except ValueError:
            return 0, 0
        k = len(request_ids)
        for new, old in ((request_ids, old_ids), (labels, rows.columns[1])):
            same = list(map(eq, new[:k], old[d:]))
            k = same.index(False) if False in same else len(same)
        if k and rows.made != self._made:
            k *= bool((self._epoch[rows.slots[d : d + k]] == rows.epochs[d : d + k]).all())
        return d, k

    def _same_streams(self, rows: _Rows) -> bool:
        """Whether the rows' streams are those they were resolved to."""
        if rows.made == self._made:  # no stream made or freed since
            return True
        return bool((self._epoch[rows.slots] == rows.epochs).all())

    def _sized(self, step, rows, columns, keys, new, slots, spans) -> _Admitted:
        """The admission record, once the rows are resolved (``rows``: the last
        step's, or this one's, unchecked against the streams): lengths
        checked, page needs, tokens."""
        ends, num_pages, grow = self._needs(slots, spans)
        longest = max(ends, default=0) if isinstance(ends, list) else np.maximum.reduce(ends)
        if longest > _INT32_MAX:
            i = int(np.argmax(ends))
            raise InvalidStep(
                f"expected a stream length < 2**31, got {int(ends[i]) - int(spans[i])} + span"
                f" {int(spans[i])} for request {keys[i][0]!r}, label {keys[i][1]!r}",
                *keys[i],
            )
        tokens = None
        if self._prefix is not None and step.commit:
            try:
                tokens = step_tokens(columns[3], spans, keys)
            except TokenError as err:
                raise InvalidStep(str(err)) from err
        return _Admitted(
            keys, columns, new, slots, spans, ends, num_pages, grow, rows.requests, rows.groups,
            tokens, rows=rows,
        )  # fmt: skip

    def _needs(self, slots: np.ndarray, spans: np.ndarray) -> tuple[np.ndarray, ...]:
        """Each row's length with its span, the pages holding it, and the
        pages it takes beyond those its stream holds (int64 ``[B]`` each;
        lists of ints for a few rows, where numpy calls cost more than the
        arithmetic)."""
        if len(slots) <= self._few_rows:
            ps, stored, npages, slot_list = (
                self.page_size,
                self._stored,
                self._npages,
                slots.tolist(),
            )
            ends = [stored.item(s) + n for s, n in zip(slot_list, spans.tolist())]
            num_pages = [-(-end // ps) for end in ends]
            grow = [max(n - npages.item(s), 0) for s, n in zip(slot_list, num_pages)]
            return ends, num_pages, grow
        ends = self._stored[slots] + spans
        num_pages = ends + (self.page_size - 1)
        num_pages //= self.page_size
        grow = num_pages - self._npages[slots]
        np.maximum(grow, 0, out=grow)
        return ends, num_pages, grow

    def _groups(
        self, step: KVStep, keys: list[tuple[str, str]], labels: tuple[str, ...]
    ) -> dict[str, np.ndarray | None]:
        """Plan label -> the rows it packs (``group_by_plan_label``'s order)."""
        distinct = dict.fromkeys(labels)
        if not step.combined_labels and len(distinct) <= 1:
            return dict.fromkeys(distinct)  # one standalone label: every row, in order
        if not isinstance(step.combined_labels, dict):
            raise TypeError(
                f"expected combined_labels a dict, got {type(step.combined_labels).__name__}"
            )
        try:
            groups = group_by_plan_label(step.segments, step.combined_labels)
        except (KeyError, ValueError, TypeError) as err:
            raise InvalidStep(f"bad combined_labels: {err}", *_first_row(step)) from err
        row = {key: i for i, key in enumerate(keys)}
        return {
            label: np.fromiter((row[_KEY(s)] for s in segs), np.int64, len(segs))
            for label, segs in groups.items()
        }

    def _fork_pages(self, step: KVStep, rec: _Admitted) -> int:
        """Pages a step with forks takes, simulated per request on (stored,
        pages) pairs. Sets ``rec.grow`` to each row's share, in the order
        pages would run out."""
        ps = self.page_size
        rows: dict[str, list[int]] = {}
        for i, key in enumerate(rec.keys):
            rows.setdefault(key[0], []).append(i)
        grow = np.zeros(len(rec.keys), dtype=np.int64)
        for request_id, idx in rows.items():
            sim = {
                label: (int(self._stored[slot]), int(self._npages[slot]))
                for label, slot in self._streams.get(request_id, {}).items()
            }
            forks = 0

            def fork(src: str, dst: str, when: str, rid: str = request_id, s: dict = sim) -> int:
                if src not in s:
                    raise UnknownStream(
                        f"{when} {src!r} -> {dst!r}: request {rid!r} has no stream {src!r}",
                        rid,
                        src,
                    )
                stored = s[src][0]
                s[dst] = (stored, _pages_for(stored, ps))
                return int(stored % ps != 0)  # a partial last page is copied

            for src, dst in step.pre_forks:
                forks += fork(src, dst, "pre-fork")
            for i in idx:
                stored, pages = sim.get(rec.keys[i][1], (0, 0))
                span = int(rec.spans[i])
                want = _pages_for(stored + span, ps)
                sim[rec.keys[i][1]] = (stored + span * step.commit, max(pages, want))
                grow[i] = max(want - pages, 0)
            for src, dst in step.post_forks:
                forks += fork(src, dst, "post-fork")
            grow[idx[0]] += forks
        rec.grow = grow
        return int(grow.sum())

    def _pages_fit(self, rec: _Admitted, need: int) -> None:
        free = self._pages.num_free
        if need > free:
            i = int(np.searchsorted(np.cumsum(rec.grow), free, side="right"))
            raise AllocationFailed(need - free, *rec.keys[min(i, len(rec.keys) - 1)])

    # --- applying a step -----------------------------------------------------------------

    def _apply(self, step: KVStep, rec: _Admitted) -> None:
        """Pre-forks, then each row's new pages (new streams made)."""
        if _has_forks(step):
            for src, dst in step.pre_forks:
                for request_id in rec.requests:
                    self._fork(request_id, src, dst, rec)
            rec.slots = np.fromiter(map(self._slot_of.__getitem__, rec.keys), np.int64)
            rec.new = (rec.slots == 0).nonzero()[0].tolist()
            rec.ends, rec.num_pages, rec.grow = self._needs(rec.slots, rec.spans)
        for i in rec.new:
            key = rec.keys[i]
            rec.slots[i] = self._new_stream(*key, np.zeros(0, np.int32), 0)
            rec.journal.append(("new", key, int(rec.slots[i])))
        grow = rec.grow
        if isinstance(grow, list):  # a few rows (see ``_needs``)
            if not any(grow):
                return
            grow = np.array(grow, np.int64)
        rows = grow.nonzero()[0]
        if len(rows):  # the rows' new pages, in row order, from the reservation
            slots, grow = rec.slots[rows], grow[rows]
            had = self._npages[slots]
            pages = self._reserved(rec, int(np.add.reduce(grow)))
            rec.journal.append(("grow", slots, had))
            tables, at, page = self._tables, 0, pages.tolist()
            for slot, n, k in zip(slots.tolist(), had.tolist(), grow.tolist()):
                table = tables[slot]
                if n + k > len(table):
                    table = self._table_with_room(slot, n + k)
                if k == 1:  # a decode row's page: a scalar store is cheaper than a slice
                    table[n] = page[at]
                else:
                    table[n : n + k] = pages[at : at + k]
                at += k
            self._npages[slots] = had + grow
            self._touch(slots)

    def _arrays(self, plan_label: str, rows: np.ndarray | None, rec: _Admitted) -> tuple:
        """One plan label's arrays, after ``_apply``: (qo_indptr, kv_indptr,
        indices, last, kv_lens, ends, slots, spans, keys, write), ``write``
        each row's (page, offset) for a step of decode rows, else None."""
        ps = self.page_size
        slots, spans, ends, num_pages, keys = (
            rec.slots,
            rec.spans,
            rec.ends,
            rec.num_pages,
            rec.keys,
        )
        if rows is not None:
            row_list = rows.tolist()
            keys = [keys[i] for i in row_list]
            slots, spans = slots[rows], spans[rows]
            if isinstance(ends, list):
                ends, num_pages = [ends[i] for i in row_list], [num_pages[i] for i in row_list]
            else:
                ends, num_pages = ends[rows], num_pages[rows]
        if isinstance(ends, list):
            return self._few_arrays(slots, spans, ends, num_pages, keys)
        b = len(slots)
        qo_indptr = np.zeros(b + 1, dtype=np.int32)
        np.add.accumulate(spans, out=qo_indptr[1:])
        kv_indptr = np.zeros(b + 1, dtype=np.int32)
        np.add.accumulate(num_pages, out=kv_indptr[1:])
        kv_lens = ends.astype(np.int32)
        last = kv_lens - 1
        last %= ps
        last += 1  # (ends % ps) or ps
        # max(num_pages - 1, 0) * ps + last: the length, or ps for a row of none
        np.maximum(kv_lens, last, out=kv_lens)
        if b < self._splice_rows:
            indices = self._recycler.empty(int(kv_indptr[-1]))
            self._copy_rows(indices, slots.tolist(), num_pages.tolist(), kv_indptr.tolist())
        else:
            indices = self._splice(plan_label, slots, num_pages, kv_indptr)
        write = None
        if b and int(qo_indptr[-1]) == b and np.maximum.reduce(spans) == 1:  # decode rows
            write = indices[kv_indptr[1:] - 1].astype(np.int64), (last - 1).astype(np.int64)
        return qo_indptr, kv_indptr, indices, last, kv_lens, ends, slots, spans, keys, write

    def _few_arrays(self, slots, spans, ends, num_pages, keys) -> tuple:
        """``_arrays`` for a few rows, on Python ints."""
        ps, spans_l = self.page_size, spans.tolist()
        kv_indptr = [0, *accumulate(num_pages)]
        indices = self._recycler.empty(kv_indptr[-1])
        self._copy_rows(indices, slots.tolist(), num_pages, kv_indptr)
        last = [(end - 1) % ps + 1 for end in ends]
        write = None
        if ends and spans_l.count(1) == len(spans_l):  # decode rows
            write = (
                np.array([indices.item(d - 1) for d in kv_indptr[1:]], np.int64),
                np.array([n - 1 for n in last], np.int64),
            )
        return (
            np.array([0, *accumulate(spans_l)], np.int32),
            np.array(kv_indptr, np.int32),
            indices,
            np.array(last, np.int32),
            np.array([end or ps for end in ends], np.int32),  # a row of none reads as ps
            np.array(ends, np.int64),
            slots,
            spans,
            keys,
            write,
        )

    def _splice(
        self, plan_label: str, slots: np.ndarray, num_pages: np.ndarray, kv_indptr: np.ndarray
    ) -> np.ndarray:
        """The label's ``paged_kv_indices``: runs of rows that sit in the
        label's previous indices in the same order are one slice copy each;
        pages not there (a new row's, a row's new pages) come from its table."""
        out = self._recycler.empty(int(kv_indptr[-1]))
        epochs = self._epoch[slots]
        prev = self._index.get(plan_label)
        if prev is None:
            copied = np.zeros(len(slots), np.int64)
        elif (
            len(slots) - (kept := _kept_rows(prev, slots, epochs, num_pages))[1] <= self._tail_rows
        ):
            self._splice_kept(prev, *kept, out, slots, num_pages, kv_indptr)
            self._index[plan_label] = _Index(slots, epochs, num_pages, kv_indptr, out)
            return out
        else:
            where = np.full(len(self._epoch), -1, dtype=np.int64)
            where[prev.slots] = np.arange(len(prev.slots))
            old = where[slots]
            valid = old >= 0
            valid &= prev.epochs[old] == epochs
            had = np.where(valid, prev.num_pages[old], 0)
            copied = np.minimum(had, num_pages)
            # Row i extends row i - 1's run when both copy from consecutive old
            # rows and row i - 1 was copied whole into a row of the same size.
            cont = valid[1:] & valid[:-1]
            cont &= old[1:] == old[:-1] + 1
            cont &= copied[:-1] == had[:-1]
            cont &= copied[:-1] == num_pages[:-1]
            heads = np.concatenate(([0], (~cont).nonzero()[0] + 1))
            csum = np.zeros(len(slots) + 1, np.int64)
            np.add.accumulate(copied, out=csum[1:])
            lens = csum[np.append(heads[1:], len(slots))] - csum[heads]
            run = lens.nonzero()[0]
            src = prev.kv_indptr[old[heads[run]]].tolist()
            dst = kv_indptr[heads[run]].tolist()
            for s, d, n in zip(src, dst, lens[run].tolist()):
                out[d : d + n] = prev.indices[s : s + n]
        rest = (copied < num_pages).nonzero()[0]
        tables = self._tables
        for slot, a, b, d in zip(
            slots[rest].tolist(),
            copied[rest].tolist(),
            num_pages[rest].tolist(),
            kv_indptr[rest].tolist(),
        ):
            out[d + a : d + b] = tables[slot][a:b]
        self._index[plan_label] = _Index(slots, epochs, num_pages, kv_indptr, out)
        return out

    def _splice_kept(self, prev: _Index, d: int, k: int, out, slots, num_pages, kv_indptr) -> None:
        """``_splice`` when the first ``k`` rows are the previous plan's rows
        ``[d, d + k)`` (see ``_kept_rows``) and the rest are few: the old
        indices in runs between rows that took pages, each such row's new
        pages and each later row's pages from its table."""
        had = prev.num_pages[d : d + k]
        grown = (num_pages[:k] != had).nonzero()[0]
        old, tables = prev.indices, self._tables
        src, dst = int(prev.kv_indptr[d]), 0
        for end, slot, a, b, stop in zip(
            prev.kv_indptr[grown + d + 1].tolist(),
            slots[grown].tolist(),
            had[grown].tolist(),
            num_pages[grown].tolist(),
            kv_indptr[grown + 1].tolist(),
        ):
            out[dst : dst + end - src] = old[src:end]
            dst += end - src
            out[dst:stop] = tables[slot][a:b]
            src, dst = end, stop
        end = int(prev.kv_indptr[d + k])
        out[dst : dst + end - src] = old[src:end]
        self._copy_rows(out, slots[k:].tolist(), num_pages[k:].tolist(), kv_indptr[k:].tolist())

    def _copy_rows(self, out: np.ndarray, slots: list, num_pages: list, starts: list) -> None:
        """Each row's pages from its table into ``out`` at its start."""
        tables = self._tables
        for slot, n, start in zip(slots, num_pages, starts):
            out[start : start + n] = tables[slot][:n]

    def _output(self, arrays: tuple) -> KVPlanOutput:
        qo_indptr, kv_indptr, indices, last, kv_lens, ends, slots, spans, keys, write = arrays
        host = (qo_indptr, kv_indptr, indices, last)
        decode_pages, decode_offsets = write or (None, None)
        if self.ring is None:
            tensors = [torch.from_numpy(a) for a in host]
        else:
            tensors = [self.ring.take(a) for a in host]
        return KVPlanOutput(
            PagedIndptrs(*tensors, HostLens(kv_lens)),
            decode_pages=decode_pages,
            decode_offsets=decode_offsets,
            rows=keys,
            view_builder=_Views(keys, indices, kv_indptr, ends, spans, self._gen[slots]),
        )

    def _record(self, step: KVStep, rec: _Admitted) -> None:
        """Prefix cache: the step's committed tokens; fork targets made after
        them continue their sources' chains."""
        self._prefix.record(rec.slots, np.subtract(rec.ends, rec.spans), rec.tokens)
        for src, dst in step.post_forks:
            for request_id in rec.requests:
                labels = self._streams[request_id]
                self._prefix.copy(labels[src], labels[dst])

    def _finish(self, rec: _Admitted) -> None:
        """A step ended well: fork targets it replaced are freed."""
        for entry in rec.journal:
            if entry[0] == "replace":
                self._free_slot(entry[2])

    def _undo(self, rec: _Admitted, journal_mark: int, used_mark: int) -> None:
        """Undo what applying the step did since the marks: streams it made
        go (their reserved pages back to the step, shared ones released),
        streams it grew shrink back, fork targets it replaced return."""
        journal = rec.journal
        mine = rec.pool[used_mark : rec.used]
        while len(journal) > journal_mark:
            entry = journal.pop()
            if entry[0] == "grow":
                _, slots, pages = entry
                self._npages[slots] = pages
                self._touch(slots)
            elif entry[0] == "new":
                _, (request_id, label), slot = entry
                self._unmap(request_id, label)
                self._free_slot(slot, keep=mine)
            else:  # replace
                _, (request_id, label), old = entry
                self._map(request_id, label, old)
        rec.used = used_mark
        rec.slots = np.fromiter(map(self._slot_of.__getitem__, rec.keys), np.int64, len(rec.keys))
        self._index.clear()  # its arrays may name pages that went back

    # --- forks and streams ---------------------------------------------------------------

    def _fork(self, request_id: str, src: str, dst: str, rec: _Admitted) -> None:
        """``dst`` becomes a copy of ``src`` as stored now: full pages shared,
        a partially filled last page copied into a reserved page."""
        ps = self.page_size
        src_slot = self._streams[request_id][src]
        stored = int(self._stored[src_slot])
        full, tail = divmod(stored, ps)
        table = self._tables[src_slot][: full + (tail > 0)].copy()
        if tail:
            page = rec.pool[rec.used : rec.used + 1]
            if self.cache is not None:
                self.cache.copy_pages(table[full:], page)  # may raise: nothing changed yet
            self._reserved(rec, 1)
            table[full] = page[0]
        self._pages.share(table[:full])
        if dst in self._streams[request_id]:
            rec.journal.append(("replace", (request_id, dst), self._unmap(request_id, dst)))
        slot = self._new_stream(request_id, dst, table, stored)
        rec.journal.append(("new", (request_id, dst), slot))
        if self._prefix is not None:
            self._prefix.copy(src_slot, slot)

    def _new_stream(self, request_id: str, label: str, table: np.ndarray, stored: int) -> int:
        if not self._free_slots:
            self._grow_slots()
        slot = self._free_slots.pop()
        self._made += 1
        self._tables[slot] = table
        self._npages[slot] = len(table)
        self._stored[slot] = stored
        self._epoch[slot] = self._next_tick()
        self._touch(slot)
        self._map(request_id, label, slot)
        if self._prefix is not None:
            self._prefix.start(slot)
        return slot

    def _map(self, request_id: str, label: str, slot: int) -> None:
        self._streams.setdefault(request_id, {})[label] = slot
        self._slot_of[request_id, label] = slot

    def _unmap(self, request_id: str, label: str) -> int:
        """Forget the stream's key; its slot and pages stay until freed."""
        labels = self._streams[request_id]
        slot = labels.pop(label)
        if not labels:
            del self._streams[request_id]
        del self._slot_of[request_id, label]
        return slot

    def _free_slot(self, slot: int, keep: np.ndarray | None = None) -> None:
        """Free the slot and release its pages, but those in ``keep`` (pages
        an undone step took from its reservation go back to it)."""
        if self._prefix is not None and self._prefix.waiting[slot]:
            self._prefix.flush()  # its full pages are registered before they go
        pages = self._tables[slot][: self._npages[slot]]
        self._pages.release(pages if keep is None else pages[~np.isin(pages, keep)])
        self._tables[slot] = None
        self._npages[slot] = self._stored[slot] = 0
        self._epoch[slot] = -1
        self._made += 1
        self._free_slots.append(slot)

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
        if self._prefix is not None:
            self._prefix.grow(new)
        self._free_slots.extend(range(new - 1, old - 1, -1))

    def _live_slots(self) -> list[int]:
        """Slots holding pages: every stream's, and fork targets a step in
        flight replaced (freed when it ends)."""
        slots = [slot for labels in self._streams.values() for slot in labels.values()]
        for rec in self._admitted.values():
            slots += [entry[2] for entry in rec.journal if entry[0] == "replace"]
        return slots

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

    def _in_flight(self, requests: dict[str, None]) -> bool:
        return any(not rec.requests.keys().isdisjoint(requests) for rec in self._admitted.values())

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
        n = 1 if isinstance(slots, int) else len(slots)
        self._gen[slots] = (
            np.arange(self._tick + 1, self._tick + 1 + n) if n > 1 else self._tick + 1
        )
        self._tick += n


class _Views:
    """Builds a plan's views on first use, from that plan's own arrays (a
    plain class, not a closure, so nothing else of the manager is held)."""

    def __init__(self, keys, indices, kv_indptr, lengths, spans, generations):
        self.args = (keys, indices, kv_indptr, lengths, spans, generations)

    def __call__(self) -> list[SequenceView]:
        keys, indices, kv_indptr, lengths, spans, generations = self.args
        bounds = kv_indptr.tolist()
        return [
            SequenceView(request_id, label, indices[a:b].tolist(), length, span, 0, gen)
            for (request_id, label), a, b, length, span, gen in zip(
                keys, bounds, bounds[1:], lengths.tolist(), spans.tolist(), generations.tolist()
            )
        ]


def _kept_rows(prev: _Index, slots, epochs, num_pages) -> tuple[int, int]:
    """``(d, k)``: the first ``k`` rows are the previous plan's rows ``[d, d +
    k)`` (a few ahead of them may have left), on the same streams, each with
    at least the pages it had."""
    ahead = (prev.slots[: _LEFT_AHEAD + 1] == slots[:1]).nonzero()[0] if len(slots) else ()
    if not len(ahead):
        return 0, 0
    d = int(ahead[0])
    m = min(len(prev.slots) - d, len(slots))
    kept = prev.slots[d : d + m] == slots[:m]
    kept &= prev.epochs[d : d + m] == epochs[:m]
    kept &= num_pages[:m] >= prev.num_pages[d : d + m]
    return d, m if kept.all() else int(kept.argmin())


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_key(request_id: Any, label: Any) -> None:
    if not isinstance(request_id, str) or not isinstance(label, str):
        raise TypeError(f"expected request_id and label to be str, got {request_id!r}, {label!r}")


def _spans(values: list, keys: list[tuple[str, str]]) -> np.ndarray:
    """The spans as int32, each an integer in [0, 2**31); else a typed error
    naming the row."""
    if not values:
        return np.zeros(0, np.int32)
    if set(map(type, values)) == {int}:
        try:
            spans = np.array(values, dtype=np.int32)  # a Python int out of range raises
        except OverflowError:
            spans = None
        if spans is not None and np.minimum.reduce(spans) >= 0:
            return spans
    for value, (request_id, label) in zip(values, keys):  # the slow path names the row
        where = f"for request {request_id!r}, label {label!r}"
        if not _is_int(value):
            raise TypeError(f"expected span an int, got {value!r} ({type(value).__name__}) {where}")
        if not 0 <= value <= _INT32_MAX:
            raise InvalidStep(
                f"expected span >= 0 and < 2**31, got {value} {where}", request_id, label
            )
    return np.array([int(v) for v in values], dtype=np.int32)


def _equal_rows(a: tuple, b: tuple) -> bool:
    """Whether two steps' segments are equal (tokens compared too: numpy
    tokens that cannot be compared read as unequal)."""
    try:
        return a == b
    except (ValueError, TypeError):
        return False


def _check_forks(step: KVStep) -> None:
    for when, forks in (("pre-fork", step.pre_forks), ("post-fork", step.post_forks)):
        for fork in forks:
            if len(fork) != 2 or not all(isinstance(label, str) for label in fork):
                raise InvalidStep(
                    f"expected each {when} a (src, dst) pair of labels, got {fork!r}",
                    *_first_row(step),
                )
            if fork[0] == fork[1]:
                raise InvalidStep(
                    f"expected a fork between two labels, got {fork[0]!r} -> {fork[1]!r}",
                    _first_row(step)[0],
                    fork[0],
                )


def _has_forks(step: KVStep) -> bool:
    return bool(step.pre_forks or step.post_forks)


def _first_repeat(keys: list[tuple[str, str]]) -> tuple[str, str]:
    seen = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("no repeated stream")


def _first_row(step: KVStep) -> tuple[str | None, str | None]:
    return (step.segments[0].request_id, step.segments[0].label) if step.segments else (None, None)


def _describe(step: KVStep) -> str:
    rows = ", ".join(f"{s.request_id!r}/{s.label!r}" for s in step.segments[:3])
    more = f" and {len(step.segments) - 3} more" if len(step.segments) > 3 else ""
    return f"rows {rows}{more}" if rows else "no rows"
