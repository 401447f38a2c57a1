"""The page pool: a fixed number of KV pages, each free, owned or cached.

A page's owners are the streams naming it (a fork adds one) and, between
``admit`` and the moment a step hands it out, that step's reservation. A page
nobody caches goes back to the free stack when its last owner lets go.

Prefix cache. A full, committed page can be *registered* under its chain key
(``page_keys``; ``PrefixRegistry`` holds and verifies them). A registered
page whose last owner lets go stays *cached-unowned*: allocatable
(``num_free`` counts it) but kept, with its key, until its memory is needed.
``alloc`` takes the free stack first, then evicts cached-unowned pages least
recently released first (``EvictionQueue``); pages released by one
``release`` call go later-in-the-array first, so a stream's later pages
leave before its earlier ones. ``share`` on a cached-unowned page owns it
again. So every page is exactly one of: free, owned (registered or not),
cached-unowned. This class is the allocator: the owner counts and the
free/cached counters change here and nowhere else.

Tails (``TailCache``): a freed stream's partially filled last page may stay
cached too, unregistered, under the registered page before it; it is
cached-unowned as a registered page is (counted, queued, evicted), owned
only while ``match_prefix`` copies it, and forgotten when evicted or when
its anchor page is unregistered.

Several managers may share one pool (a hybrid model's KV groups, see
``KVGroups``): each owns the pages it allocated, and ``lock`` guards the pool
and every manager on it.
"""

from __future__ import annotations

import threading

import numpy as np

from mstar.engine.resources.kv.eviction import EvictionQueue
from mstar.engine.resources.kv.keys import ChainHasher, Key, PageKeys
from mstar.engine.resources.kv.registry import PrefixRegistry
from mstar.engine.resources.kv.tails import Anchor, TailCache

__all__ = ["Key", "PageKeys", "PagePool"]

_NO_PAGES = np.zeros(0, dtype=np.int32)


