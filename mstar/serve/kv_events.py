"""KV-cache events in vLLM's wire format, published over ZMQ.

A replica's prefix cache tells subscribers (llm-d's KV-cache indexer,
Dynamo's KV router, Ray's KV-aware routers, ``mstar.serve.router``) what it
holds: a ``BlockStored`` per page when it becomes a full cached page, a
``BlockRemoved`` when the cache evicts it, ``AllBlocksCleared`` when the
publisher starts (a restarted replica holds nothing).

Wire format (vLLM's ``vllm.distributed.kv_events``): a ZMQ PUB socket sends
multipart ``[topic, seq, payload]``, ``seq`` the batch number as 8 bytes
big-endian from 0, ``payload`` msgpack ``[ts, events, replica_rank]``; each
event an array tagged by its name (msgspec's ``array_like`` tagged structs):
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``. Block hashes are the prefix cache's 64-bit chain
keys (``kv/keys.py``: the same on every process and machine for the same
tokens and page size). A ROUTER replay socket answers a client's 8-byte
sequence number with every buffered batch from it on, ``[b"", seq,
payload]`` each, then ``[b"", -1 as 8 signed bytes, b""]``.

Pages stored to and removed from a tier below the pool (``kv/tiers``) are
published the same way with the tier's ``medium`` (``"DISK"``, ``"REMOTE"``),
the pool's own with the publisher's (``"CPU"``/``"GPU"``).

The engine thread only appends the registry's arrays to a list; a publisher
thread encodes and sends them, so events cost the plan path next to nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_TOPIC = "kv-events"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
FLUSH_S = 0.01  # the publisher's batching interval


@dataclass(frozen=True)
class EventsConfig:
    """Where replica ``rank`` publishes: ``endpoint``'s port + rank (and the
    replay socket's, when set), with ``topic``; ``buffer`` batches kept for replay."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = DEFAULT_TOPIC
    buffer: int = 10_000

    def for_rank(self, rank: int) -> tuple[str, str | None]:
        return offset_port(self.endpoint, rank), (
            offset_port(self.replay_endpoint, rank) if self.replay_endpoint else None
        )


def offset_port(endpoint: str, by: int) -> str:
    """``tcp://HOST:PORT`` with ``PORT + by``; ``ValueError`` for another shape."""
    head, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"expected an endpoint tcp://HOST:PORT, got {endpoint!r}")
    return f"{head}:{int(port) + by}"


def block_stored(
    keys: np.ndarray, parent_keys: np.ndarray, has_parent: np.ndarray, tokens: np.ndarray,
    medium: str,
) -> list[list]:  # fmt: skip
    """One ``BlockStored`` per page (the registry's ``stored`` arguments)."""
    size = tokens.shape[1]
    parents = [int(p) if has else None for p, has in zip(parent_keys.tolist(), has_parent.tolist())]
    return [
        ["BlockStored", [key], parent, row, size, None, medium]
        for key, parent, row in zip(keys.tolist(), parents, tokens.tolist())
    ]


BIND_WAIT_S = 10.0  # how long a replica waits for its rank's ports to be let go


def _bind(socket: Any, address: str) -> None:
    """``socket.bind(address)``, waiting up to ``BIND_WAIT_S`` while the
    address is in use: a replica replacing one of the same rank (a redeploy,
    a restart after a crash) may start before the old one's sockets close."""
    import errno

    import zmq

    deadline = time.monotonic() + BIND_WAIT_S
    while True:
        try:
            return socket.bind(address)
        except zmq.ZMQError as err:
            if err.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class KVEventPublisher:
    """The registry listener and the ZMQ sockets of one replica."""

    def __init__(self, config: EventsConfig, rank: int, medium: str = "CPU") -> None:
        import msgpack
        import zmq

        self.rank, self.medium, self.topic = rank, medium, config.topic.encode()
        self._pack = msgpack.Packer().pack
        self._ctx = zmq.Context()
        pub_at, replay_at = config.for_rank(rank)
        self._pub = self._ctx.socket(zmq.PUB)
        _bind(self._pub, pub_at)
        self._replay = None
        if replay_at is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            _bind(self._replay, replay_at)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer)
        self._seq = 0
        self._pending: list[tuple[str, tuple, str]] = [("cleared", (), medium)]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mstar-kv-events", daemon=True)
        self._thread.start()

    # --- the registry listener (the engine thread): append, nothing else ---------------

    def stored(self, keys, parent_keys, has_parent, tokens) -> None:
        self.tier_stored(self.medium, keys, parent_keys, has_parent, tokens)

    def removed(self, keys) -> None:
        self.tier_removed(self.medium, keys)

    # --- a tier's writer thread (kv/tiers' TierEvents), and the two above -------------

    def tier_stored(self, medium, keys, parent_keys, has_parent, tokens) -> None:
        args = (keys.copy(), parent_keys.copy(), has_parent.copy(), tokens.copy())
        with self._lock:
            self._pending.append(("stored", args, medium))

    def tier_removed(self, medium, keys) -> None:
        with self._lock:
            self._pending.append(("removed", (keys.copy(),), medium))

    # --- the publisher thread ----------------------------------------------------------

    def close(self) -> None:
        """Send what is pending, then close the sockets."""
        self._stop.set()
        self._thread.join()
        self._ctx.destroy(linger=100)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            self._publish()
            if stopping:
                return
            if self._replay is not None and poller.poll(FLUSH_S * 1000):
                self._serve_replay()
            elif self._replay is None:
                self._stop.wait(FLUSH_S)

    def _publish(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        events: list[list] = []
        for kind, args, medium in pending:
            if kind == "stored":
                events += block_stored(*args, medium)
            elif kind == "removed":
                events.append(["BlockRemoved", args[0].tolist(), medium])
            else:
                events.append(["AllBlocksCleared"])
        payload = self._pack([time.time(), events, self.rank])
        seq = self._seq.to_bytes(8, "big")
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self._pub.send_multipart((self.topic, seq, payload))

    def _serve_replay(self) -> None:
        client, _, start = self._replay.recv_multipart()
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def attach(engine: Any, publisher: KVEventPublisher) -> None:
    """Make ``publisher`` hear ``engine``'s prefix cache; ``ValueError`` when it has none."""
    if not engine.prefix_cache:
        raise ValueError("expected an engine with the prefix cache on for KV events, got it off")
    engine.mgr.pool.registry.listener = publisher
