"""The eviction queue: the prefix cache's cached-unowned pages, oldest first.

A registered page whose last owner lets go is queued; ``pop`` hands out the
least recently queued. A page leaves the queue early when it is owned again
(or unregistered): ``drop`` clears its stamp, and an entry is live only while
its page's stamp still equals the entry's, so a dropped entry is skipped
rather than searched for. Dead entries are compacted away when the ring of
``2 * num_pages`` entries fills (live ones are at most ``num_pages``).
"""

from __future__ import annotations

import numpy as np


class EvictionQueue:
    """Pages in eviction order, each queued at most once."""

    def __init__(self, num_pages: int) -> None:
        self._stamp = np.full(num_pages, -1, dtype=np.int64)  # per page: its live entry's
        self._pages = np.zeros(2 * num_pages, dtype=np.int32)
        self._stamps = np.zeros(2 * num_pages, dtype=np.int64)
        self._head = self._tail = 0
        self._clock = 0

    def push(self, pages: np.ndarray) -> None:
        """Queue ``pages`` (none queued), to leave in order after every page
        queued before."""
        n = len(pages)
        if self._tail + n > len(self._pages):
            self._compact()
        stamps = np.arange(self._clock, self._clock + n, dtype=np.int64)
        self._clock += n
        self._stamp[pages] = stamps
        self._pages[self._tail : self._tail + n] = pages
        self._stamps[self._tail : self._tail + n] = stamps
        self._tail += n

    def drop(self, pages: np.ndarray) -> None:
        """Take queued ``pages`` out of the queue."""
        self._stamp[pages] = -1

    def pop(self, n: int) -> np.ndarray:
        """The ``n`` least recently queued pages (at least ``n`` are queued),
        out of the queue."""
        out = []
        while n:
            end = min(self._tail, self._head + 2 * n + 16)
            assert end > self._head, "eviction beyond the cached pages"
            pages = self._pages[self._head : end]
            live = np.flatnonzero(self._stamp[pages] == self._stamps[self._head : end])[:n]
            out.append(pages[live])
            n -= len(live)
            self._head = self._head + int(live[-1]) + 1 if n == 0 else end
        pages = np.concatenate(out) if len(out) > 1 else out[0]
        self._stamp[pages] = -1
        return pages

    def queued(self) -> np.ndarray:
        """Every queued page, in order (its live entries)."""
        pages = self._pages[self._head : self._tail]
        return pages[self._stamp[pages] == self._stamps[self._head : self._tail]]

    def _compact(self) -> None:
        """Drop dead entries."""
        pages = self.queued()
        self._pages[: len(pages)] = pages
        self._stamps[: len(pages)] = self._stamp[pages]
        self._head, self._tail = 0, len(pages)
