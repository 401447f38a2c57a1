"""KVManager: the pages of every (request, label) stream, and the plans over them.

A step goes ``admit`` (validate, reserve every page it will need, all or
nothing) -> ``plan`` (apply pre-forks and spans, hand out a ``KVPlanOutputs``)
-> ``commit`` (advance lengths, apply post-forks), or ``abort`` at any point
after ``admit``. Only ``admit`` allocates, so ``plan`` and ``commit`` never
fail for memory; if either raises anyway (a cache's ``copy_pages``), its
journal undoes what it did and the step is as before the call.

Pages: a stream's pages hold its tokens in order, ``page_size`` each. A page
whose tokens are all stored is full and never written again, so forks share
full pages by reference count and copy only a partially filled last page.

Windows: with ``window=W`` (a model whose every attention layer sees the last
``W`` keys, HF's ``sliding_window``), a query at position ``p`` reads keys
``>= p - W + 1`` only. After each commit, a stream's full pages wholly
behind its next query's window go back to the pool, so it holds at most
``ceil(W / page_size) + 1`` pages between steps. Its plan rows then describe
the kept pages alone (``SequenceView.start``, ``KVPlanOutput.kv_offsets``:
see ``plan``) and positions stay absolute. The release is the last thing a
commit does, once nothing can fail, so no undo ever meets one; ``abort``
and a refused step change nothing.

The work is done by collaborators, one job each: ``StreamTable`` (streams'
slots, pages, lengths), ``Admission`` (checking a step, resolving its rows,
counting its pages), ``Journal`` (a step's reserved pages and its undo),
``Forks``, ``StepWriter`` (what a step changes, and its undo), ``IndexBuilder``
(a plan label's arrays) and ``PagePool`` (pages, their owners and the prefix
cache). This class holds the lock and the order.

A shared pool (``pool=``, a hybrid model's KV groups: ``KVGroups``): the
manager allocates from and releases to a ``PagePool`` other managers use too,
under the pool's lock; each page it owns is its own (no page is shared
between managers), and the pool's free pages are capacity for all of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mstar.engine.resources.kv.admission import (
    Admission,
    Admitted,
    check_key,
    describe,
    first_row,
    is_int,
)
from mstar.engine.resources.kv.errors import (
    AllocationFailed,
    InvalidStep,
    KVError,
    UnknownStream,
)
from mstar.engine.resources.kv.forks import Forks
from mstar.engine.resources.kv.index import IndexBuilder
from mstar.engine.resources.kv.invariants import check_invariants, owner_counts
from mstar.engine.resources.kv.journal import Advanced, Journal
from mstar.engine.resources.kv.lengths import INT32_MAX
from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.paths import Paths
from mstar.engine.resources.kv.plan import KVPlanOutputs, PinnedIndexRing
from mstar.engine.resources.kv.rewind import check_kept, check_rewind
from mstar.engine.resources.kv.streams import StreamTable
from mstar.engine.resources.kv.writer import StepWriter
from mstar.engine.resources.step import KVStep

__all__ = [
    "AllocationFailed",
    "InvalidStep",
    "KVError",
    "KVManager",
    "UnknownStream",
    "check_sizes",
]


def check_sizes(num_pages: int, page_size: int) -> None:
    """Refuse a pool whose pages or slots int32 indices cannot name."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size)):
        if not is_int(value) or not 1 <= value <= INT32_MAX:
            raise ValueError(f"expected {name} an int in [1, 2**31), got {value!r}")
    if num_pages * page_size > INT32_MAX:
        raise ValueError(
            f"expected num_pages * page_size < 2**31 (int32 slots), got {num_pages * page_size}"
        )


def _check_options(
    num_pages: int, page_size: int, prefix_cache: bool, window: int | None, pool: PagePool | None
) -> None:
    """Refuse ``KVManager``'s arguments before anything is built."""
    check_sizes(num_pages, page_size)
    if window is not None:
        if not is_int(window) or not 1 <= window <= INT32_MAX:
            raise ValueError(f"expected window None or an int in [1, 2**31), got {window!r}")
        if prefix_cache:
            raise ValueError(
                "expected window=None with prefix_cache=True (a windowed stream's released"
                f" pages cannot serve as a prefix), got window {window}"
            )
    if pool is not None:
        if not isinstance(pool, PagePool):
            raise TypeError(f"expected pool a PagePool or None, got {type(pool).__name__}")
        if (pool.num_pages, pool.page_size) != (num_pages, page_size):
            raise ValueError(
                f"expected a pool of {num_pages} pages of {page_size}, got one of"
                f" {pool.num_pages} pages of {pool.page_size}"
            )
        if prefix_cache:
            raise ValueError(
                "expected prefix_cache=False with a shared pool (a page registered by one"
                " manager would be reused by another), got prefix_cache=True"
            )


