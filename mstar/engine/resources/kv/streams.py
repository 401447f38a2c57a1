"""The stream table: each (request, label) stream's slot, pages and length.

Streams are struct-of-arrays by slot, so a step's rows, once resolved to
slots, are array arithmetic. Slot 0 is the empty stream (no pages, length 0)
that a stream not made yet resolves to. One map, request -> label -> slot,
names the streams.

Invariants: a stream's page table holds at least the pages of its length,
in order; a free slot has no table, no pages, length 0 and epoch -1.

Windows: ``drop`` releases a stream's first pages once nothing reads them
again. Its table, ``npages`` and ``stored`` then count from the first kept
page (page space), and ``base[slot]`` holds the tokens released before it (a
multiple of the page size), so the stream's absolute length is ``base +
stored`` and a token's position is ``base`` plus its page-space slot.

Versions: ``gen[slot]`` changes whenever the stream's pages or length
change (a view's ``generation``); ``epoch[slot]`` changes when the slot
starts a new stream, so slots resolved earlier still name the same streams
while their epochs match; ``made`` counts streams made and freed, so while it
stands no epoch needs comparing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.prefix import PrefixChains

_NO_LABELS: dict[str, int] = {}  # an unknown request's (read, never written)


class StreamTable:
    """Slots of streams, their page tables, lengths and versions. Frees a
    stream's pages to ``pool``; with a prefix cache, its ``PrefixChains``
    (``prefix``) follow the slots."""

    def __init__(self, pool: PagePool, page_size: int, prefix_cache: bool = False) -> None:
        self.pool = pool
        self.page_size = page_size
        self.requests: dict[str, dict[str, int]] = {}  # request -> label -> slot
        self.tables: list[np.ndarray | None] = [np.zeros(0, np.int32)]  # appended, never rebound
        self.stored = np.zeros(1, dtype=np.int64)  # tokens committed
        self.npages = np.zeros(1, dtype=np.int64)  # pages held (>= those of ``stored``)
        self.base = np.zeros(1, dtype=np.int64)  # tokens released before the first page
        self.gen = np.zeros(1, dtype=np.int64)
        self.epoch = np.zeros(1, dtype=np.int64)
        self.made = 0
        self.prefix = PrefixChains(pool, page_size, self.tables) if prefix_cache else None
        self._free: list[int] = []
        self._tick = 0

    # --- lookups -----------------------------------------------------------------------

    def slot(self, request_id: str, label: str) -> int:
        """The stream's slot; 0 when there is none."""
        return self.requests.get(request_id, _NO_LABELS).get(label, 0)

    def resolve(self, keys: list[tuple[str, str]]) -> np.ndarray:
        """The streams' slots, int64; 0 for a stream not made yet."""
        get = self.requests.get
        return np.fromiter(
            (get(r, _NO_LABELS).get(label, 0) for r, label in keys), np.int64, len(keys)
        )

    def labels(self, request_id: str) -> dict[str, int]:
        """The request's streams, label -> slot (read only; empty if unknown)."""
        return self.requests.get(request_id, _NO_LABELS)

    def live(self) -> list[int]:
        """Every stream's slot."""
        return [slot for labels in self.requests.values() for slot in labels.values()]

    # --- streams made and freed ------------------------------------------------------------

    def make(
        self, request_id: str, label: str, table: np.ndarray, stored: int, base: int = 0
    ) -> int:
        """A new stream on ``table`` (pages it owns) holding ``stored`` tokens
        after ``base`` released ones."""
        slot = self._claim(1)[0]
        self.tables[slot] = table
        self.npages[slot] = len(table)
        self.stored[slot] = stored
        self.base[slot] = base
        self.touch(slot)
        self.map(request_id, label, slot)
        if self.prefix is not None:
            self.prefix.start(slot)
        return slot

    def make_empty(self, keys: list[tuple[str, str]], rooms: list[int]) -> list[int]:
        """New streams for ``keys`` (distinct, unknown), empty, each table
        with room for ``rooms[i]`` pages; their slots."""
        slots = self._claim(len(keys))
        tables = self.tables
        for slot, room in zip(slots, rooms):
            tables[slot] = np.empty(max(room, 16), np.int32)
        self.touch(np.array(slots))  # a free slot's pages, lengths and base are 0
        for (request_id, label), slot in zip(keys, slots):
            self.map(request_id, label, slot)
        if self.prefix is not None:
            for slot in slots:
                self.prefix.start(slot)
        return slots

    def _claim(self, n: int) -> list[int]:
        """``n`` free slots, each now a new stream (a new epoch)."""
        while len(self._free) < n:
            self._grow()
        slots = self._free[-n:][::-1]
        del self._free[-n:]
        self.made += n
        self.epoch[slots] = np.arange(self._tick + 1, self._tick + 1 + n)
        self._tick += n
        return slots

    def map(self, request_id: str, label: str, slot: int) -> None:
        self.requests.setdefault(request_id, {})[label] = slot

    def unmap(self, request_id: str, label: str) -> int:
        """Forget the stream's name; its slot and pages stay until freed."""
        labels = self.requests[request_id]
        slot = labels.pop(label)
        if not labels:
            del self.requests[request_id]
        return slot

    def free(self, slot: int, keep: np.ndarray | None = None) -> None:
        """Free the slot and release its pages, but those in ``keep`` (pages
        an undone step took from its reservation go back to it); with a
        prefix cache and no ``keep``, a partial last page it recorded stays
        cached (``PrefixChains.leave_tail``)."""
        if self.prefix is not None:
            self.prefix.settle(slot)  # its full pages are registered before they go
            if keep is None:
                self.prefix.leave_tail(slot, int(self.stored[slot]))
        pages = self.tables[slot][: self.npages[slot]]
        self.pool.release(pages if keep is None else pages[~np.isin(pages, keep)])
        self.tables[slot] = None
        self.npages[slot] = self.stored[slot] = self.base[slot] = 0
        self.epoch[slot] = -1
        self.made += 1
        self._free.append(slot)

    # --- streams growing ---------------------------------------------------------------------

    def extend(self, slots: np.ndarray, grow: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Stream ``slots[i]`` takes the next ``grow[i]`` of ``pages`` (in row
        order; every ``grow[i] > 0``). Returns their page counts before."""
        had, tables, at, page = self.npages[slots], self.tables, 0, pages.tolist()
        for slot, n, k in zip(slots.tolist(), had.tolist(), grow.tolist()):
            table = tables[slot]
            if n + k > len(table):
                table = self._with_room(slot, n + k)
            if k == 1:  # a decode row's page: a scalar store is cheaper than a slice
                table[n] = page[at]
            else:
                table[n : n + k] = pages[at : at + k]
            at += k
        self.npages[slots] = had + grow
        self.touch(slots)
        return had

    def advance(self, slots: np.ndarray, ends: Any) -> None:
        """Streams ``slots`` (distinct) now hold ``ends`` tokens each."""
        self.stored[slots] = ends
        self.touch(slots)

    def shorten(self, slots: np.ndarray, stored: np.ndarray) -> bool:
        """Streams ``slots`` (distinct) now hold ``stored`` tokens each, no
        more than they held: the pages wholly past go back to the pool (a
        shared one only loses this owner), a partially kept last page stays.
        Whether any page went."""
        self.stored[slots] = stored
        keep = -(-np.asarray(stored, np.int64) // self.page_size)
        over = (self.npages[slots] > keep).nonzero()[0]
        for slot, k in zip(slots[over].tolist(), keep[over].tolist()):
            self.pool.release(self.tables[slot][k : self.npages[slot]].copy())
            self.npages[slot] = k
        self.touch(slots)
        return bool(len(over))

    def drop(self, slot: int, n: int, page_size: int) -> None:
        """Release the stream's first ``n`` pages (full, behind its window):
        its table, pages and length then count from the next one."""
        table, held = self.tables[slot], int(self.npages[slot])
        assert 0 < n * page_size <= self.stored[slot], "drop only full, stored pages"
        self.pool.release(table[:n].copy())
        table[: held - n] = table[n:held]
        self.npages[slot] = held - n
        self.stored[slot] -= n * page_size
        self.base[slot] += n * page_size
        self.touch(slot)

    def release_behind(self, slots: np.ndarray, window: int) -> bool:
        """Release the full pages of the streams ``slots`` that no later
        query's ``window`` reaches; whether any went."""
        ps = self.page_size
        behind = self.stored[slots] - (window - 1)
        behind //= ps
        dropping = (behind > 0).nonzero()[0]
        for slot, n in zip(slots[dropping].tolist(), behind[dropping].tolist()):
            self.drop(slot, n, ps)
        return bool(len(dropping))

    def touch(self, slots: int | np.ndarray) -> None:
        """A new generation for streams whose pages or length changed."""
        n = 1 if isinstance(slots, int) else len(slots)
        self.gen[slots] = np.arange(self._tick + 1, self._tick + 1 + n) if n > 1 else self._tick + 1
        self._tick += n

    def check(self, live: list[int], page_size: int, refcount: np.ndarray) -> None:
        """Raise ``AssertionError`` naming the first broken rule of ``live`` slots."""
        for slot in live:
            full = self.stored[slot] // page_size
            if self.npages[slot] < -(-int(self.stored[slot]) // page_size):
                raise AssertionError("broken rule: a stream holds the pages of its length")
            if (refcount[self.tables[slot][full : self.npages[slot]]] != 1).any():
                raise AssertionError("broken rule: no stream's still-writable page is shared")
        if self.stored[0] or self.npages[0] or self.base[0] or 0 in self._free:
            raise AssertionError("broken rule: slot 0 is the empty stream")

    def _with_room(self, slot: int, size: int) -> np.ndarray:
        """The slot's page table, grown (geometrically) to hold ``size`` pages."""
        table = self.tables[slot]
        grown = np.empty(max(2 * len(table), size, 16), dtype=np.int32)
        grown[: len(table)] = table
        self.tables[slot] = grown
        return grown

    def _grow(self) -> None:
        old = len(self.tables)
        new = max(2 * old, 64)
        self.tables.extend([None] * (new - old))
        for name in ("stored", "npages", "base", "gen", "epoch"):
            arr = np.zeros(new, dtype=np.int64)
            arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        if self.prefix is not None:
            self.prefix.grow(new)
        self._free.extend(range(new - 1, old - 1, -1))
