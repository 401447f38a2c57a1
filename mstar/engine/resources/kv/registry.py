"""The prefix registry: full pages registered by content, and verified lookups.

A full, committed page can be registered under its chain key (``keys``).
Each registered page keeps its tokens, its parent page (the registered page
holding the chain before it; -1 for a first page) and, for a first page, its
namespace, and ``lookup`` checks a matched run against the query — every
page's tokens and every parent link, in a few vectorized operations — and
stops at the first page that fails. A key collision therefore costs a cache
miss (an adversary can deny itself or others hits by registering colliding
chains first), never wrong KV.

Parent links must stay true: a page's KV was computed after its parent's
tokens, so if a parent page were evicted and reused for other content while a
child stayed registered, a later chain through the new content would verify
the old child. With a stream releasing all its pages in one call, a child is
evicted before its parent (every owner of a child also owns its parent), but
a page registered after a duplicate hangs off another stream's page that its
own stream does not own (see ``register``), which can be evicted first. So
unregistering a page unregisters its registered descendants with it: parent
links always name live, registered pages (``check`` asserts it).

Each page and namespace remembers the page last registered after it
(``child``), so a prompt that ends inside a cached page can be served from
it (``PrefixChains.match``); a stale memory is caught by the parent links.

Which pages are owned, free or cached is the pool's business, not this one's.
``listener`` (None: no cost) hears every page registered and unregistered,
on the thread that changes the registry (``RegistryListener``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from mstar.engine.resources.kv.keys import PageKeys
from mstar.engine.resources.kv.keytable import KeyTable, distinct

_NO_PAGES = np.zeros(0, dtype=np.int32)


class RegistryListener(Protocol):
    def stored(
        self, keys: np.ndarray, parent_keys: np.ndarray, has_parent: np.ndarray, tokens: np.ndarray
    ) -> None:
        """Pages registered: keys (uint64 ``[n]``), each one's parent key
        (valid where ``has_parent``), their tokens (int64 ``[n, page_size]``)."""

    def removed(self, keys: np.ndarray) -> None:
        """Pages unregistered: their keys (uint64)."""


class PrefixRegistry:
    """Per page: registered or not, its key, tokens, parent and namespace;
    and, for a duplicate (equal content computed before the first was
    registered), its registered twin."""

    def __init__(self, num_pages: int, page_size: int | None) -> None:
        self.table = KeyTable(num_pages)
        # per page (zeros are mapped lazily: an unused cache costs no memory)
        self.tokens = np.zeros((num_pages, page_size or 0), dtype=np.int64)
        self.used = False  # anything ever registered
        self.key = np.zeros(num_pages, dtype=np.uint64)
        self.registered = np.zeros(num_pages, dtype=bool)
        self.parent = np.full(num_pages, -1, dtype=np.int32)
        self._children = np.zeros(num_pages, dtype=np.int32)  # registered pages naming it
        self._namespace: dict[int, str] = {}  # first pages' namespaces
        self._gen = np.zeros(num_pages, dtype=np.int64)  # bumped when unregistered
        self._twin = np.full(num_pages, -1, dtype=np.int32)  # a duplicate's registered twin
        self._twin_gen = np.zeros(num_pages, dtype=np.int64)
        self._child = np.full(num_pages, -1, dtype=np.int32)  # the page last linked after it
        self._root: dict[str, int] = {}  # namespace -> the first page last linked in it
        self.listener: RegistryListener | None = None

    @property
    def size(self) -> int:
        """Pages registered now."""
        return self.table.size

    def namespace_of(self, page: int) -> str | None:
        """A registered first page's namespace (None for any other page)."""
        return self._namespace.get(page)

    def child(self, anchor: int | str) -> int:
        """The registered page last registered after page ``anchor`` (a
        namespace: first in it) and still after it; -1 when there is none."""
        if isinstance(anchor, str):
            page = self._root.get(anchor, -1)
            if page >= 0 and self.registered[page] and self._namespace.get(page) == anchor:
                return page
            return -1
        page = int(self._child[anchor])
        return page if page >= 0 and self.registered[page] and self.parent[page] == anchor else -1

    def reused(self, pages: np.ndarray) -> None:
        """``pages`` were allocated anew: a twin named by their last life is gone."""
        if self.used:
            self._twin[pages] = -1

    def register(self, pages: np.ndarray, keys: PageKeys, parent: int = -1) -> None:
        """Register owned full ``pages`` (int32, consecutive pages of one
        stream) under ``keys``; ``parent`` is the stream's page before
        ``pages[0]`` (-1: ``pages[0]`` is its first).

        A page already registered under its key is skipped. A page whose key
        is already another page's stays unregistered: if that page holds the
        same tokens after the same parent (a duplicate computed before the
        first was registered), the later pages hang off it; otherwise (a
        collision) they stay unregistered too. A parent that is neither
        registered nor a live duplicate leaves all of ``pages`` unregistered.
        """
        self.used = True
        prev = self.holder(parent)
        if prev is None or not len(pages):
            return
        twins = self.table.find(keys.hashes)
        fresh = (twins < 0).all() and distinct(keys.hashes)
        if fresh and not self.registered[pages].any():
            self._link(pages, keys, np.concatenate(([prev], pages[:-1])).astype(np.int32))
            return
        for i, page in enumerate(pages.tolist()):
            if self.registered[page]:
                assert self.key[page] == keys.hashes[i], "a page registered under two keys"
                prev = page
                continue
            twin = int(self.table.find(keys.hashes[i : i + 1])[0])  # earlier pages may be it
            if twin < 0:
                one = PageKeys(keys.hashes[i : i + 1], keys.tokens[i : i + 1], keys.namespace)
                self._link(pages[i : i + 1], one, [prev])
                prev = page
            elif self._holds(twin, keys.tokens[i], prev, keys.namespace):
                self._twin[page], self._twin_gen[page] = twin, self._gen[twin]
                prev = twin
            else:
                return  # a collision: this chain has no place in the cache

    def register_next(self, pages: np.ndarray, keys: PageKeys, parents: np.ndarray) -> None:
        """Register one next page for each of several chains: ``pages[i]``
        after page ``parents[i]`` (>= 0) under ``keys`` row ``i``. The same as
        ``register`` of each page alone, in a few array operations when none
        meets a duplicate."""
        self.used = True
        if (
            self.registered[parents].all()
            and not self.registered[pages].any()
            and np.maximum.reduce(self.table.find(keys.hashes)) < 0
            and distinct(keys.hashes)
        ):
            self._link(pages, keys, parents)
            return
        for i in range(len(pages)):
            one = PageKeys(keys.hashes[i : i + 1], keys.tokens[i : i + 1], "")
            self.register(pages[i : i + 1], one, int(parents[i]))

    def lookup(self, keys: PageKeys, parent: int = -1) -> np.ndarray:
        """The pages (int32) of the longest run of leading ``keys`` that are
        registered and verified: each page's tokens equal ``keys.tokens``'
        row, its parent is the page before it (``parent`` for the first: -1
        for a chain from position 0, whose first page must be in
        ``keys.namespace``)."""
        pages = self.table.find(keys.hashes)
        if len(pages) == 0 or pages[0] < 0:
            return _NO_PAGES
        first = int(np.argmin(pages))  # the first miss, if any
        if pages[first] < 0:
            pages = pages[:first]
        if parent == -1 and self._namespace.get(int(pages[0])) != keys.namespace:
            return _NO_PAGES
        held = self.tokens.take(pages, axis=0)
        links = self.parent.take(pages)
        asked = keys.tokens[: len(pages)]
        if (
            links[0] == parent
            and links[1:].tobytes() == pages[:-1].tobytes()
            and held.tobytes() == asked.astype(np.int64, copy=False).tobytes()
        ):
            return pages  # the common case: two gathers and two memcmps
        ok = (held == asked).all(axis=1)
        ok[0] &= links[0] == parent
        ok[1:] &= links[1:] == pages[:-1]
        return pages[: int(np.argmin(ok))]

    def unregister(self, pages: np.ndarray) -> np.ndarray:
        """Unregister ``pages`` and their registered descendants; returns the
        descendants (int32)."""
        cut = []
        while len(pages):
            self.table.remove(pages)
            for page in pages[self.parent[pages] < 0].tolist():
                self._namespace.pop(page, None)  # a first page's, or a cut orphan's none
            self.registered[pages] = False
            if self.listener is not None:
                self.listener.removed(self.key[pages])
            self._gen[pages] += 1
            parents = self.parent[pages]
            np.subtract.at(self._children, parents[parents >= 0], 1)
            if not self._children[pages].any():
                break
            self._children[pages] = 0
            orphans = np.flatnonzero(self.registered & np.isin(self.parent, pages))
            orphans = orphans.astype(np.int32)
            self.parent[orphans] = -1  # cut before the loop's own decrement
            cut.append(orphans)
            pages = orphans
        return np.concatenate(cut) if cut else _NO_PAGES

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken rule."""
        reg = np.flatnonzero(self.registered).astype(np.int32)
        self.table.check(reg, self.key[reg])
        parents = self.parent[reg]
        if not self.registered[parents[parents >= 0]].all():
            raise AssertionError("broken rule: a registered page's parent is registered")
        children = np.bincount(parents[parents >= 0], minlength=len(self.registered))
        if not np.array_equal(children, self._children):
            raise AssertionError("broken rule: child counts match the parent links")
        roots = set(reg[parents < 0].tolist())
        if set(self._namespace) != roots:
            raise AssertionError("broken rule: first pages, and only they, have a namespace")

    def _link(self, pages: np.ndarray, keys: PageKeys, parents) -> None:
        """Register ``pages`` (not yet registered, keys unused) after ``parents``."""
        parents = np.asarray(parents, dtype=np.int32)
        self.tokens[pages] = keys.tokens
        self.key[pages] = keys.hashes
        self.registered[pages] = True
        self.parent[pages] = parents
        linked = parents[parents >= 0]
        if distinct(linked):  # a fancy add counts a repeated parent once
            self._children[linked] += 1
        else:  # forks' chains: several pages after one parent
            np.add.at(self._children, linked, 1)
        self._child[linked] = pages[parents >= 0]
        if parents[0] < 0:
            self._namespace[int(pages[0])] = keys.namespace
            self._root[keys.namespace] = int(pages[0])
        self.table.insert(keys.hashes, pages)
        if self.listener is not None:
            self.listener.stored(keys.hashes, self.key[parents], parents >= 0, keys.tokens)

    def holder(self, page: int) -> int | None:
        """The registered page holding ``page``'s chain (-1 for none before
        a first page), or None when there is none."""
        if page < 0 or self.registered[page]:
            return page
        twin = int(self._twin[page])
        if twin >= 0 and self.registered[twin] and self._gen[twin] == self._twin_gen[page]:
            return twin
        return None

    def _holds(self, page: int, tokens: np.ndarray, parent: int, namespace: str) -> bool:
        """Whether registered ``page`` holds ``tokens`` after ``parent``."""
        if self.parent[page] != parent or not np.array_equal(self.tokens[page], tokens):
            return False
        return parent >= 0 or self._namespace[page] == namespace