def _token_ids(tokens: Any, request_id: str, label: str) -> np.ndarray:
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.dtype.kind not in "iu" and ids.size):
        raise TypeError(
            f"expected tokens a 1-D sequence of int ids, got {ids.dtype} {ids.shape}"
            f" for request {request_id!r}, label {label!r}"
        )
    return ids


class KVManager:
    """Pages, streams and forks -> plans. Thread-safe: one lock guards the state.

    With ``prefix_cache=True``, full pages are registered by content once
    committed (a stream's segments must carry their ``tokens``), stay cached
    after their last owner lets go until their memory is needed (cached pages
    count as free), a freed stream's partial last page stays cached too (a
    tail: copied, never shared), and ``match_prefix`` starts a new stream on
    the longest cached prefix of a prompt.

    With ``pool`` (a ``PagePool`` of ``num_pages`` pages of ``page_size``) it
    allocates from that pool, shared with other managers, under the pool's
    lock (no prefix cache then)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        cache: Any | None = None,
        ring: PinnedIndexRing | None = None,
        *,
        prefix_cache: bool = False,
        window: int | None = None,
        pool: PagePool | None = None,
    ) -> None:
        _check_options(num_pages, page_size, prefix_cache, window, pool)
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.cache = cache
        self.ring = ring
        self.window = None if window is None else int(window)
        self._shared = pool is not None
        self._pages = PagePool(self.num_pages, self.page_size) if pool is None else pool
        self._lock = self._pages.lock
        self._streams = StreamTable(self._pages, self.page_size, prefix_cache)
        self._prefix = self._streams.prefix
        self._paths = Paths()
        self._admitted: dict[KVStep, Admitted] = {}
        self._admission = Admission(
            self._streams, self._pages, self.page_size, self._paths, self._admitted
        )
        self._forks = Forks(self._streams, self._pages, self.page_size, cache)
        self._index = IndexBuilder(self._streams, self.page_size, self._paths, self.window)
        self._writer = StepWriter(
            self._streams, self._admission, self._forks, self._index, self.window
        )

    # --- queries -----------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return self._pages.num_free

    @property
    def pool(self) -> PagePool:
        """The manager's page pool, for what hooks into its prefix cache (KV
        events hear its registry, KV tiers fill and spill its pages)."""
        return self._pages

    def stored_len(self, request_id: str, label: str) -> int:
        """Tokens committed to the stream (those behind its window included)."""
        with self._lock:
            slot = self._slot(request_id, label)
            return int(self._streams.stored[slot] + self._streams.base[slot])

    def held_pages(self, request_id: str, label: str) -> int:
        """Pages the stream holds now (shared ones included)."""
        with self._lock:
            return int(self._streams.npages[self._slot(request_id, label)])

    def page_ids(self, request_id: str, label: str) -> np.ndarray:
        """The pages the stream holds now, in token order (a copy)."""
        with self._lock:
            slot = self._slot(request_id, label)
            return self._streams.tables[slot][: self._streams.npages[slot]].copy()

    def labels(self, request_id: str) -> list[str]:
        """The labels of the request's streams (empty for an unknown request)."""
        with self._lock:
            return list(self._streams.labels(request_id))

    def shared_pages(self) -> int:
        """Page references saved by sharing: sum over pages of owners - 1."""
        with self._lock:
            return self._pages.shared()

    @property
    def num_cached_pages(self) -> int:
        """Free pages that still hold a cached prefix (evicted when needed)."""
        return self._pages.num_cached

    def prefix_stats(self) -> dict[str, int]:
        """Tokens queried and hit by ``match_prefix`` (a copied partial
        page's too), pages registered in the cache now, registered pages
        evicted so far, partial pages cached now (tails: never registered)."""
        with self._lock:
            p = self._prefix
            if p is not None:
                p.flush()
            return {
                "tokens_queried": p.queried if p else 0,
                "tokens_hit": p.hit if p else 0,
                "pages_cached": self._pages.num_registered,
                "pages_evicted": self._pages.num_evicted,
                "tails_cached": self._pages.tails.size,
            }

    def match_prefix(self, request_id: str, label: str, tokens: Any, namespace: str = "") -> int:
        """Start the stream (request_id, label) on the longest cached prefix
        of ``tokens`` that leaves at least one token to compute, and return
        its stored length (0 when nothing matches; any length, not only a
        multiple of ``page_size``). The cached full pages equal to its pages
        are shared; with a cache attached and a page free, the tokens past
        them come from the cached page sharing the most with the rest (a
        freed stream's partial last page; the page last registered after
        those; the prompt's last full page when taking it whole would leave
        nothing), whose KV is copied into a page of the stream's own. The caller
        schedules the rest. ``namespace`` separates KV that equal tokens do
        not determine (an adapter, images, a salt). Raises as the cache's
        ``copy_pages`` does, changing nothing."""
        with self._lock:
            if self._prefix is None:
                raise InvalidStep(
                    "the prefix cache is off (KVManager(..., prefix_cache=True))", request_id, label
                )
            check_key(request_id, label)
            if not isinstance(namespace, str):
                raise TypeError(f"expected namespace a str, got {namespace!r}")
            if self._streams.slot(request_id, label):
                raise InvalidStep(
                    f"expected a new stream, got existing request {request_id!r}, label {label!r}",
                    request_id,
                    label,
                )
            self._check_idle(request_id, label, "")
            ids = _token_ids(tokens, request_id, label)
            pages, stored, last = self._prefix.match(ids, namespace, self.cache)
            slot = self._streams.make(request_id, label, pages, stored)
            keyed = stored // self.page_size
            self._prefix.start(slot, namespace, keyed, last, ids[keyed * self.page_size : stored])
            return stored

    # --- the step protocol -------------------------------------------------------------

    def admit(self, step: KVStep) -> None:
        """Validate ``step`` and reserve every page it will need. Raises
        ``AllocationFailed``, ``InvalidStep``/``UnknownStream`` (a bad step) or
        ``TypeError`` (a value of the wrong type), and then changes nothing."""
        with self._lock:
            rec = self._admission.check(step)
            rec.journal = Journal(self._pages.alloc(rec.need))
            self._admitted[step] = rec

    def pages_needed(self, step: KVStep) -> tuple[list[tuple[str, str]], np.ndarray]:
        """The step's rows (``(request_id, label)``, in order) and the pages
        admitting it would reserve for each (int64); raises as ``admit`` for
        a bad step, never ``AllocationFailed``, and changes nothing."""
        with self._lock:
            rec = self._admission.sized(step)
            return list(rec.keys), np.asarray(rec.grow, dtype=np.int64)

    def plan(self, step: KVStep) -> KVPlanOutputs:
        """Apply the pre-forks and the spans' pages and return one
        ``KVPlanOutput`` per plan label, in ``group_by_plan_label`` order. If
        it raises, the step is as admitted (plan it again, or abort it)."""
        with self._lock:
            rec = self._get_admitted(step)
            if rec.planned:
                raise InvalidStep(f"step already planned ({describe(step)})", *first_row(step))
            mark = rec.journal.mark()
            try:
                self._writer.apply(step, rec)
                arrays = [self._index.arrays(label, m, rec) for label, m in rec.groups.items()]
                if self.ring is not None:  # only a plan that is handed out advances the ring
                    self.ring.begin_plan()
                outs = [self._index.publish(a, self.ring) for a in arrays]
            except BaseException:
                self._writer.undo(rec, mark)
                if self.ring is not None:  # its buffers were handed to no one
                    self.ring.discard_plan()
                raise
            rec.planned = True
            return KVPlanOutputs(dict(zip(rec.groups, outs)), step.pre_forks, step.post_forks)

    def commit(self, step: KVStep, kept: Any = None) -> None:
        """Advance each stream by its span (unless ``step.commit`` is False:
        then the reservation stays), then apply the post-forks. If it raises,
        the step is as before the call (commit it again, or abort it).

        ``kept`` (ints, one a row in segment order, each in ``[0, span]``):
        each row commits only its first ``kept`` tokens (a verify row's
        accepted ones), its pages wholly past them back to the pool, its
        prefix pages registered by those tokens alone; a step with
        post-forks or ``commit=False`` commits every token or none. A bad
        ``kept`` raises ``InvalidStep`` naming the row, changing nothing."""
        with self._lock:
            rec = self._get_admitted(step)
            cut = None if kept is None else check_kept(step, rec, kept)
            journal = rec.journal
            mark = journal.mark()
            try:
                if not rec.planned:
                    self._writer.apply(step, rec)
                ends = rec.ends if cut is None else np.subtract(rec.ends, cut)
                if step.commit:
                    self._streams.advance(rec.slots, ends)
                if step.post_forks:  # they may fail: the lengths are journaled first
                    if step.commit:
                        journal.add(Advanced(rec.slots, rec.spans))
                    self._forks.apply(step.post_forks, rec.requests, journal)
            except BaseException:
                self._writer.undo(rec, mark)
                raise
            assert journal.taken == len(journal.reserved), "a step uses exactly its reserved pages"
            self._writer.settle(step, rec, ends, cut)
            self._admission.remember(step, rec)
            del self._admitted[step]

    def abort(self, step: KVStep) -> None:
        """Abandon an admitted (possibly planned) step, e.g. when the model's
        forward failed: every page it reserved returns, the streams it created
        (its new rows, its pre-forks' targets) are gone, a fork target it
        replaced is back, and lengths are as before ``admit``. The requests can
        be scheduled again at once."""
        with self._lock:
            rec = self._get_admitted(step)
            self._writer.undo(rec, (0, 0))
            self._pages.release(rec.journal.reserved)
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
            self._check_idle(request_id, label)
            labels = self._streams.labels(request_id)
            if not labels:
                raise UnknownStream(f"unknown request {request_id!r}", request_id, label)
            names = list(labels) if label is None else [label]
            self._slot(request_id, names[0])  # an unknown label raises before any change
            for name in names:
                self._streams.free(self._streams.unmap(request_id, name))

    def rewind(self, request_id: str, label: str, n: int) -> None:
        """Take back the last ``n`` committed tokens of the stream: its length
        goes back by ``n``, its pages wholly past the new length return to the
        pool, a partially kept page stays (the next tokens overwrite its stale
        slots). Refused (``InvalidStep``, nothing changed) while the request is
        in a step, past what it holds or what its window kept, into a page it
        shares, or behind a page the prefix cache registered (commit fewer
        tokens instead: ``commit(step, kept)``)."""
        with self._lock:
            new = self._check_rewind(request_id, label, n)
            slot = self._slot(request_id, label)
            if new != self._streams.stored[slot]:
                self._writer.shorten(np.array([slot]), np.array([new]))

    def check_rewind(self, request_id: str, label: str, n: int) -> int:
        """Raise as ``rewind`` would, changing nothing; else the stream's
        length after it (in the pages it holds, behind a window)."""
        with self._lock:
            return self._check_rewind(request_id, label, n)

    def _check_rewind(self, request_id: str, label: str, n: int) -> int:
        check_key(request_id, label)
        slot = self._slot(request_id, label)
        self._check_idle(request_id, label)
        if self._prefix is not None:
            self._prefix.flush()  # its full pages registered: what it may not rewind
        return check_rewind(self._streams, slot, request_id, label, n, self.window)

    # --- invariants --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken rule."""
        with self._lock:
            in_flight = list(self._admitted.values())
            check_invariants(self._pages, self._streams, in_flight, self._shared)

    def owner_counts(self) -> np.ndarray:
        """How many times this manager's streams and reservations name each
        page of its pool (int64 ``[num_pages]``): a shared pool's refcounts
        are the sum over its managers."""
        with self._lock:
            return owner_counts(self.num_pages, self._streams, list(self._admitted.values()))

    # --- lookups -----------------------------------------------------------------------------

    def _slot(self, request_id: str, label: str) -> int:
        slot = self._streams.slot(request_id, label)
        if not slot:
            raise UnknownStream(
                f"no stream for request {request_id!r}, label {label!r}", request_id, label
            )
        return slot

    def _check_idle(
        self, request_id: str, label: str | None, hint: str = ": commit or abort it first"
    ) -> None:
        """Refuse a change to a request while it is in an admitted step."""
        if self._admission.in_flight({request_id: None}):
            raise InvalidStep(
                f"request {request_id!r} is in an admitted step{hint}", request_id, label
            )

    def _get_admitted(self, step: KVStep) -> Admitted:
        rec = self._admitted.get(step)
        if rec is None:
            raise InvalidStep(f"step was not admitted ({describe(step)})", *first_row(step))
        return rec
