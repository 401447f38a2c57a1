"""The prefix cache's view of each stream: the tokens behind its pages.

``PagePool`` keeps registered pages by content key; this keeps, per stream
slot, what it takes to register the stream's pages as they fill: the tokens of
its partially filled last page, how many full pages it has keyed, the key of
the last one and its namespace. A stream records while every segment that
extended it carried its tokens; one without tokens stops it for good (its
later pages are never registered, so nothing is keyed by tokens it lacks).
Only committed tokens are recorded, after the step's fallible work, so a page
is registered only once its KV is final.

A decode step fills a page in a few rows at a time; registering them then
would cost one pool call per step. Those pages wait (with their tokens) and
are registered in one batch: before a lookup, before any of their streams is
freed or forked, before other recording, or when a stream fills its next page.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

from mstar.engine.resources.kv.pages import PagePool


class TokenError(ValueError):
    """Segment tokens that do not match their span or are not integer ids."""


def step_tokens(tokens: list[Any], spans: np.ndarray, keys: list[tuple[str, str]]):
    """A step's segment tokens, checked: an int64 ``[B]`` array when every row
    carries one token (a decode step), else a list of int64 arrays (``None``
    for a row without tokens). Raises ``TokenError`` naming the row."""
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
    keyed, the last key and the namespace. Slot arrays grow with the manager's."""

    def __init__(self, pool: PagePool, page_size: int, tables: list) -> None:
        self.pool = pool
        self.page_size = page_size
        self.tables = tables  # the manager's page tables by slot (appended to, never rebound)
        self.on = np.zeros(0, dtype=bool)
        self.tail = np.zeros((0, page_size), dtype=np.int64)  # the partial page's tokens
        self.keyed = np.zeros(0, dtype=np.int64)  # full pages keyed (and registered)
        self.last_key = np.zeros(0, dtype=np.uint64)  # the last keyed page's (if keyed)
        self.namespace: list[str] = []
        self.queried = self.hit = 0  # tokens asked of match_prefix, tokens served
        self.waiting = np.zeros(0, dtype=bool)  # per slot: a full page not yet registered
        self._wait: list[tuple[np.ndarray, np.ndarray]] = []  # (slots [n], tokens [n, ps])

    def grow(self, n: int) -> None:
        old = len(self.on)
        self.on = np.concatenate((self.on, np.zeros(n - old, bool)))
        self.tail = np.concatenate((self.tail, np.zeros((n - old, self.page_size), np.int64)))
        self.keyed = np.concatenate((self.keyed, np.zeros(n - old, np.int64)))
        self.last_key = np.concatenate((self.last_key, np.zeros(n - old, np.uint64)))
        self.waiting = np.concatenate((self.waiting, np.zeros(n - old, bool)))
        self.namespace += [""] * (n - old)

    def start(self, slot: int, namespace: str = "", keyed: int = 0, last: int | None = None):
        """A new stream whose first ``keyed`` pages are cached ones."""
        self.on[slot] = True
        self.keyed[slot] = keyed
        self.last_key[slot] = last or 0
        self.namespace[slot] = namespace

    def copy(self, src: int, dst: int) -> None:
        """A fork: ``dst`` continues ``src``'s chain."""
        self.flush()
        self.on[dst] = self.on[src]
        self.tail[dst] = self.tail[src]
        self.keyed[dst] = self.keyed[src]
        self.last_key[dst] = self.last_key[src]
        self.namespace[dst] = self.namespace[src]

    def match(self, tokens: np.ndarray, namespace: str) -> tuple[np.ndarray, int | None]:
        """The cached pages of the longest run of ``tokens``' full pages that
        leaves at least one token to compute, and the key of the last."""
        self.flush()
        usable = (len(tokens) - 1) // self.page_size * self.page_size
        keys = self.pool.page_keys(tokens[: max(usable, 0)], None, namespace)
        pages = self.pool.lookup(keys)
        self.queried += len(tokens)
        self.hit += len(pages) * self.page_size
        return pages, int(keys.hashes[len(pages) - 1]) if len(pages) else None

    def record(self, slots: np.ndarray, stored: np.ndarray, tokens) -> None:
        """Committed tokens of a step's rows (``stored``: the lengths before
        it); pages they fill are registered (a decode step's, in a while)."""
        ps, tables = self.page_size, self.tables
        on = self.on[slots]
        if isinstance(tokens, np.ndarray):  # one token a row: vectorized
            live, at = slots, stored % ps
            if not on.all():
                live, at, tokens = live[on], at[on], tokens[on]
            self.tail[live, at] = tokens
            filled = live[at == ps - 1]
            if len(filled):
                if self.waiting[filled].any():  # a stream's next page: its last goes first
                    self.flush()
                self.waiting[filled] = True
                self._wait.append((filled, self.tail[filled]))
            return
        self.flush()
        for slot, old, t, active in zip(slots.tolist(), stored.tolist(), tokens, on.tolist()):
            if not active or (t is not None and not len(t)):
                continue
            if t is None:  # extended without tokens: no more registering
                self.on[slot] = False
                continue
            have = old % ps
            chain = np.concatenate((self.tail[slot, :have], t))
            full = len(chain) // ps * ps
            if full:
                self._register(slot, chain[:full], tables[slot])
            self.tail[slot, : len(chain) - full] = chain[full:]

    def _register(self, slot: int, tokens: np.ndarray, table: np.ndarray) -> None:
        """Key and register the stream's next full pages, holding ``tokens``."""
        first = int(self.keyed[slot])
        parent = int(self.last_key[slot]) if first else None
        keys = self.pool.page_keys(tokens, parent, self.namespace[slot])
        n = len(keys.hashes)
        self.pool.register(table[first : first + n], keys, int(table[first - 1]) if first else -1)
        self.keyed[slot] = first + n
        self.last_key[slot] = keys.last

    def flush(self) -> None:
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
        slots, keyed, tokens = slots[chained], keyed[chained], tokens[chained]
        if not len(slots):
            return
        rows = [(tables[s], k) for s, k in zip(slots.tolist(), keyed.tolist())]
        parents = np.array([table.item(k - 1) for table, k in rows], dtype=np.int32)
        pages = np.array([table.item(k) for table, k in rows], dtype=np.int32)
        self.last_key[slots] = self.pool.register_next(
            pages, tokens, self.last_key[slots], parents
        )[:]
        self.keyed[slots] += 1
