"""The shared tier: pages in a Valkey or Redis server, read by every replica.

The server keeps its own budget (run it with ``maxmemory`` and
``maxmemory-policy allkeys-lru``). A server that stops answering is a miss
for every read and a dropped write, with one warning; it is tried again
``RETRY_S`` seconds later, so a dead store costs a request at most one
short timeout per retry period, never an error. Thread-safe (redis-py's
connection pool).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlparse

log = logging.getLogger(__name__)

RETRY_S = 5.0
TIMEOUT_S = 0.5


class RemoteStore:
    """Pages in the Valkey/Redis server at ``url`` (``redis://HOST:PORT[/DB]``)."""

    medium = "REMOTE"
    local = False  # a round trip: asked only off the engine thread

    def __init__(self, url: str) -> None:
        if urlparse(url).scheme not in ("redis", "rediss", "valkey"):
            raise ValueError(f"expected a store url redis://HOST:PORT, got {url!r}")
        try:
            import redis
        except ImportError as err:
            raise ImportError(
                "--kv-remote needs redis-py: pip install 'mstar-kv[kvtiers]'", name=err.name
            ) from None
        self.url = url
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url.replace("valkey://", "redis://", 1),
            socket_timeout=TIMEOUT_S,
            socket_connect_timeout=TIMEOUT_S,
        )
        self._lock = threading.Lock()
        self._down_until = 0.0  # monotonic time before which the store is not tried
        self.failures = 0

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> int:
        if not keys or not self._up():
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in zip(keys, values):
                pipe.set(key, value)
            pipe.execute()
        except self._errors as err:
            self._failed(err)
            return 0
        return sum(map(len, values))

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys or not self._up():
            return [None] * len(keys)
        try:
            return list(self._client.mget(keys))
        except self._errors as err:
            self._failed(err)
            return [None] * len(keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys or not self._up():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]
        except self._errors as err:
            self._failed(err)
            return [False] * len(keys)

    def discard(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (values that did not check out)."""
        if not keys or not self._up():
            return
        try:
            self._client.delete(*keys)
        except self._errors as err:
            self._failed(err)

    def take_evicted(self) -> list[str]:
        return []  # the server evicts on its own, unseen

    def describe(self) -> str:
        return f"store {self.url}"

    def close(self) -> None:
        self._client.close()

    def _up(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def _failed(self, err: BaseException) -> None:
        with self._lock:
            first = self._down_until == 0.0 or time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + RETRY_S
            self.failures += 1
        if first:
            log.warning(
                "KV store %s unavailable (%s): going on without it, retrying in %.0f s",
                self.url, err, RETRY_S,
            )  # fmt: skip
