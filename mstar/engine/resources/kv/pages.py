"""The page pool: a fixed number of KV pages, each free, owned or cached.

A page's owners are the streams naming it (a fork adds one) and, between
``admit`` and the moment a step hands it out, that step's reservation. A page
nobody caches goes back to the free stack when its last owner lets go.

Prefix cache. A full, committed page can be *registered* under a key naming
its content: its stream's whole token chain from position 0 to the page's end,
plus a namespace (``PagePool.page_keys``). A registered page whose last owner lets go
stays *cached-unowned*: allocatable (``num_free`` counts it) but kept, with
its key, until its memory is needed. ``alloc`` takes the free stack first,
then evicts cached-unowned pages least recently released first; pages released
by one ``release`` call go later-in-the-array first, so a stream's later pages
leave before its earlier ones. ``share`` on a cached-unowned page owns it
again. So every page is exactly one of: free, owned (registered or not),
cached-unowned.

Exactness. A key is a 64-bit polynomial hash (Horner over the tokens, mod
2**64), computed with a handful of numpy operations whatever the length. Such
a hash is cheap but breakable: Thue-Morse strings of 2048 tokens, or two
tokens chosen to cancel, collide for any odd base. So the key only *finds* a
page; the pool never trusts it. Each registered page keeps its tokens, its
parent page (the registered page holding the chain before it; -1 for a first
page) and, for a first page, its namespace, and ``lookup`` checks the matched
run against the query — every page's tokens and every parent link, in a few
vectorized operations — and stops at the first page that fails. A collision
therefore costs a cache miss (an adversary can deny itself or others hits by
registering colliding chains first), never wrong KV.

Parent links must stay true: a page's KV was computed after its parent's
tokens, so if a parent page were evicted and reused for other content while a
child stayed registered, a later chain through the new content would verify
the old child. With a stream releasing all its pages in one call, a child is
evicted before its parent (every owner of a child also owns its parent), but
a page registered after a duplicate hangs off another stream's page that its
own stream does not own (see ``register``), which can be evicted first. So
unregistering a page unregisters its registered descendants with it: parent
links always name live, registered pages (``check`` asserts it).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

_NO_PAGES = np.zeros(0, dtype=np.int32)
_NO_KEYS = np.zeros(0, dtype=np.uint64)
_WIDTH_BITS = 3  # _KeyTable's buckets hold 8 keys
_BASE = 0x9E3779B97F4A7C15  # odd, so its powers are invertible mod 2**64

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


class _KeyTable:
    """Key -> page of the registered pages: a bucketed hash table in numpy,
    so finding a whole prompt's keys is a few array operations.

    A key goes to bucket ``key >> shift`` (its high bits, the best mixed of a
    polynomial hash) or, when that bucket is full, the next one with room;
    the full buckets it passed are marked spilled, and a key missing from a
    spilled bucket is looked for in the next. With at most two keys a bucket
    on average, spills are rare. An empty slot holds a key of another bucket,
    so no query matches it.
    """

    WIDTH = 1 << _WIDTH_BITS

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
            found = hit >> _WIDTH_BITS
            got[found if rows is None else rows[found]] = self._pages.take(b, axis=0).flat[hit]
            if not self._nspilled:
                return got
            rows = np.arange(len(keys)) if rows is None else rows
            more = (got[rows] < 0) & self._spilled[b]
            if not more.any():
                return got
            rows, b = rows[more], (b[more] + 1) & self._mask

    def insert(self, keys: np.ndarray, pages: np.ndarray) -> None:
        """Add ``keys`` (absent) for ``pages`` (not in the table): in rounds of
        one key a bucket, while their buckets have room; then one at a time."""
        b = (keys >> self._shift).astype(np.intp)
        todo = np.arange(len(b))
        while len(todo):
            _, first = np.unique(b[todo], return_index=True)
            rows = todo[first]
            free = self._pages[b[rows]] < 0
            col = free.argmax(axis=1)
            if not free[np.arange(len(rows)), col].all():  # a full bucket: spill, one by one
                for i in todo.tolist():
                    self._put(int(b[i]), keys[i], pages[i])
                break
            self._set(b[rows] * self.WIDTH + col, keys[rows], pages[rows])
            rest = np.ones(len(todo), dtype=bool)
            rest[first] = False
            todo = todo[rest]
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


class PagePool:
    """Pages ``0 .. num_pages - 1``: a free stack, an owner count per page,
    and the prefix cache's registered pages with their eviction order."""

    def __init__(self, num_pages: int, page_size: int | None = None) -> None:
        """``page_size`` is needed by the prefix cache alone (``page_keys``,
        ``register``)."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = np.zeros(num_pages, dtype=np.int32)  # owners per page
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)  # top at the end
        self._nstack = num_pages  # pages on the free stack
        self.num_free = num_pages  # free stack + cached-unowned: all allocatable
        self.num_cached = 0  # cached-unowned pages
        self.num_evicted = 0  # registered pages evicted by alloc, ever
        self._table = _KeyTable(num_pages)
        self._weights = self._up = self._down = _NO_KEYS  # page_keys' powers of B
        self._seeded = ("", _seed(""))  # page_keys' last namespace and its seed
        # per page (zeros are mapped lazily: an unused cache costs no memory)
        self._tokens = np.zeros((num_pages, page_size or 0), dtype=np.int64)
        self._cache_used = False  # anything ever registered
        self._key = np.zeros(num_pages, dtype=np.uint64)
        self._registered = np.zeros(num_pages, dtype=bool)
        self._parent = np.full(num_pages, -1, dtype=np.int32)
        self._children = np.zeros(num_pages, dtype=np.int32)  # registered pages naming it
        self._namespace: dict[int, str] = {}  # first pages' namespaces
        self._gen = np.zeros(num_pages, dtype=np.int64)  # bumped when unregistered
        self._rep = np.full(num_pages, -1, dtype=np.int32)  # a duplicate's registered twin
        self._rep_gen = np.zeros(num_pages, dtype=np.int64)
        # eviction queue: (page, stamp) in eviction order from _head; an entry
        # is live while the page's _stamp still equals it (share clears it)
        self._stamp = np.full(num_pages, -1, dtype=np.int64)
        self._queue = np.zeros(2 * num_pages, dtype=np.int32)
        self._queue_stamp = np.zeros(2 * num_pages, dtype=np.int64)
        self._head = self._tail = 0
        self._clock = 0

    @property
    def num_registered(self) -> int:
        """Pages in the cache now (owned or not)."""
        return self._table.size

    def free_pages(self) -> np.ndarray:
        """The allocatable pages: the free stack, then the cached-unowned
        pages (read, don't keep)."""
        if not self.num_cached:
            return self._stack[: self._nstack]
        cached = np.flatnonzero(self._registered & (self.refcount == 0)).astype(np.int32)
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
        if self._cache_used:
            self._rep[pages] = -1  # a twin named by the page's last life
        return pages

    def share(self, pages: np.ndarray) -> None:
        """One more owner for each of ``pages`` (distinct, owned or cached)."""
        self.refcount[pages] += 1
        if self.num_cached:
            revived = pages[self.refcount[pages] == 1]
            if len(revived):
                assert self._registered[revived].all(), "share of a free page"
                self._stamp[revived] = -1
                self.num_cached -= len(revived)
                self.num_free -= len(revived)

    def release(self, pages: np.ndarray) -> None:
        """One owner fewer for each of ``pages`` (distinct). Pages left with
        none go back on the free stack, or, if registered, become
        cached-unowned (the later in ``pages``, the sooner evicted)."""
        self.refcount[pages] -= 1
        dead = pages[self.refcount[pages] == 0]
        if self._table.size:
            cached = self._registered[dead]
            if cached.any():
                self._enqueue(dead[cached][::-1])
                dead = dead[~cached]
        self._push(dead)

    def shared(self) -> int:
        """Page references saved by sharing: sum over pages of owners - 1."""
        return int(np.maximum(self.refcount - 1, 0).sum())

    # --- the prefix cache ----------------------------------------------------------------

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

    def register(self, pages: np.ndarray, keys: PageKeys, parent: int = -1) -> None:
        """Register owned full ``pages`` (consecutive pages of one stream)
        under ``keys``; ``parent`` is the stream's page before ``pages[0]``
        (-1: ``pages[0]`` is its first).

        A page already registered under its key is skipped. A page whose key
        is already another page's stays unregistered: if that page holds the
        same tokens after the same parent (a duplicate computed before the
        first was registered), the later pages hang off it; otherwise (a
        collision) they stay unregistered too. A parent that is neither
        registered nor a live duplicate leaves all of ``pages`` unregistered.
        """
        pages = np.asarray(pages, dtype=np.int32)
        if len(pages) != len(keys.hashes):
            raise ValueError(f"expected one key per page ({len(pages)}), got {len(keys.hashes)}")
        assert (self.refcount[pages] > 0).all(), "register of a page nobody owns"
        if keys.tokens.shape[1:] != (self.page_size,):
            raise ValueError(f"expected keys of pages of {self.page_size}, got {keys.tokens.shape}")
        self._cache_used = True
        prev = self._resolve(parent)
        if prev is None or not len(pages):
            return
        twins = self._table.find(keys.hashes)
        fresh = (twins < 0).all() and np.unique(keys.hashes).size == len(pages)
        if fresh and not self._registered[pages].any():
            self._link(pages, keys, np.concatenate(([prev], pages[:-1])).astype(np.int32))
            return
        for i, page in enumerate(pages.tolist()):
            if self._registered[page]:
                assert self._key[page] == keys.hashes[i], "a page registered under two keys"
                prev = page
                continue
            twin = int(self._table.find(keys.hashes[i : i + 1])[0])  # earlier pages may be it
            if twin < 0:
                one = PageKeys(keys.hashes[i : i + 1], keys.tokens[i : i + 1], keys.namespace)
                self._link(pages[i : i + 1], one, [prev])
                prev = page
            elif self._holds(twin, keys.tokens[i], prev, keys.namespace):
                self._rep[page], self._rep_gen[page] = twin, self._gen[twin]
                prev = twin
            else:
                return  # a collision: this chain has no place in the cache

    def register_next(
        self, pages: np.ndarray, tokens: np.ndarray, parent_keys: np.ndarray, parents: np.ndarray
    ) -> np.ndarray:
        """Register one next page for each of several chains: ``pages[i]``
        (int32) holds ``tokens[i]`` (int64 ``[page_size]``) after page
        ``parents[i]`` (>= 0), whose key is ``parent_keys[i]`` (uint64). The
        same as ``register`` of each page alone, in a few array operations
        when none meets a duplicate. Returns the pages' keys (uint64)."""
        if not len(self._up):
            self._grow_powers(1)
        hashes = np.ascontiguousarray(tokens, dtype=np.int64).view(np.uint64) @ self._weights
        hashes += parent_keys * self._up[0]  # h = parent * B**page_size + the page's own
        self._cache_used = True
        if (
            self._registered[parents].all()
            and not self._registered[pages].any()
            and np.maximum.reduce(self._table.find(hashes)) < 0
            and np.unique(hashes).size == len(pages)
        ):
            self._link(pages, PageKeys(hashes, tokens, ""), parents)
            return hashes
        for i in range(len(pages)):
            one = PageKeys(hashes[i : i + 1], tokens[i : i + 1], "")
            self.register(pages[i : i + 1], one, int(parents[i]))
        return hashes

    def lookup(self, keys: PageKeys, parent: int = -1) -> np.ndarray:
        """The pages (int32) of the longest run of leading ``keys`` that are
        cached and verified: each page's tokens equal ``keys.tokens``' row,
        its parent is the page before it (``parent`` for the first: -1 for a
        chain from position 0, whose first page must be in ``keys.namespace``).
        Changes nothing; ``share`` the result to own it."""
        pages = self._table.find(keys.hashes)
        if len(pages) == 0 or pages[0] < 0:
            return _NO_PAGES
        first = int(np.argmin(pages))  # the first miss, if any
        if pages[first] < 0:
            pages = pages[:first]
        if parent == -1 and self._namespace.get(int(pages[0])) != keys.namespace:
            return _NO_PAGES
        held = self._tokens.take(pages, axis=0)
        links = self._parent.take(pages)
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

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken rule of the pool."""
        free = self._stack[: self._nstack]
        is_free = np.zeros(self.num_pages, dtype=np.int32)
        np.add.at(is_free, free, 1)
        owned = self.refcount > 0
        cached = self._registered & ~owned
        if (self.refcount < 0).any() or (is_free > 1).any():
            raise AssertionError("broken rule: owner counts >= 0, a page on the stack once")
        if ((is_free > 0) & (owned | self._registered)).any():
            raise AssertionError("broken rule: a free page is neither owned nor registered")
        if ((is_free > 0).astype(np.int8) + owned + cached != 1).any():
            raise AssertionError("broken rule: a page is free xor owned xor cached-unowned")
        if self.num_cached != cached.sum() or self.num_free != self._nstack + self.num_cached:
            raise AssertionError("broken rule: num_free = free stack + cached-unowned")
        live = self._queue[self._head : self._tail]
        live = live[self._stamp[live] == self._queue_stamp[self._head : self._tail]]
        if sorted(live.tolist()) != np.flatnonzero(cached).tolist():
            raise AssertionError("broken rule: each cached-unowned page is queued once")
        reg = np.flatnonzero(self._registered).astype(np.int32)
        self._table.check(reg, self._key[reg])
        parents = self._parent[reg]
        if not self._registered[parents[parents >= 0]].all():
            raise AssertionError("broken rule: a registered page's parent is registered")
        children = np.bincount(parents[parents >= 0], minlength=self.num_pages)
        if not np.array_equal(children, self._children):
            raise AssertionError("broken rule: child counts match the parent links")
        roots = set(reg[parents < 0].tolist())
        if set(self._namespace) != roots:
            raise AssertionError("broken rule: first pages, and only they, have a namespace")

    # --- internals -----------------------------------------------------------------------

    def _grow_powers(self, n: int) -> None:
        """Powers of B for ``page_keys`` of up to ``2 * n`` pages."""
        ps, base = self.page_size, np.uint64(_BASE)
        self._weights = np.ones(ps, dtype=np.uint64)  # B**(ps-1-j)
        self._weights[:-1] = np.multiply.accumulate(np.full(ps - 1, base))[::-1]
        step = pow(_BASE, ps, 1 << 64)
        self._up = np.multiply.accumulate(np.full(2 * n, np.uint64(step)))
        self._down = np.multiply.accumulate(np.full(2 * n, np.uint64(pow(step, -1, 1 << 64))))

    def _push(self, pages: np.ndarray) -> None:
        self._stack[self._nstack : self._nstack + len(pages)] = pages
        self._nstack += len(pages)
        self.num_free += len(pages)

    def _enqueue(self, pages: np.ndarray) -> None:
        """Make registered ``pages`` cached-unowned, to be evicted in order
        after every page queued before."""
        n = len(pages)
        if self._tail + n > len(self._queue):
            self._compact()
        stamps = np.arange(self._clock, self._clock + n, dtype=np.int64)
        self._clock += n
        self._stamp[pages] = stamps
        self._queue[self._tail : self._tail + n] = pages
        self._queue_stamp[self._tail : self._tail + n] = stamps
        self._tail += n
        self.num_cached += n
        self.num_free += n

    def _compact(self) -> None:
        """Drop dead queue entries (live ones are at most ``num_pages``)."""
        pages = self._queue[self._head : self._tail]
        stamps = self._queue_stamp[self._head : self._tail]
        live = self._stamp[pages] == stamps
        n = int(live.sum())
        self._queue[:n] = pages[live]
        self._queue_stamp[:n] = stamps[live]
        self._head, self._tail = 0, n

    def _evict(self, n: int) -> np.ndarray:
        """The ``n`` least recently released cached-unowned pages,
        unregistered (the caller counts them out of ``num_free``)."""
        out = []
        while n:
            end = min(self._tail, self._head + 2 * n + 16)
            assert end > self._head, "eviction beyond the cached pages"
            pages = self._queue[self._head : end]
            live = np.flatnonzero(self._stamp[pages] == self._queue_stamp[self._head : end])[:n]
            out.append(pages[live])
            n -= len(live)
            self._head = self._head + int(live[-1]) + 1 if n == 0 else end
        pages = np.concatenate(out) if len(out) > 1 else out[0]
        self._stamp[pages] = -1
        self.num_cached -= len(pages)
        self.num_evicted += len(pages)
        self._unregister(pages)
        return pages

    def _unregister(self, pages: np.ndarray) -> None:
        """Drop ``pages``' keys, and their registered descendants' (those
        cached-unowned go to the free stack)."""
        while len(pages):
            self._table.remove(pages)
            for page in pages[self._parent[pages] < 0].tolist():
                self._namespace.pop(page, None)  # a first page's, or a cut orphan's none
            self._registered[pages] = False
            self._gen[pages] += 1
            parents = self._parent[pages]
            np.subtract.at(self._children, parents[parents >= 0], 1)
            if not self._children[pages].any():
                return
            self._children[pages] = 0
            orphans = np.flatnonzero(self._registered & np.isin(self._parent, pages))
            orphans = orphans.astype(np.int32)
            loose = orphans[self.refcount[orphans] == 0]
            self._stamp[loose] = -1
            self.num_cached -= len(loose)
            self.num_free -= len(loose)
            self._push(loose)
            self._parent[orphans] = -1  # cut before the loop's own decrement
            pages = orphans

    def _link(self, pages: np.ndarray, keys: PageKeys, parents) -> None:
        """Register ``pages`` (not yet registered, keys unused) after ``parents``."""
        parents = np.asarray(parents, dtype=np.int32)
        self._tokens[pages] = keys.tokens
        self._key[pages] = keys.hashes
        self._registered[pages] = True
        self._parent[pages] = parents
        np.add.at(self._children, parents[parents >= 0], 1)
        if parents[0] < 0:
            self._namespace[int(pages[0])] = keys.namespace
        self._table.insert(keys.hashes, pages)

    def _resolve(self, page: int) -> int | None:
        """The registered page holding ``page``'s chain (-1 for none before
        a first page), or None when there is none."""
        if page < 0 or self._registered[page]:
            return page
        twin = int(self._rep[page])
        if twin >= 0 and self._registered[twin] and self._gen[twin] == self._rep_gen[page]:
            return twin
        return None

    def _holds(self, page: int, tokens: np.ndarray, parent: int, namespace: str) -> bool:
        """Whether registered ``page`` holds ``tokens`` after ``parent``."""
        if self._parent[page] != parent or not np.array_equal(self._tokens[page], tokens):
            return False
        return parent >= 0 or self._namespace[page] == namespace
