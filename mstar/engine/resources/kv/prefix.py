"""The prefix cache's view of each stream: the tokens behind its pages.

``PagePool`` keeps registered pages by content key; this keeps, per stream
slot, what it takes to register the stream's pages as they fill: the tokens of
its partially filled last page, how many full pages it has keyed, the key of
the last one and its namespace. A stream records while every segment that
extended it carried its tokens; one without tokens stops it for good (its
later pages are never registered, so nothing is keyed by tokens it lacks).
Only committed tokens are recorded, after the step's fallible work, so a page
is registered only once its KV is final.

A decode step (one token a row) is not even recorded when it commits: its
rows, lengths and tokens are kept, and up to ``page_size`` such steps are
recorded together, in a few array operations for them all. The pages they
fill wait (with their tokens) and are registered in one batch. Both happen
before a lookup, before any stream is freed or forked, before other
recording, or when a stream fills its next page. A stream's partial page
lives in one half of a two-page ring (``tail``), so the up to ``page_size -
1`` tokens a stream records after filling a page never overwrite it.

Tails: a recording stream freed with a partial last page leaves it cached
(``leave_tail``, see ``kv.tails``), and ``match`` continues a prompt past
its cached full pages into the cached page sharing the most tokens with the
rest (a tail; the prompt's last full page when taking it whole would leave
nothing to compute; the page last registered after the last one matched):
that page's KV is copied into a page of the new stream's own, whose chain
then records on from those tokens.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.tails import Anchor, best_tail

_NO_PAGES = np.zeros(0, dtype=np.int32)


class TokenError(ValueError):
    """Segment tokens that do not match their span or are not integer ids."""


def step_tokens(
    flat: np.ndarray | None, tokens: tuple, spans: np.ndarray, keys: list[tuple[str, str]]
):
    """A step's new tokens, checked, from the step (``flat``, ``KVStep.tokens``)
    or else its segments (``tokens``, their column): an int64 ``[B]`` array
    when every row takes one token (a decode step), else a list of int64
    arrays (``None`` for a row without tokens). Raises ``TokenError`` naming
    the row (the step's first for a wrong count)."""
    if flat is None:
        return _segment_tokens(tokens, spans, keys)
    if tokens.count(None) != len(tokens):
        request_id, label = keys[next(i for i, t in enumerate(tokens) if t is not None)]
        raise TokenError(
            f"expected tokens on the step or on its segments, got both (segment tokens for"
            f" request {request_id!r}, label {label!r})"
        )
    total = int(np.add.reduce(spans, dtype=np.int64))
    if len(flat) != total:
        where = f"request {keys[0][0]!r}, label {keys[0][1]!r}" if keys else "no rows"
        raise TokenError(
            f"expected the step's tokens {total} ids (its spans' sum), got {len(flat)}"
            f" (first row: {where})"
        )
    ids = flat.astype(np.int64)  # a copy: kept past the step, the caller may reuse its array
    if total and total == len(spans) and np.maximum.reduce(spans) == 1:
        return ids  # one a row: a decode step
    return np.split(ids, np.cumsum(spans[:-1])) if len(spans) else []


def _segment_tokens(tokens: tuple, spans: np.ndarray, keys: list[tuple[str, str]]):
    """``step_tokens`` from the segments' tokens."""
    n = len(tokens)
    if n and np.minimum.reduce(spans) == 1 == np.maximum.reduce(spans):
        try:  # a decode step: one id a row, taken with C-level passes
            if set(map(len, tokens)) == {1}:
                flat = np.array(list(map(itemgetter(0), tokens)))
                if flat.dtype.kind in "iu":
                    return flat.astype(np.int64, copy=False)
        except TypeError:  # a row without tokens (None): the rows one by one
            pass
    rows = []
    for t, span, (request_id, label) in zip(tokens, spans.tolist(), keys):
        if t is None:
            rows.append(None)
            continue
        a = np.asarray(t)
        if a.ndim != 1 or len(a) != span or (a.dtype.kind not in "iu" and len(a)):
            raise TokenError(
                f"expected tokens {span} integer ids (the span), got {t!r} for request"
                f" {request_id!r}, label {label!r}"
            )
        rows.append(a.astype(np.int64))
    return rows


class PrefixChains:
    """Per stream slot: recording on/off, the partial page's tokens, pages
    keyed, the last key and page, and the namespace. Slot arrays grow with the manager's."""

    def __init__(self, pool: PagePool, page_size: int, tables: list) -> None:
        self.pool = pool
        self.page_size = page_size
        self.tables = tables  # the manager's page tables by slot (appended to, never rebound)
        self.on = np.zeros(0, dtype=bool)
        # the partial page's tokens, at [slot, (position // page_size) % 2]
        self.tail = np.zeros((0, 2, page_size), dtype=np.int64)
        self.keyed = np.zeros(0, dtype=np.int64)  # full pages keyed (and registered)
        self.last_key = np.zeros(0, dtype=np.uint64)  # the last keyed page's (if keyed)
        self.last_page = np.zeros(0, dtype=np.int32)  # that page: tables[slot][keyed - 1]
        self.namespace: list[str] = []
        self.queried = self.hit = 0  # tokens asked of match_prefix, tokens served
        self.waiting = np.zeros(0, dtype=bool)  # per slot: a full page not yet registered
        self._wait: list[tuple[np.ndarray, np.ndarray]] = []  # (slots [n], tokens [n, ps])
        self._steps: list[tuple[np.ndarray, Any, np.ndarray]] = []  # decode steps not recorded

    def grow(self, n: int) -> None:
        old = len(self.on)
        self.on = np.concatenate((self.on, np.zeros(n - old, bool)))
        self.tail = np.concatenate((self.tail, np.zeros((n - old, 2, self.page_size), np.int64)))
        self.keyed = np.concatenate((self.keyed, np.zeros(n - old, np.int64)))
        self.last_key = np.concatenate((self.last_key, np.zeros(n - old, np.uint64)))
        self.last_page = np.concatenate((self.last_page, np.zeros(n - old, np.int32)))
        self.waiting = np.concatenate((self.waiting, np.zeros(n - old, bool)))
        self.namespace += [""] * (n - old)

    def start(
        self,
        slot: int,
        namespace: str = "",
        keyed: int = 0,
        last: int | None = None,
        tail: np.ndarray | None = None,
    ):
        """A new stream (its page table made) whose first ``keyed`` pages are
        cached ones, and whose next page holds ``tail``'s tokens (copied)."""
        self.on[slot] = True
        self.keyed[slot] = keyed
        self.last_key[slot] = last or 0
        self.last_page[slot] = self.tables[slot][keyed - 1] if keyed else 0
        self.namespace[slot] = namespace
        if tail is not None:
            self.tail[slot, keyed % 2, : len(tail)] = tail

    def copy(self, src: int, dst: int) -> None:
        """A fork: ``dst`` continues ``src``'s chain."""
        self.flush()
        self.on[dst] = self.on[src]
        self.tail[dst] = self.tail[src]
        self.keyed[dst] = self.keyed[src]
        self.last_key[dst] = self.last_key[src]
        self.last_page[dst] = self.last_page[src]
        self.namespace[dst] = self.namespace[src]

    def match(
        self, tokens: np.ndarray, namespace: str, cache: Any
    ) -> tuple[np.ndarray, int, int | None]:
        """A new stream's start on the cache, leaving at least one of
        ``tokens`` to compute: its pages, now owned (the cached pages of the
        longest run of ``tokens``' full pages, then, with a ``cache`` to copy
        with and a page free, a copy of the best cached partial page), its
        stored length and the key of its last full page (None: none)."""
        self.flush()
        ps = self.page_size
        keys = self.pool.page_keys(tokens, None, namespace)
        pages = self.pool.lookup(keys)
        usable = max(len(tokens) - 1, 0) // ps
        spare = int(pages[usable]) if len(pages) > usable else -1  # a whole last page
        pages = pages[:usable]
        self.pool.share(pages)
        full = len(pages) * ps
        anchor: Anchor = int(pages[-1]) if len(pages) else namespace
        copy, c = _NO_PAGES, 0
        if cache is not None:
            try:
                copy, c = self._copy_tail(tokens[full:], anchor, spare, cache)
            except BaseException:
                self.pool.release(pages)
                raise
        self.queried += len(tokens)
        self.hit += full + c
        last = int(keys.hashes[len(pages) - 1]) if len(pages) else None
        return np.concatenate((pages, copy)), full + c, last

    def _copy_tail(
        self, rest: np.ndarray, anchor: Anchor, spare: int, cache: Any
    ) -> tuple[np.ndarray, int]:
        """A fresh page holding the KV of the cached page sharing the longest
        common prefix with ``rest`` (less its last token), and that prefix's
        length ``c``: a tail under ``anchor``, the registered ``spare`` (-1:
        none) or the page last registered after ``anchor``. No page and 0
        when none shares any or no page is free. The page allocated may be
        the source itself, evicted (a copy onto itself): its KV stays, and
        nothing else it takes along is reused before the copy."""
        pool = self.pool
        registry = pool.registry
        child = registry.child(anchor)
        found = pool.tails.under(anchor)
        found = found + [(p, registry.tokens[p]) for p in dict.fromkeys((spare, child)) if p >= 0]
        src, c = best_tail(found, rest)
        if not c or not pool.num_free:
            return _NO_PAGES, 0
        page = pool.alloc(1)
        try:
            cache.copy_pages(np.array([src], dtype=np.int32), page)
        except BaseException:
            pool.release(page)
            raise
        return page, c

    def record(self, slots: np.ndarray, ends: Any, spans: np.ndarray, tokens) -> None:
        """Committed tokens of a step's rows (``ends``: the lengths after it);
        pages they fill are registered (a decode step's, in a while)."""
        if isinstance(tokens, np.ndarray):  # one token a row: recorded with others
            self._steps.append((slots, ends, tokens))
            if len(self._steps) == self.page_size:
                self._record_steps()
            return
        self.flush()
        ps, tables = self.page_size, self.tables
        stored = np.subtract(ends, spans)
        on = self.on[slots]
        for slot, old, t, active in zip(slots.tolist(), stored.tolist(), tokens, on.tolist()):
            if not active or (t is not None and not len(t)):
                continue
            if t is None:  # extended without tokens: no more registering
                self.on[slot] = False
                continue
            have = old % ps
            chain = np.concatenate((self.tail[slot, old // ps % 2, :have], t))
            full = len(chain) // ps * ps
            if full:
                self._register(slot, chain[:full], tables[slot])
            end = old + len(t)
            self.tail[slot, end // ps % 2, : len(chain) - full] = chain[full:]

    def _record_steps(self) -> None:
        """Record the decode steps kept (at most ``page_size``: no stream
        fills two pages in them), all at once."""
        steps, self._steps = self._steps, []
        ps = self.page_size
        slots = np.concatenate([s[0] for s in steps])
        at = np.concatenate([s[1] for s in steps]) - 1  # each token's position
        tokens = np.concatenate([s[2] for s in steps])
        on = self.on[slots]
        if not on.all():
            slots, at, tokens = slots[on], at[on], tokens[on]
        self.tail.reshape(len(self.tail), 2 * ps)[slots, at % (2 * ps)] = tokens
        rows = (at % ps == ps - 1).nonzero()[0]
        if len(rows):
            filled = slots[rows]
            if self.waiting[filled].any():  # a stream's next page: its last goes first
                self._register_waiting()
            self.waiting[filled] = True
            self._wait.append((filled, self.tail[filled, at[rows] // ps % 2]))

    def _register(self, slot: int, tokens: np.ndarray, table: np.ndarray) -> None:
        """Key and register the stream's next full pages, holding ``tokens``."""
        first = int(self.keyed[slot])
        parent = int(self.last_key[slot]) if first else None
        keys = self.pool.page_keys(tokens, parent, self.namespace[slot])
        n = len(keys.hashes)
        self.pool.register(table[first : first + n], keys, int(table[first - 1]) if first else -1)
        self.keyed[slot] = first + n
        self.last_key[slot] = keys.last
        self.last_page[slot] = table[first + n - 1]

    def flush(self) -> None:
        """Record the decode steps kept and register the full pages waiting."""
        if self._steps:
            self._record_steps()
        self._register_waiting()

    def settle(self, slot: int) -> None:
        """Before ``slot``'s stream is freed: what it recorded is in and its
        full pages are registered."""
        if self._steps:
            self._record_steps()
        if self.waiting[slot]:
            self._register_waiting()

    def leave_tail(self, slot: int, stored: int) -> None:
        """Before ``slot``'s stream (settled) is freed holding ``stored``
        tokens: a partial last page it recorded stays cached as a tail,
        under the registered page holding its last full page's chain (its
        namespace without one; nothing when that chain is not cached)."""
        ps = self.page_size
        keyed, t = divmod(stored, ps)
        if not t or not self.on[slot]:
            return
        assert self.keyed[slot] == keyed, "a recording stream keys each page it fills"
        anchor: Anchor | None = self.namespace[slot]
        if keyed:
            anchor = self.pool.registry.holder(int(self.last_page[slot]))
            if anchor is None:
                return
        tokens = self.tail[slot, keyed % 2, :t].copy()
        self.pool.cache_tail(int(self.tables[slot][keyed]), anchor, tokens)

    def _register_waiting(self) -> None:
        """Register the full pages waiting: one batch for those continuing a
        chain, one call each for first pages."""
        if not self._wait:
            return
        slots = np.concatenate([w[0] for w in self._wait])
        tokens = np.concatenate([w[1] for w in self._wait])
        self._wait.clear()
        self.waiting[slots] = False
        tables, keyed = self.tables, self.keyed[slots]
        for i in (keyed == 0).nonzero()[0].tolist():
            self._register(int(slots[i]), tokens[i], tables[slots[i]])
        chained = keyed > 0
        if not chained.all():
            slots, keyed, tokens = slots[chained], keyed[chained], tokens[chained]
            if not len(slots):
                return
        rows = map(tables.__getitem__, slots.tolist())  # C-level passes, no frames
        pages = np.fromiter(map(np.ndarray.item, rows, keyed.tolist()), np.int32, len(slots))
        self.last_key[slots] = self.pool.register_next(
            pages, tokens, self.last_key[slots], self.last_page[slots]
        )
        self.last_page[slots] = pages
        self.keyed[slots] += 1
