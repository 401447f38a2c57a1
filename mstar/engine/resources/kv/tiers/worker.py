"""The tiers' copies, off the engine thread: a writer and a reader thread.

The writer encodes the pages the engine offered (their KV already copied
out of the pool) and stores each in every tier that lacks it. The reader
follows a chain of page keys through the tiers in order (disk, then the
shared store), stopping at the first page none holds or whose value does
not check out (``codec.decode``: a miss, logged). Pending writes are
bounded in bytes; past the bound an offer is dropped (counted), never
waited for. Counters per tier (pages asked and found, bytes moved, pages
stored and evicted, bad values) and the load times are read with ``stats``.
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
        size = kv.numel()
        with self._lock:
            if self._pending_bytes + size > self.max_pending:
                self.counts["offers_dropped"] += len(pages)
                return
            self._pending_bytes += size
            self.counts["pages_offered"] += len(pages)
        self._writes.put((pages, kv))

    def fetch(self, job: Fetch) -> None:
        self._reads.put(job)

    def drain(self) -> None:
        """Wait until every write offered so far is stored."""
        self._writes.join()

    def close(self) -> None:
        """Store what is pending, stop the threads, close the stores."""
        self._writes.put(None)
        self._reads.put(None)
        for t in self._threads:
            t.join()
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
                self._write(*job)
            except Exception:  # a tier must never take the server down
                log.exception("KV tier write failed; pages dropped")
            finally:
                with self._lock:
                    self._pending_bytes -= job[1].numel()
                self._writes.task_done()
        self._writes.task_done()

    def _write(self, pages: list[tuple[PageRecord, int | None]], kv) -> None:
        rows = kv.numpy()
        names = [store_key(self.identity, rec.key) for rec, _ in pages]
        values: list[bytes] | None = None
        for store in self.stores:
            have = store.contains(names)
            todo = [i for i, h in enumerate(have) if not h]
            if not todo:
                continue
            if values is None:
                values = [
                    encode(self.identity, PageRecord(rec.key, rec.namespace, rec.chain, row))
                    for (rec, _), row in zip(pages, (r.tobytes() for r in rows))
                ]
            written = store.put([names[i] for i in todo], [values[i] for i in todo])
            evicted = store.take_evicted()
            with self._lock:
                self.counts[f"{store.medium}_bytes_written"] += written
                if written:
                    self.counts[f"{store.medium}_pages_stored"] += len(todo)
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
            try:
                found = self._read(job)
            except Exception:
                log.exception("KV tier read failed; a miss")
                found = []
            seconds = time.perf_counter() - t0
            with self._lock:
                if found:
                    self.load_seconds.append(seconds)
            self._done(job.stream, job.start, found, seconds)

    def _read(self, job: Fetch) -> list[bytes]:
        """KV of the longest run of ``job``'s pages the tiers hold, in order."""
        found: list[bytes] = []
        ps, n = self.page_size, len(job.keys)
        for store in self.stores:
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
                            with self._lock:
                                self.counts[f"{store.medium}_bad_values"] += 1
                        break
                    found.append(kv)
                    hits += 1
                with self._lock:
                    self.counts[f"{store.medium}_pages_queried"] += min(len(batch), hits + 1)
                    self.counts[f"{store.medium}_pages_hit"] += hits
                    self.counts[f"{store.medium}_bytes_read"] += hits * self.kv_len
                if hits < len(batch):
                    break
        return found
