"""The prefix cache's key table: key -> registered page (see ``KeyTable``)."""

from __future__ import annotations

import numpy as np

WIDTH_BITS = 3  # buckets hold 8 keys


def distinct(a: np.ndarray) -> bool:
    """Whether ``a``'s values are distinct (one sort; cheaper than ``np.unique``)."""
    s = np.sort(a)
    return bool((s[1:] != s[:-1]).all())


class KeyTable:
    """Key -> page of the registered pages: a bucketed hash table in numpy,
    so finding a whole prompt's keys is a few array operations.

    A key goes to bucket ``key >> shift`` (its high bits, the best mixed of a
    polynomial hash) or, when that bucket is full, the next one with room;
    the full buckets it passed are marked spilled, and a key missing from a
    spilled bucket is looked for in the next. With at most two keys a bucket
    on average, spills are rare. An empty slot holds a key of another bucket,
    so no query matches it.
    """

    WIDTH = 1 << WIDTH_BITS

    def __init__(self, num_pages: int) -> None:
        nb = 1 << max(num_pages // 2, 1).bit_length()  # buckets: a power of 2
        self._mask = nb - 1
        self._shift = np.uint64(64 - (nb.bit_length() - 1))
        self._pages = np.full((nb, self.WIDTH), -1, dtype=np.int32)
        self._keys = np.repeat(self._empty(np.arange(nb))[:, None], self.WIDTH, axis=1)
        self._spilled = np.zeros(nb, dtype=bool)
        self._nspilled = 0
        self._slot = np.full(num_pages, -1, dtype=np.intp)  # page -> flat slot
        self.size = 0

    def _empty(self, buckets: np.ndarray) -> np.ndarray:
        """Each bucket's empty-slot key: one that lives in the next bucket."""
        return ((buckets + 1) & self._mask).astype(np.uint64) << self._shift

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Each key's page (int32), -1 where absent."""
        b = (keys >> self._shift).view(np.int64)  # < 2**63: the view is the value
        got = np.full(len(keys), -1, dtype=np.int32)
        rows = None  # all of them
        while True:  # one more pass per spilled bucket a missing key's search crosses
            k = keys[:, None] if rows is None else keys[rows, None]
            hit = np.flatnonzero(self._keys.take(b, axis=0) == k)
            found = hit >> WIDTH_BITS  # the hits' pages alone: a miss reads no page row
            got[found if rows is None else rows[found]] = self._pages.flat[
                (b[found] << WIDTH_BITS) | (hit & (self.WIDTH - 1))
            ]
            if not self._nspilled:
                return got
            rows = np.arange(len(keys)) if rows is None else rows
            more = (got[rows] < 0) & self._spilled[b]
            if not more.any():
                return got
            rows, b = rows[more], (b[more] + 1) & self._mask

    def insert(self, keys: np.ndarray, pages: np.ndarray) -> None:
        """Add ``keys`` (absent) for ``pages`` (not in the table): each in its
        bucket's first free slot, at once; a key whose bucket is full, or
        whose slot an earlier key of the batch takes, then one at a time."""
        b = (keys >> self._shift).astype(np.intp)
        empty = self._empty(b)  # the rows read are the keys' (warm after a ``find``)
        flat = b * self.WIDTH + (self._keys.take(b, axis=0) == empty[:, None]).argmax(axis=1)
        fits = self._keys.flat[flat] == empty
        if fits.all() and distinct(flat):  # the common case: a few array operations
            self._set(flat, keys, pages)
        else:
            _, first = np.unique(flat, return_index=True)
            first = first[fits[first]]
            self._set(flat[first], keys[first], pages[first])
            rest = np.ones(len(b), dtype=bool)
            rest[first] = False
            for i in np.flatnonzero(rest).tolist():
                self._put(int(b[i]), keys[i], pages[i])
        self.size += len(keys)

    def _put(self, bucket: int, key: np.uint64, page: int) -> None:
        """One key, in its bucket or the next with room (marking full ones spilled)."""
        while (room := np.flatnonzero(self._pages[bucket] < 0)).size == 0:
            self._nspilled += not self._spilled[bucket]
            self._spilled[bucket] = True
            bucket = (bucket + 1) & self._mask
        self._set(bucket * self.WIDTH + room[0], key, page)

    def _set(self, flat, keys, pages) -> None:
        self._pages.flat[flat] = pages
        self._keys.flat[flat] = keys
        self._slot[pages] = flat

    def remove(self, pages: np.ndarray) -> None:
        """Drop ``pages``' keys."""
        flat = self._slot[pages]
        self._pages.flat[flat] = -1
        self._keys.flat[flat] = self._empty(flat // self.WIDTH)
        self._slot[pages] = -1
        self.size -= len(pages)

    def check(self, pages: np.ndarray, keys: np.ndarray) -> None:
        """Raise ``AssertionError`` unless the table maps exactly ``keys`` to ``pages``."""
        if self.size != len(pages) or np.count_nonzero(self._pages >= 0) != len(pages):
            raise AssertionError("broken rule: one key per registered page")
        if not np.array_equal(self.find(keys), pages):
            raise AssertionError("broken rule: each registered page's key finds it")
        flat = self._slot[pages]
        if not np.array_equal(self._pages.flat[flat], pages):
            raise AssertionError("broken rule: each registered page's slot holds it")
