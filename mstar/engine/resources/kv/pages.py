"""The page pool: a fixed number of KV pages, each free or owned.

A page's owners are the streams naming it (a fork adds one) and, between
``admit`` and the moment a step hands it out, that step's reservation. A page
goes back to the free stack when its last owner lets go.
"""

from __future__ import annotations

import numpy as np

_NO_PAGES = np.zeros(0, dtype=np.int32)


class PagePool:
    """Pages ``0 .. num_pages - 1``: a free stack plus an owner count per page."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, dtype=np.int32)  # owners per page
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)  # top at the end
        self.num_free = num_pages

    def free_pages(self) -> np.ndarray:
        """The free pages (a view: read, don't keep)."""
        return self._stack[: self.num_free]

    def alloc(self, n: int) -> np.ndarray:
        """``n`` free pages, each now with one owner (the caller checks
        ``n <= num_free``)."""
        if n == 0:
            return _NO_PAGES
        assert n <= self.num_free, "alloc beyond the free pages"
        pages = self._stack[self.num_free - n : self.num_free].copy()
        self.num_free -= n
        self.refcount[pages] = 1
        return pages

    def share(self, pages: np.ndarray) -> None:
        """One more owner for each of ``pages`` (distinct)."""
        self.refcount[pages] += 1

    def release(self, pages: np.ndarray) -> None:
        """One owner fewer for each of ``pages`` (distinct); pages left with
        none go back on the free stack."""
        self.refcount[pages] -= 1
        dead = pages[self.refcount[pages] == 0]
        self._stack[self.num_free : self.num_free + len(dead)] = dead
        self.num_free += len(dead)

    def shared(self) -> int:
        """Page references saved by sharing: sum over pages of owners - 1."""
        return int(np.maximum(self.refcount - 1, 0).sum())
