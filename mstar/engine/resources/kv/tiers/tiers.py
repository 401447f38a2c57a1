"""Tiers below the page pool, as the engine thread sees them.

Write-back: a registered page the pool evicts (``PagePool._evict``), or with
``eager`` every page as it is registered, is *offered*: its chain (tokens
from position 0, namespace, parent key) is read off the registry and its KV
copied out of the cache now, before the pool hands the page out again;
``TierIO``'s writer stores it. Read-ahead: ``load`` of a stream about to
start finds how many of its full pages the pool holds and, when a tier may
hold the next ones, has ``TierIO``'s reader fetch them and answers False
(the admitter schedules other requests meanwhile). Once fetched, ``load``
copies them into fresh pool pages, registers them after the pool's own and
leaves them cached, and answers True: ``match_prefix`` then finds them like
any cached page, so the plan layer only ever sees pool pages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from mstar.engine.resources.kv.keys import PageKeys
from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.tiers.codec import PageRecord, store_key
from mstar.engine.resources.kv.tiers.pagebytes import page_bytes, read_pages, write_pages
from mstar.engine.resources.kv.tiers.worker import Fetch, Store, TierIO

MODES = ("lazy", "eager")
FLUSH_PAGES = 64  # pages offered at a time by ``flush``


class KVTiers:
    """The tiers ``stores`` (read in order) below ``pool`` over ``cache``
    (a ``KVCache``), for pages valid under ``identity`` (``codec.model_identity``).
    ``mode``: ``"lazy"`` offers pages when evicted, ``"eager"`` when registered."""

    def __init__(
        self, pool: PagePool, cache, identity: bytes, stores: Sequence[Store], mode: str = "lazy"
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"expected --kv-offload lazy or eager, got {mode!r}")
        if not stores:
            raise ValueError("expected at least one tier (a disk path or a store url)")
        self.pool, self.cache, self.identity = pool, cache, identity
        self.eager = mode == "eager"
        self.page_size = pool.page_size
        self.io = TierIO(stores, identity, page_bytes(cache), pool.page_size, self._fetched)
        self._cond = threading.Condition()
        self._inflight: set[Hashable] = set()
        self._fetched_pages: dict[Hashable, tuple[int, list[bytes]]] = {}
        self._dropped: set[Hashable] = set()  # fetches in flight whose request left
        self.load_wait_s = 0.0  # engine time spent installing fetched pages

    # --- write-back (the pool's hooks) ---------------------------------------------------

    def offer(self, pages: np.ndarray) -> None:
        """Copy registered ``pages``' KV and chains now; the writer stores them."""
        reg = self.pool.registry
        pages = np.asarray(pages, dtype=np.int32)
        pages = pages[reg.registered[pages]]
        records, rows, chains = [], [], {}
        for page in pages.tolist():
            chain = self._chain(page, chains)
            if chain is None:
                continue
            parent = int(reg.parent[page])
            parent_key = int(reg.key[parent]) if parent >= 0 else None
            records.append((PageRecord(int(reg.key[page]), chain[1], chain[0], b""), parent_key))
            rows.append(page)
        if records:
            self.io.offer(records, read_pages(self.cache, np.array(rows, dtype=np.int32)))

    def filled(self, pages: np.ndarray) -> None:
        """Pages just registered: offered now with ``eager``."""
        if self.eager:
            self.offer(pages)

    def flush(self) -> None:
        """Offer every page the pool holds registered, and wait until stored
        (a graceful shutdown: a lazy tier then survives a restart)."""
        with self.pool.lock:
            pages = np.flatnonzero(self.pool.registry.registered)
        for at in range(0, len(pages), FLUSH_PAGES):  # under the writer's bound on pending bytes
            with self.pool.lock:
                self.offer(pages[at : at + FLUSH_PAGES])
            self.io.drain()

    def _chain(self, page: int, memo: dict) -> tuple[np.ndarray, str] | None:
        """The tokens from position 0 to ``page``'s end and its namespace
        (None for a page cut off its chain)."""
        reg = self.pool.registry
        path = []
        p = page
        while p >= 0 and p not in memo:
            path.append(p)
            p = int(reg.parent[p])
        if p >= 0:
            head, namespace = memo[p]
        else:
            namespace = reg.namespace_of(path[-1])
            if namespace is None:
                return None
            head = np.zeros(0, dtype=np.int64)
        for q in reversed(path):
            head = np.concatenate((head, reg.tokens[q]))
            memo[q] = head, namespace
        return memo[page]

    # --- read-ahead (the admitter) -------------------------------------------------------

    def load(self, stream: tuple[str, str], tokens: Sequence[int], namespace: str = "") -> bool:
        """Make the pool hold what the tiers have of ``tokens``' full pages
        (all but the last token) for ``stream`` (request id, label) about to start. False while a
        fetch for it is in flight (don't schedule it); True when
        ``match_prefix`` can go on."""
        with self._cond:
            if stream in self._inflight:
                return False
            got = self._fetched_pages.pop(stream, None)
        ps = self.page_size
        usable = (len(tokens) - 1) // ps * ps
        if usable <= 0:
            return True
        chain = np.asarray(tokens[:usable], dtype=np.int64)
        with self.pool.lock:
            keys = self.pool.page_keys(chain, None, namespace)
            held = self.pool.lookup(keys)
            if got is not None:
                self._install(keys, held, *got)
                return True
        n = len(held)
        if n == len(keys.hashes) or not self._maybe_held(int(keys.hashes[n])):
            return True
        with self._cond:
            self._inflight.add(stream)
        parent = int(keys.hashes[n - 1]) if n else None
        self.io.fetch(Fetch(stream, n, keys.hashes[n:].copy(), chain, namespace, parent))
        return False

    def busy(self, request_id: str) -> bool:
        """Whether a fetch for a stream ``(request_id, label)`` is in flight."""
        with self._cond:
            return any(s[0] == request_id for s in self._inflight)

    def cancel(self, request_id: str) -> None:
        """Forget the fetched pages of ``request_id``'s streams (it left
        before using them)."""
        with self._cond:
            for stream in [s for s in self._fetched_pages if s[0] == request_id]:
                del self._fetched_pages[stream]
            self._dropped.update(s for s in self._inflight if s[0] == request_id)

    def wait(self, timeout: float) -> None:
        """Block until a fetch finishes or ``timeout`` seconds pass."""
        with self._cond:
            if self._inflight:
                self._cond.wait(timeout)

    def _maybe_held(self, key: int) -> bool:
        """Whether a tier may hold the page ``key``: the disk index answers
        now; a shared store is only asked off the engine thread."""
        name = store_key(self.identity, key)
        return any(not s.local or s.contains([name])[0] for s in self.io.stores)

    def _fetched(self, stream: Hashable, start: int, found: list[bytes], seconds: float) -> None:
        with self._cond:
            self._inflight.discard(stream)
            if stream in self._dropped:
                self._dropped.discard(stream)
            else:  # (found nothing: kept too, so it is not fetched again)
                self._fetched_pages[stream] = (start, found)
            self._cond.notify_all()

    def _install(self, keys: PageKeys, held: np.ndarray, start: int, found: list[bytes]) -> None:
        """Copy ``found`` (pages ``start ..`` of ``keys``) into fresh pool
        pages registered after ``held`` (the pool's pages of ``keys``), left
        cached-unowned. Under the pool's lock."""
        t0 = time.perf_counter()
        pool, m = self.pool, len(held)
        if m < start:
            return  # the pool lost pages of the chain meanwhile: the fetch no longer joins
        found = found[m - start :]
        pool.share(held)  # kept while fresh pages are allocated
        n = min(len(found), pool.num_free)
        fresh = pool.alloc(n)
        if n:
            data = np.empty((n, self.io.kv_len), dtype=np.uint8)
            for row, kv in zip(data, found):
                row[:] = np.frombuffer(kv, dtype=np.uint8)
            write_pages(self.cache, fresh, torch.from_numpy(data))
            part = PageKeys(keys.hashes[m : m + n], keys.tokens[m : m + n], keys.namespace)
            pool.registry.register(fresh, part, int(held[-1]) if m else -1)
        pool.release(np.concatenate((held, fresh)))
        self.load_wait_s += time.perf_counter() - t0

    def stats(self) -> dict[str, float]:
        """``TierIO``'s counters, with the engine's install time."""
        return {**self.io.stats(), "install_seconds": self.load_wait_s}

    def describe(self) -> str:
        """The tiers in read order and the offload mode, for a banner."""
        names = ", ".join(s.describe() for s in self.io.stores)
        return f"{names}; offload {'eager' if self.eager else 'lazy'}"

    def close(self) -> None:
        self.io.close()
