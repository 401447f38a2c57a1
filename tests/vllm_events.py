"""A KV-events subscriber written from vLLM's documented event structs
(``vllm.distributed.kv_events``: msgspec ``array_like`` tagged structs), to
check mstar-kv's events decode as vLLM's consumers decode them."""

from __future__ import annotations

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """What every event is."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """SUB on ``endpoint`` (topic ``topic``), DEALER on ``replay``; ``poll``
    decodes what came in (strictly: a bad message raises)."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "kv-events"):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = None
        if replay is not None:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: list[tuple[int, KVEventBatch]] = []

    def poll(self, timeout_ms: int = 200) -> int:
        """Receive every message waiting (within ``timeout_ms`` for the first)."""
        n = 0
        while self.sub.poll(timeout_ms if n == 0 else 50):
            _topic, seq, payload = self.sub.recv_multipart()
            self.batches.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
            n += 1
        return n

    def ask_replay(self, start: int, timeout_ms: int = 2000) -> list[tuple[int, KVEventBatch]]:
        assert self.replay is not None
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while self.replay.poll(timeout_ms):
            _, seq, payload = self.replay.recv_multipart()
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                return out
            out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        raise TimeoutError("no end of replay")

    def events(self) -> list:
        return [e for _, b in self.batches for e in b.events]

    def close(self) -> None:
        self.ctx.destroy(linger=0)