class PagePool:
    """Pages ``0 .. num_pages - 1``: a free stack and an owner count per
    page, with the prefix cache's registry, eviction queue and hasher, and
    the ``lock`` its managers hold."""

    def __init__(self, num_pages: int, page_size: int | None = None) -> None:
        """``page_size`` is needed by the prefix cache alone (``page_keys``,
        ``register``)."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.lock = threading.Lock()
        self.refcount = np.zeros(num_pages, dtype=np.int32)  # owners per page
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)  # top at the end
        self._nstack = num_pages  # pages on the free stack
        self.num_free = num_pages  # free stack + cached-unowned: all allocatable
        self.num_cached = 0  # cached-unowned pages (tails too)
        self.num_evicted = 0  # registered pages evicted by alloc, ever
        self.registry = PrefixRegistry(num_pages, page_size)
        self._queue = EvictionQueue(num_pages)
        self._hasher = ChainHasher(page_size)
        self.tails = TailCache(num_pages)
        self.tiers = None  # a KVTiers (kv/tiers), set by kv.tiers.attach

    @property
    def num_registered(self) -> int:
        """Pages in the cache now (owned or not)."""
        return self.registry.size

    def free_pages(self) -> np.ndarray:
        """The allocatable pages: the free stack, then the cached-unowned
        pages (read, don't keep)."""
        if not self.num_cached:
            return self._stack[: self._nstack]
        kept = self.registry.registered | self.tails.is_tail
        cached = np.flatnonzero(kept & (self.refcount == 0)).astype(np.int32)
        return np.concatenate((self._stack[: self._nstack], cached))

    def alloc(self, n: int) -> np.ndarray:
        """``n`` allocatable pages, each now with one owner (the caller checks
        ``n <= num_free``): the free stack's first, then evicted ones."""
        if n == 0:
            return _NO_PAGES
        assert n <= self.num_free, "alloc beyond the free pages"
        take = min(n, self._nstack)
        pages = self._stack[self._nstack - take : self._nstack].copy()
        self._nstack -= take
        if take < n:
            pages = np.concatenate((pages, self._evict(n - take)))
        self.num_free -= n
        self.refcount[pages] = 1
        self.registry.reused(pages)
        return pages

    def share(self, pages: np.ndarray) -> None:
        """One more owner for each of ``pages`` (distinct, owned or cached)."""
        self.refcount[pages] += 1
        if self.num_cached:
            revived = pages[self.refcount[pages] == 1]
            if len(revived):
                assert self._kept(revived).all(), "share of a free page"
                self._queue.drop(revived)
                self.num_cached -= len(revived)
                self.num_free -= len(revived)

    def release(self, pages: np.ndarray) -> None:
        """One owner fewer for each of ``pages`` (distinct). Pages left with
        none go back on the free stack, or, if registered or tails, become
        cached-unowned (the later in ``pages``, the sooner evicted)."""
        self.refcount[pages] -= 1
        dead = pages[self.refcount[pages] == 0]
        if self.registry.size or self.tails.size:
            cached = self._kept(dead)
            if cached.any():
                queued = dead[cached][::-1]
                self._queue.push(queued)
                self.num_cached += len(queued)
                self.num_free += len(queued)
                dead = dead[~cached]
        self._push(dead)

    def shared(self) -> int:
        """Page references saved by sharing: sum over pages of owners - 1."""
        return int(np.maximum(self.refcount - 1, 0).sum())

    # --- the prefix cache ----------------------------------------------------------------

    def page_keys(
        self, tokens: np.ndarray | list[int], parent: Key | None = None, namespace: str = ""
    ) -> PageKeys:
        """``ChainHasher.page_keys``: the keys of ``tokens``' full pages."""
        return self._hasher.page_keys(tokens, parent, namespace)

    def register(self, pages: np.ndarray, keys: PageKeys, parent: int = -1) -> None:
        """``PrefixRegistry.register`` of owned full ``pages`` under ``keys``."""
        pages = np.asarray(pages, dtype=np.int32)
        if len(pages) != len(keys.hashes):
            raise ValueError(f"expected one key per page ({len(pages)}), got {len(keys.hashes)}")
        assert (self.refcount[pages] > 0).all(), "register of a page nobody owns"
        if keys.tokens.shape[1:] != (self.page_size,):
            raise ValueError(f"expected keys of pages of {self.page_size}, got {keys.tokens.shape}")
        self.registry.register(pages, keys, parent)
        if self.tiers is not None:
            self.tiers.filled(pages)

    def register_next(
        self, pages: np.ndarray, tokens: np.ndarray, parent_keys: np.ndarray, parents: np.ndarray
    ) -> np.ndarray:
        """Register one next page for each of several chains: ``pages[i]``
        (int32) holds ``tokens[i]`` (int64 ``[page_size]``) after page
        ``parents[i]`` (>= 0), whose key is ``parent_keys[i]`` (uint64).
        Returns the pages' keys (uint64)."""
        hashes = self._hasher.next_keys(tokens, parent_keys)
        self.registry.register_next(pages, PageKeys(hashes, tokens, ""), parents)
        if self.tiers is not None:
            self.tiers.filled(pages)
        return hashes

    def cache_tail(self, page: int, anchor: Anchor, tokens: np.ndarray) -> None:
        """Owned, unregistered ``page`` holds ``tokens`` (fewer than a page)
        after ``anchor``: it stays cached as a tail once its last owner
        releases it (``TailCache.add``; the tails it replaces are freed)."""
        assert self.refcount[page] > 0 and not self.registry.registered[page], "tail of a stream"
        self._free_cached(np.array(self.tails.add(page, anchor, tokens), dtype=np.int32))

    def lookup(self, keys: PageKeys, parent: int = -1) -> np.ndarray:
        """``PrefixRegistry.lookup``: the verified cached pages of the longest
        run of leading ``keys``. Changes nothing; ``share`` the result to own it."""
        return self.registry.lookup(keys, parent)

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken rule of the pool."""
        free = self._stack[: self._nstack]
        is_free = np.zeros(self.num_pages, dtype=np.int32)
        np.add.at(is_free, free, 1)
        owned = self.refcount > 0
        registered = self.registry.registered
        tails = self.tails.is_tail
        cached = (registered | tails) & ~owned
        if (self.refcount < 0).any() or (is_free > 1).any():
            raise AssertionError("broken rule: owner counts >= 0, a page on the stack once")
        if ((is_free > 0) & (owned | registered | tails)).any():
            raise AssertionError("broken rule: a free page is neither owned nor cached")
        if ((is_free > 0).astype(np.int8) + owned + cached != 1).any():
            raise AssertionError("broken rule: a page is free xor owned xor cached-unowned")
        if self.num_cached != cached.sum() or self.num_free != self._nstack + self.num_cached:
            raise AssertionError("broken rule: num_free = free stack + cached-unowned")
        if sorted(self._queue.queued().tolist()) != np.flatnonzero(cached).tolist():
            raise AssertionError("broken rule: each cached-unowned page is queued once")
        self.registry.check()
        self.tails.check(registered)

    # --- internals -----------------------------------------------------------------------

    def _kept(self, pages: np.ndarray) -> np.ndarray:
        """Whether each of ``pages`` stays cached when unowned: registered or a tail."""
        return self.registry.registered[pages] | self.tails.is_tail[pages]

    def _free_cached(self, pages: np.ndarray) -> None:
        """Cached-unowned ``pages``, no longer cached, to the free stack."""
        assert not self.refcount[pages].any(), "an owned page freed"
        self._queue.drop(pages)
        self.num_cached -= len(pages)
        self.num_free -= len(pages)
        self._push(pages)

    def _push(self, pages: np.ndarray) -> None:
        self._stack[self._nstack : self._nstack + len(pages)] = pages
        self._nstack += len(pages)
        self.num_free += len(pages)

    def _evict(self, n: int) -> np.ndarray:
        """The ``n`` least recently released cached-unowned pages,
        unregistered or forgotten as tails (the caller counts them out of
        ``num_free``). Their registered descendants and the tails under any
        of them go too: those cached-unowned to the free stack."""
        pages = self._queue.pop(n)
        self.num_cached -= len(pages)
        tail = self.tails.is_tail[pages]
        registered = pages
        if tail.any():
            self.tails.forget(pages[tail])
            registered = pages[~tail]
        if not len(registered):
            return pages
        if self.tiers is not None:
            self.tiers.offer(registered)  # their KV is copied out before it is overwritten
        self.num_evicted += len(registered)
        cut = self.registry.unregister(registered)
        self._free_cached(cut[self.refcount[cut] == 0])
        if self.tails.size:
            self._free_cached(self.tails.orphans(np.concatenate((registered, cut))))
        return pages
