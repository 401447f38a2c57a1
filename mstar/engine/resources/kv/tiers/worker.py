"""The tiers' copies, off the engine thread: a writer and a reader thread.

The writer encodes the pages the engine offered (their KV already copied
out of the pool) and stores each in every tier that lacks it. The reader
follows a chain of page keys through the tiers in order (disk, then the
shared store), stopping at the first page none holds or whose value does
not check out (``codec.decode``: a miss, logged, and the value discarded
so that a later write replaces it); a page found in a later tier is then
*promoted*: its value, as read, goes to the writer for the tiers before it
(the shared store's pages to the local disk, so a restart finds them
there). Pending writes are bounded in bytes; past the bound an offer or a
promotion is dropped (counted), never waited for. Counters per tier (pages
asked and found, bytes moved, pages stored, promoted and evicted, bad
values) and the load times are read with ``stats``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mstar.engine.resources.kv.tiers.codec import PageRecord, decode, encode, store_key

log = logging.getLogger(__name__)

BATCH = 16  # pages per store round trip when reading


class Store(Protocol):
    """One tier: values by string key. Failures are misses, never raised."""

    medium: str  # its name in metrics and KV events
    local: bool  # contains() is cheap enough for the engine thread

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> int: ...
    def get(self, keys: Sequence[str]) -> list[bytes | None]: ...
    def contains(self, keys: Sequence[str]) -> list[bool]: ...
    def discard(self, keys: Sequence[str]) -> None: ...
    def take_evicted(self) -> list[str]: ...
    def describe(self) -> str: ...
    def close(self) -> None: ...


class TierEvents(Protocol):
    """Hears pages stored to and removed from a tier (``medium``)."""

    def tier_stored(
        self, medium: str, keys: np.ndarray, parent_keys: np.ndarray, has_parent: np.ndarray,
        tokens: np.ndarray,
    ) -> None: ...  # fmt: skip

    def tier_removed(self, medium: str, keys: np.ndarray) -> None: ...


@dataclass(frozen=True)
class Fetch:
    """Read the pages keyed ``keys`` (from page ``start`` of a chain of
    ``tokens``, in ``namespace``); the answer goes to ``done(stream, start,
    kv list, seconds)``."""

    stream: Hashable
    start: int
    keys: np.ndarray  # uint64
    tokens: np.ndarray  # int64, the chain's tokens to the last page's end
    namespace: str
    parent: int | None = None  # the key of page ``start - 1`` (None: ``start`` is 0)


@dataclass(frozen=True)
class _Write:
    """Pages for the writer to store in each of ``stores`` that lacks them:
    their records (without KV) and parents' keys, and either ``kv`` (uint8
    ``[n, kv_len]``, an offer: encoded on the writer) or ``values`` (a
    promotion: values read from a later tier, stored as they are)."""

    pages: list[tuple[PageRecord, int | None]]
    stores: list[Store]
    size: int  # bytes held until written
    kv: Any = None
    values: list[bytes] | None = None


class TierIO:
    """The tiers ``stores`` (in read order) for pages of ``kv_len`` bytes
    under ``identity``, ``page_size`` tokens each; ``done`` hears each fetch."""

    def __init__(
        self,
        stores: Sequence[Store],
        identity: bytes,
        kv_len: int,
        page_size: int,
        done: Callable[[Hashable, int, list[bytes], float], None],
        max_pending: int = 1 << 30,
    ) -> None:
        self.stores, self.identity, self.kv_len = list(stores), identity, kv_len
        self.page_size, self._done, self.max_pending = page_size, done, max_pending
        self.events: TierEvents | None = None
        self.counts: Counter[str] = Counter()  # "<medium>_<what>" and totals
        self.load_seconds: list[float] = []  # fetches answered, not yet read
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._writes: queue.Queue[Any] = queue.Queue()
        self._reads: queue.Queue[Any] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._write_loop, name="mstar-kv-tier-writer", daemon=True),
            threading.Thread(target=self._read_loop, name="mstar-kv-tier-reader", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # --- the engine thread ---------------------------------------------------------------

    def offer(self, pages: list[tuple[PageRecord, int | None]], kv) -> None:
        """Store ``pages`` (each a record without its KV and its parent's
        key) whose KV is ``kv`` (uint8 ``[n, kv_len]``, a copy), unless more
        than ``max_pending`` bytes wait already (then they are dropped)."""
        if self._hold(_Write(pages, self.stores, kv.numel(), kv=kv)):
            with self._lock:
                self.counts["pages_offered"] += len(pages)

    def _hold(self, job: _Write) -> bool:
        """Queue ``job`` for the writer unless ``max_pending`` bytes would
        wait (then its pages are counted dropped); whether it was queued."""
        with self._lock:
            if self._pending_bytes + job.size > self.max_pending:
                self.counts["offers_dropped"] += len(job.pages)
                return False
            self._pending_bytes += job.size
        self._writes.put(job)
        return True

    def fetch(self, job: Fetch) -> None:
        self._reads.put(job)

    def drain(self) -> None:
        """Wait until every write offered so far is stored."""
        self._writes.join()

    def close(self) -> None:
        """Finish the fetches and store what is pending (their promotions
        too), stop the threads, close the stores."""
        writer, reader = self._threads
        self._reads.put(None)
        reader.join()
        self._writes.put(None)
        writer.join()
        for s in self.stores:
            s.close()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counts)

    def take_load_seconds(self) -> list[float]:
        with self._lock:
            out, self.load_seconds = self.load_seconds, []
        return out

    # --- the writer ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            try:
                self._write(job)
            except Exception:  # a tier must never take the server down
                log.exception("KV tier write failed; pages dropped")
            finally:
                with self._lock:
                    self._pending_bytes -= job.size
                self._writes.task_done()
        self._writes.task_done()

    def _write(self, job: _Write) -> None:
        pages, values = job.pages, job.values
        promoted = values is not None
        names = [store_key(self.identity, rec.key) for rec, _ in pages]
        for store in job.stores:
            have = store.contains(names)  # (a fetch of the same pages may have copied them)
            todo = [i for i, h in enumerate(have) if not h]
            if not todo:
                continue
            if values is None:
                values = [
                    encode(self.identity, PageRecord(rec.key, rec.namespace, rec.chain, row))
                    for (rec, _), row in zip(pages, (r.tobytes() for r in job.kv.numpy()))
                ]
            written = store.put([names[i] for i in todo], [values[i] for i in todo])
            evicted = store.take_evicted()
            with self._lock:
                self.counts[f"{store.medium}_bytes_written"] += written
                if written:
                    self.counts[f"{store.medium}_pages_stored"] += len(todo)
                    if promoted:
                        self.counts[f"{store.medium}_pages_promoted"] += len(todo)
                self.counts[f"{store.medium}_pages_evicted"] += len(evicted)
            if self.events is not None and written:
                self._tell_stored(store.medium, [pages[i] for i in todo])
            if self.events is not None and evicted:
                keys = np.array([int(k.rsplit(":", 1)[1], 16) for k in evicted], dtype=np.uint64)
                self.events.tier_removed(store.medium, keys)

    def _tell_stored(self, medium: str, pages: list[tuple[PageRecord, int | None]]) -> None:
        ps = self.page_size
        self.events.tier_stored(
            medium,
            np.array([rec.key for rec, _ in pages], dtype=np.uint64),
            np.array([p or 0 for _, p in pages], dtype=np.uint64),
            np.array([p is not None for _, p in pages]),
            np.stack([rec.chain[-ps:] for rec, _ in pages]),
        )

    # --- the reader ----------------------------------------------------------------------

    def _read_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            t0 = time.perf_counter()
            below: dict[int, list[tuple[int, bytes]]] = {}
            try:
                found = self._read(job, below)
            except Exception:
                log.exception("KV tier read failed; a miss")
                found, below = [], {}
            seconds = time.perf_counter() - t0
            with self._lock:
                if found:
                    self.load_seconds.append(seconds)
            self._done(job.stream, job.start, found, seconds)
            for tier, pages in below.items():
                self._promote(job, tier, pages)

    def _promote(self, job: Fetch, tier: int, pages: list[tuple[int, bytes]]) -> None:
        """Queue ``pages`` (``(index in job.keys, value)``), read from tier
        ``tier``, for the tiers before it."""
        ps, records = self.page_size, []
        for i, _ in pages:
            key = int(job.keys[i])
            parent = int(job.keys[i - 1]) if i else job.parent
            chain = job.tokens[: (job.start + i + 1) * ps]
            records.append((PageRecord(key, job.namespace, chain, b""), parent))
        values = [value for _, value in pages]
        self._hold(_Write(records, self.stores[:tier], sum(map(len, values)), values=values))

    def _read(self, job: Fetch, below: dict[int, list[tuple[int, bytes]]]) -> list[bytes]:
        """KV of the longest run of ``job``'s pages the tiers hold, in order;
        ``below`` gets, per tier after the first, the pages found there
        (``(index in job.keys, value)``)."""
        found: list[bytes] = []
        ps, n = self.page_size, len(job.keys)
        for tier, store in enumerate(self.stores):
            while len(found) < n:
                at = len(found)
                batch = job.keys[at : at + BATCH].tolist()
                values = store.get([store_key(self.identity, k) for k in batch])
                hits = 0
                for i, (key, value) in enumerate(zip(batch, values)):
                    end = (job.start + at + i + 1) * ps
                    kv, why = decode(
                        value, self.identity, key, job.namespace, job.tokens[:end], self.kv_len
                    )
                    if kv is None:
                        if value is not None:
                            log.warning("KV page %016x in %s is a miss: %s", key, store.medium, why)
                            store.discard([store_key(self.identity, key)])
                            with self._lock:
                                self.counts[f"{store.medium}_bad_values"] += 1
                        break
                    found.append(kv)
                    if tier:
                        below.setdefault(tier, []).append((at + i, value))
                    hits += 1
                with self._lock:
                    self.counts[f"{store.medium}_pages_queried"] += min(len(batch), hits + 1)
                    self.counts[f"{store.medium}_pages_hit"] += hits
                    self.counts[f"{store.medium}_bytes_read"] += hits * self.kv_len
                if hits < len(batch):
                    break
        return found
