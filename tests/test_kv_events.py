"""KV-cache events on ZMQ in vLLM's wire format, from one engine's prefix
cache, decoded by a subscriber written from vLLM's documented structs."""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from servers import wait_until
from vllm_events import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber

from mstar.engine import Engine, SamplingParams
from mstar.engine.resources.kv.keys import ChainHasher
from mstar.models.seeded import build_model
from mstar.serve import free_port
from mstar.serve.kv_events import EventsConfig, KVEventPublisher, attach, offset_port

PAGE = 4


@pytest.fixture(scope="module")
def model():
    return build_model(0)[0]


@pytest.fixture
def published(model):
    """An engine of 24 pages publishing as replica 1, and a subscriber."""
    base = free_port()
    config = EventsConfig(f"tcp://127.0.0.1:{base - 1}", f"tcp://127.0.0.1:{free_port() - 1}")
    engine = Engine(copy.deepcopy(model), num_pages=24, page_size=PAGE, token_budget=64)
    publisher = KVEventPublisher(config, rank=1)
    attach(engine, publisher)
    pub_at, replay_at = config.for_rank(1)
    sub = Subscriber(pub_at, replay_at)
    # a PUB drops what it sends before a SUB is connected: wait for the first batch
    assert wait_until(lambda: sub.poll(50) > 0 or bool(sub.ask_replay(0)), timeout=10)
    sub.batches.clear()
    yield engine, publisher, sub
    publisher.close()
    sub.close()


def collect(sub: Subscriber, publisher: KVEventPublisher) -> list:
    """Every event from sequence 0 on, through the replay socket (complete, in order)."""
    wait_until(lambda: not publisher._pending, timeout=5)
    batches = sub.ask_replay(0)
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(len(seqs)))
    assert all(b.data_parallel_rank == 1 for _, b in batches)
    return [e for _, b in batches for e in b.events]


def test_stored_pages_chain_and_carry_the_router_side_keys(published):
    engine, publisher, sub = published
    shared = list(range(1, 13))  # three full pages
    prompts = [[*shared, 50 + i, 60 + i, 70 + i, 80 + i, 90] for i in range(3)]
    engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0))
    events = collect(sub, publisher)
    assert isinstance(events[0], AllBlocksCleared)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == engine.mgr.prefix_stats()["pages_cached"] == 6  # 3 shared + 1 each
    assert engine.mgr.prefix_stats()["tails_cached"] == 3  # partial pages: never stored blocks
    by_key = {e.block_hashes[0]: e for e in stored}
    assert len(by_key) == len(stored), "a page stored twice"
    for e in stored:
        assert len(e.block_hashes) == 1 and e.block_size == PAGE and len(e.token_ids) == PAGE
        assert e.lora_id is None and e.medium == "CPU"
        assert e.parent_block_hash is None or e.parent_block_hash in by_key
    # each prompt's full pages: keys computed apart from the engine chain, as published
    hasher = ChainHasher(PAGE)
    for prompt in prompts:
        keys = hasher.page_keys(np.array(prompt)).hashes.tolist()
        for i, key in enumerate(keys):
            assert by_key[key].token_ids == prompt[i * PAGE : (i + 1) * PAGE]
            assert by_key[key].parent_block_hash == (keys[i - 1] if i else None)
    # the live subscriber saw the same messages
    sub.poll()
    assert [type(e) for e in sub.events()] == [type(e) for e in events[1:]]


def test_evictions_publish_block_removed_of_stored_pages(published):
    engine, publisher, sub = published
    params = SamplingParams(max_new_tokens=2, temperature=0)
    for i in range(8):  # distinct prompts of 4 pages: the 24-page pool must evict
        engine.generate([[(i * 31 + j) % 250 + 1 for j in range(17)]], params)
    events = collect(sub, publisher)
    stored = {e.block_hashes[0] for e in events if isinstance(e, BlockStored)}
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed, "no eviction"
    assert set(removed) <= stored and len(set(removed)) == len(removed)
    assert len(removed) == engine.mgr.prefix_stats()["pages_evicted"]
    live = stored - set(removed)
    assert len(live) == engine.mgr.prefix_stats()["pages_cached"]


def test_endpoints_offset_by_rank_and_bad_ones_are_refused():
    assert offset_port("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        offset_port("ipc:///tmp/x", 1)


def test_tier_stores_and_evictions_publish_with_their_medium(published, tmp_path):
    from mstar.engine.resources.kv import tiers as kv_tiers

    engine, publisher, sub = published
    tiers = kv_tiers.attach(engine, disk=tmp_path, disk_size=4 * 2300, offload="eager")
    tiers.io.events = publisher  # as a replica wires them
    for i in range(3):
        engine.generate(
            [[(i * 31 + j) % 250 + 1 for j in range(17)]], SamplingParams(max_new_tokens=2)
        )
    tiers.close()
    events = collect(sub, publisher)
    in_pool = {
        e.block_hashes[0] for e in events if isinstance(e, BlockStored) and e.medium == "CPU"
    }
    on_disk = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert on_disk and {e.block_hashes[0] for e in on_disk} <= in_pool
    assert all(len(e.token_ids) == PAGE for e in on_disk)
    gone = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK"
            for h in e.block_hashes]  # fmt: skip
    assert gone and set(gone) <= {e.block_hashes[0] for e in on_disk}


def test_a_replica_binds_its_port_once_the_one_it_replaces_lets_go(monkeypatch):
    """A port still held (the replica it replaces not yet closed) is waited
    for, then bound; one held past ``BIND_WAIT_S`` raises the bind error."""
    import socket
    import threading

    import zmq

    from mstar.serve import kv_events

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ctx = zmq.Context()
    try:
        old, new, third = (ctx.socket(zmq.PUB) for _ in range(3))
        old.bind(address)
        threading.Timer(0.3, old.close).start()
        kv_events._bind(new, address)  # raised EADDRINUSE at once before
        monkeypatch.setattr(kv_events, "BIND_WAIT_S", 0.2)
        with pytest.raises(zmq.ZMQError):
            kv_events._bind(third, address)
    finally:
        ctx.destroy(linger=0)
