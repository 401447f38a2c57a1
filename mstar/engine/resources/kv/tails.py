"""Cached tails: freed streams' partially filled last pages, kept for reuse.

A stream that recorded its chain and is freed holding ``t`` tokens on its
last page (``0 < t < page_size``) leaves that page as a *tail*: cached under
its *anchor*, the registered page holding its chain's last full page (the
namespace, a str, for a stream without one), with its ``t`` tokens. A tail is
never owned by a stream: ``match_prefix`` copies its KV into a page of the
new stream's own, so a cached tail is never written. The pool treats tails
as it treats registered pages nobody owns (free, evicted when pages are
needed); an evicted tail is forgotten, and so are the tails of an anchor
that is unregistered (its page may then hold other content). Tails live in
memory only: the registry never holds them, so no tier stores them and no
KV event reports them.

Under one anchor a tail whose tokens begin another's adds nothing and is
dropped, and at most ``PER_ANCHOR`` are kept (the oldest goes first).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

PER_ANCHOR = 4  # tails kept under one anchor

Anchor = int | str  # a registered page, or a namespace for tails without a full page


class TailCache:
    """Per anchor, its tails' pages and tokens; per page, whether it is a tail."""

    def __init__(self, num_pages: int) -> None:
        self.is_tail = np.zeros(num_pages, dtype=bool)
        self._anchored = np.zeros(num_pages, dtype=bool)  # per page: tails hang off it
        self._under: dict[Anchor, list[tuple[int, np.ndarray]]] = {}
        self._anchor: dict[int, Anchor] = {}  # tail page -> its anchor

    @property
    def size(self) -> int:
        """Tails cached now."""
        return len(self._anchor)

    def under(self, anchor: Anchor) -> list[tuple[int, np.ndarray]]:
        """The tails under ``anchor``: (page, tokens) pairs (read, don't keep)."""
        return self._under.get(anchor, [])

    def entries(self) -> Iterator[tuple[Anchor, int, np.ndarray]]:
        """Every tail: its anchor, page and tokens."""
        for anchor, held in self._under.items():
            for page, tokens in held:
                yield anchor, page, tokens

    def add(self, page: int, anchor: Anchor, tokens: np.ndarray) -> list[int]:
        """Make ``page`` (no tail) a tail holding ``tokens`` (int64, copied by
        the caller) under ``anchor``, unless a tail there already begins with
        them. Returns the tails it replaces (those whose tokens begin
        ``tokens``, and the oldest past ``PER_ANCHOR``): no longer tails."""
        held = self._under.get(anchor, [])
        n = len(tokens)
        if any(len(t) >= n and np.array_equal(t[:n], tokens) for _, t in held):
            return []
        covered = [len(t) <= n and np.array_equal(tokens[: len(t)], t) for _, t in held]
        kept = [h for h, c in zip(held, covered) if not c]
        gone = [p for (p, _), c in zip(held, covered) if c]
        while len(kept) >= PER_ANCHOR:
            gone.append(kept.pop(0)[0])
        self._under[anchor] = [*kept, (page, tokens)]
        self._anchor[page] = anchor
        self.is_tail[page] = True
        if not isinstance(anchor, str):
            self._anchored[anchor] = True
        self._forget_pages(gone)
        return gone

    def forget(self, pages: np.ndarray) -> None:
        """Tail ``pages`` leave the cache (evicted)."""
        for page in pages.tolist():
            anchor = self._anchor[page]
            left = [(p, t) for p, t in self._under[anchor] if p != page]
            self._set(anchor, left)
        self._forget_pages(pages.tolist())

    def orphans(self, pages: np.ndarray) -> np.ndarray:
        """Forget the tails under ``pages`` (just unregistered) and return
        their pages (int32)."""
        hit = pages[self._anchored[pages]]
        if not len(hit):
            return np.zeros(0, dtype=np.int32)
        self._anchored[hit] = False
        gone = [p for anchor in hit.tolist() for p, _ in self._under.pop(anchor)]
        self._forget_pages(gone)
        return np.array(gone, dtype=np.int32)

    def check(self, registered: np.ndarray) -> None:
        """Raise ``AssertionError`` naming the first broken rule."""
        listed = [page for _, page, _ in self.entries()]
        if sorted(listed) != sorted(self._anchor) or len(set(listed)) != len(listed):
            raise AssertionError("broken rule: each tail is listed once, under its anchor")
        if sorted(listed) != np.flatnonzero(self.is_tail).tolist():
            raise AssertionError("broken rule: the tail pages are the listed ones")
        pages = [a for a, held in self._under.items() if not isinstance(a, str) and held]
        if not registered[pages].all() or sorted(pages) != np.flatnonzero(self._anchored).tolist():
            raise AssertionError("broken rule: a tail's anchor page is registered")
        if (self.is_tail & registered).any():
            raise AssertionError("broken rule: a tail is not registered")

    def _set(self, anchor: Anchor, held: list[tuple[int, np.ndarray]]) -> None:
        if held:
            self._under[anchor] = held
            return
        del self._under[anchor]
        if not isinstance(anchor, str):
            self._anchored[anchor] = False

    def _forget_pages(self, pages: list[int]) -> None:
        for page in pages:
            del self._anchor[page]
        self.is_tail[pages] = False


def best_tail(found: list[tuple[int, np.ndarray]], rest: np.ndarray) -> tuple[int, int]:
    """Of ``found`` (page, tokens) pairs, the page whose tokens share the
    longest common prefix with ``rest`` and its length ``c``, capped so that
    one token of ``rest`` is left; ``(-1, 0)`` when none shares any."""
    best, c = -1, 0
    cap = len(rest) - 1
    if cap <= 0:
        return best, c
    for page, tokens in found:
        m = min(len(tokens), cap)
        diff = np.flatnonzero(tokens[:m] != rest[:m])
        k = int(diff[0]) if len(diff) else m
        if k > c:
            best, c = page, k
    return best, c
