"""Chain keys: what a full page's content is looked up by in the prefix cache.

A page's key hashes its stream's whole token chain, from position 0 to the
page's end, plus a namespace: a 64-bit polynomial hash (Horner over the
tokens, mod 2**64), a handful of numpy operations whatever the length. Such a
hash is cheap but breakable (Thue-Morse strings of 2048 tokens, or two tokens
chosen to cancel, collide for any odd base), so a key only *finds* a page:
the registry verifies every match against the page's tokens and parent.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

_BASE = 0x9E3779B97F4A7C15  # odd, so its powers are invertible mod 2**64
_NO_KEYS = np.zeros(0, dtype=np.uint64)

Key = int  # a page key: an int in [0, 2**64)


class PageKeys(NamedTuple):
    """Keys of consecutive full pages of one stream, with what verifies them.

    ``hashes[i]`` keys page ``i``; ``tokens`` is int64
    ``[len(hashes), page_size]``, page ``i``'s tokens; ``namespace`` is the
    chain's (it only matters for a chain's first page).
    """

    hashes: np.ndarray  # uint64 [n]
    tokens: np.ndarray  # int64 [n, page_size]
    namespace: str

    @property
    def last(self) -> Key | None:
        """The key to pass as ``parent`` for the pages after these."""
        return int(self.hashes[-1]) if len(self.hashes) else None


def _seed(namespace: str) -> int:
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


class ChainHasher:
    """Keys of full pages of ``page_size`` tokens, with the powers of the
    base they take (grown as longer chains come)."""

    def __init__(self, page_size: int | None) -> None:
        self.page_size = page_size
        self._weights = self._up = self._down = _NO_KEYS  # powers of B
        self._seeded = ("", _seed(""))  # the last namespace and its seed

    def page_keys(
        self, tokens: np.ndarray | list[int], parent: Key | None = None, namespace: str = ""
    ) -> PageKeys:
        """The keys of the full pages of ``tokens`` (a partial tail is ignored).

        ``tokens`` (a 1-D integer array or a list of ints) continue the chain
        whose last full page has key ``parent`` (``None``: they start at
        position 0, and ``namespace`` seeds the chain; with a parent, the
        namespace is the parent's and ``namespace`` is only recorded). Key
        ``i`` hashes every token from position 0 to the end of page ``i``:
        ``h_i = h_(i-1) * B**page_size + sum_j tokens[i, j] * B**(page_size-1-j)``
        mod 2**64, ``h_-1`` the parent key or the namespace's seed. The
        returned ``tokens`` is a view of ``tokens`` when that is int64.
        """
        ps = self.page_size
        if ps is None:
            raise ValueError("expected a PagePool made with a page_size for the prefix cache")
        t = np.asarray(tokens)
        if t.ndim != 1 or (t.dtype.kind not in "iu" and t.size):
            raise ValueError(f"expected a 1-D array of integer token ids, got {t.dtype} {t.shape}")
        n = t.size // ps
        pages = np.ascontiguousarray(t[: n * ps], dtype=np.int64).reshape(n, ps)
        if n == 0:
            return PageKeys(_NO_KEYS, pages, namespace)
        if n > len(self._up):
            self._grow_powers(n)
        # h_i = B**(ps*(i+1)) * (h_-1 + sum_(m<=i) local_m / B**(ps*(m+1))): one cumsum
        h = pages.view(np.uint64) @ self._weights  # each page's own hash
        h *= self._down[:n]
        np.add.accumulate(h, out=h)
        if parent is None and namespace != self._seeded[0]:
            self._seeded = namespace, _seed(namespace)  # the last namespace's, kept
        h += np.uint64(self._seeded[1] if parent is None else parent)
        h *= self._up[:n]
        return PageKeys(h, pages, namespace)

    def next_keys(self, tokens: np.ndarray, parent_keys: np.ndarray) -> np.ndarray:
        """The keys (uint64 ``[n]``) of one next page for each of ``n``
        chains: page ``i`` holds ``tokens[i]`` (int64 ``[page_size]``) after
        the page keyed ``parent_keys[i]``."""
        if not len(self._up):
            self._grow_powers(1)
        hashes = np.ascontiguousarray(tokens, dtype=np.int64).view(np.uint64) @ self._weights
        hashes += parent_keys * self._up[0]  # h = parent * B**page_size + the page's own
        return hashes

    def _grow_powers(self, n: int) -> None:
        """Powers of B for keys of up to ``2 * n`` pages."""
        ps, base = self.page_size, np.uint64(_BASE)
        self._weights = np.ones(ps, dtype=np.uint64)  # B**(ps-1-j)
        self._weights[:-1] = np.multiply.accumulate(np.full(ps - 1, base))[::-1]
        step = pow(_BASE, ps, 1 << 64)
        self._up = np.multiply.accumulate(np.full(2 * n, np.uint64(step)))
        self._down = np.multiply.accumulate(np.full(2 * n, np.uint64(pow(step, -1, 1 << 64))))
