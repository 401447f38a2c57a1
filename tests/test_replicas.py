"""Two engine replicas of the tiny seeded model on Ray Serve (one local Ray
instance for the module), driven by the official ``openai`` client and
``httpx``: outputs against one engine's, errors against one server's, KV
events, routing by cached prefix against round-robin, a replica killed,
and a prefix one replica computed served to the other from a shared
Valkey/Redis store (a real server, ``tests/kvstore.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import random
import re
from dataclasses import replace

import httpx
import pytest

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from ray import serve  # noqa: E402
from servers import ServerThread, stream_token_ids, wait_until  # noqa: E402
from vllm_events import BlockRemoved, BlockStored, Subscriber  # noqa: E402

from mstar.engine import Engine, SamplingParams  # noqa: E402
from mstar.models.seeded import build_model  # noqa: E402
from mstar.serve import free_port  # noqa: E402
from mstar.serve.app import create_app  # noqa: E402
from mstar.serve.kv_events import EventsConfig  # noqa: E402
from mstar.serve.replicas import ReplicaConfig, Scaling, build_app  # noqa: E402

MODEL = "random"
POOL = {"num_pages": 48, "page_size": 8, "token_budget": 64}
CONFIG = ReplicaConfig(model=MODEL, pages=48, page_size=8, budget=64)
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 9)] for i in range(16)]
TOKENS = {"return_token_ids": True}
TIMEOUT_S = 60
KEYED = ("ray-key-a", "ray-key-b")


class Cluster:
    """A local Ray instance serving one application at a time on a free port."""

    def __init__(self) -> None:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        self.app: tuple | None = None
        self.events: EventsConfig | None = None

    def deploy(self, router: str, fresh: bool = False, **config) -> None:
        """Serve ``router``'s application, its replicas' ``ReplicaConfig``
        fields as ``config`` says (new replicas when ``fresh``: new ports)."""
        app = (router, sorted(config.items()))
        if app == self.app and not fresh:
            return
        base = free_port()  # replica i publishes on base - 1 + i
        self.events = EventsConfig(f"tcp://127.0.0.1:{base - 1}", f"tcp://127.0.0.1:{base + 9}")
        config = replace(CONFIG, kv_events=self.events, **config)
        serve.run(build_app(config, Scaling(replicas=2, router=router)), name="mstar-kv",
                  route_prefix="/")  # fmt: skip
        self.app = app
        # ready replicas reach the front's router a moment later: wait until it routes to both
        assert wait_until(lambda: len(self.replicas()) == 2, timeout=TIMEOUT_S, every=0.2)

    def replicas(self) -> list[dict]:
        auth = {"Authorization": f"Bearer {KEYED[0]}"}  # (no matter when keys are off)
        return httpx.get(f"{self.url}/replicas", headers=auth, timeout=TIMEOUT_S).json()["data"]

    def close(self) -> None:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def prefix_routed(cluster):
    cluster.deploy("prefix")
    return cluster


@pytest.fixture(scope="module")
def model():
    return build_model(0)[0]


@pytest.fixture(scope="module")
def offline(model):
    engine = Engine(copy.deepcopy(model), **POOL)
    return lambda prompts, params: engine.generate(prompts, params)


def client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url, api_key="none", max_retries=0, timeout=TIMEOUT_S)


def assert_greedy_as_offline(c, offline, n: int, max_tokens: int) -> None:
    """The first ``n`` prompts, one request each, complete as one engine offline."""
    api = client(c)
    want = offline(PROMPTS[:n], SamplingParams(max_new_tokens=max_tokens, temperature=0))
    for prompt, done in zip(PROMPTS[:n], want):
        got = api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=TOKENS
        )
        assert got.choices[0].token_ids == done.outputs[0].token_ids
        assert got.usage.prompt_tokens == len(prompt)


def test_greedy_outputs_equal_one_engines(prefix_routed, offline):
    assert_greedy_as_offline(prefix_routed, offline, 8, 6)


def test_concurrent_streams_each_get_their_offline_output(prefix_routed, offline):
    want = offline(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))

    def one(api, prompt):
        return stream_token_ids(
            api, prompt, model=MODEL, max_tokens=8, temperature=0, extra_body=TOKENS
        )

    async def all_of_them() -> list[list[int]]:
        api = openai.AsyncOpenAI(base_url=prefix_routed.url, api_key="none", max_retries=0)
        async with api:
            return await asyncio.gather(*(one(api, p) for p in PROMPTS))

    got = asyncio.run(asyncio.wait_for(all_of_them(), TIMEOUT_S))
    assert got == [d.outputs[0].token_ids for d in want]


BAD = [
    "{not json",
    {"prompt": PROMPTS[0], "temperature": -1},
    {"prompt": [1, 256]},
    {"prompt": []},
    {"messages": [{"role": "user", "content": "hi"}]},
    {"prompt": PROMPTS[0], "suffix": "x"},
    {"prompt": PROMPTS[0], "max_tokens": 600},
    {"prompt": PROMPTS[0], "model": "nope"},
]


def test_bad_requests_get_the_bodies_one_server_sends(prefix_routed, model):
    def post(url: str, body) -> tuple[int, dict]:
        content = body if isinstance(body, str) else json.dumps({"model": MODEL, **body})
        path = "chat/completions" if "messages" in body else "completions"
        r = httpx.post(f"{url}/{path}", content=content, timeout=TIMEOUT_S,
                       headers={"content-type": "application/json"})  # fmt: skip
        return r.status_code, json.loads(re.sub(r"cmpl-[0-9a-f]{32}", "ID", r.text))

    engine = Engine(copy.deepcopy(model), **POOL)
    with ServerThread(create_app(engine, model_name=MODEL)) as one:
        for body in BAD:
            status, error = post(prefix_routed.url, body)
            assert (status, error) == post(one.url, body), body
            assert status in (400, 404)


def generated(c: Cluster) -> float:
    text = httpx.get(f"{c.base}/metrics", timeout=TIMEOUT_S).text
    return sum(
        float(v) for v in re.findall(r"^mstar_generation_tokens_total{.*} (\S+)$", text, re.M)
    )


def test_clients_that_disconnect_have_their_requests_aborted(prefix_routed):
    """Twelve long streams (one runs at a time per replica), all dropped once
    their responses began: the replicas stop them, well short of their tokens."""
    before = generated(prefix_routed)
    body = {"model": MODEL, "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip

    async def run() -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as http, contextlib.AsyncExitStack() as s:
            for p in PROMPTS[:12]:
                url = f"{prefix_routed.url}/completions"
                await s.enter_async_context(http.stream("POST", url, json={**body, "prompt": p}))

    asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert wait_until(
        lambda: not any(s["running"] or s["waiting"] for s in prefix_routed.replicas()),
        timeout=TIMEOUT_S,
    )
    assert generated(prefix_routed) - before < 12 * 300 / 2


def test_events_decode_and_chain_across_both_replicas(prefix_routed):
    api = client(prefix_routed)
    endpoints = [prefix_routed.events.for_rank(rank) for rank in (0, 1)]
    subs = [Subscriber(pub, replay) for pub, replay in endpoints]
    try:
        for i in range(6):  # two system prompts of three pages
            prompt = [*range(10 + i % 2 * 50, 34 + i % 2 * 50), 200 + i, 201 + i]
            api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        stats = {s["rank"]: s for s in prefix_routed.replicas()}
        for rank, sub in enumerate(subs):
            batches = sub.ask_replay(0)  # everything this replica published, decoded
            assert [seq for seq, _ in batches] == list(range(len(batches)))
            assert all(b.data_parallel_rank == rank for _, b in batches)
            events = [e for _, b in batches for e in b.events]
            stored = {e.block_hashes[0]: e for e in events if isinstance(e, BlockStored)}
            live: set[int] = set()  # what the events say the replica holds
            for e in events:
                if isinstance(e, BlockStored):
                    live.add(e.block_hashes[0])
                elif isinstance(e, BlockRemoved):
                    assert set(e.block_hashes) <= live
                    live -= set(e.block_hashes)
            assert len(live) == stats[rank]["pages_cached"]
            for e in stored.values():
                assert e.parent_block_hash is None or e.parent_block_hash in stored
    finally:
        for sub in subs:
            sub.close()


def shared_prefix_workload(seed: int = 0) -> list[list[int]]:
    """Four system prompts of four pages, six questions each, shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 250) for _ in range(32)] for _ in range(4)]
    prompts = [[*s, *(rng.randrange(1, 250) for _ in range(5))] for s in systems for _ in range(6)]
    rng.shuffle(prompts)
    return prompts


def pages_computed(c: Cluster, prompts: list[list[int]]) -> tuple[int, int]:
    """Pages the replicas cached (none is evicted: each holds them all) and
    prompt tokens they computed, serving ``prompts`` one after another."""
    before = c.replicas()
    api = client(c)
    for prompt in prompts:
        api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = c.replicas()
    assert all(s["pages_evicted"] == 0 for s in after)
    pages = sum(s["pages_cached"] for s in after) - sum(s["pages_cached"] for s in before)
    computed = sum(s["tokens_queried"] - s["tokens_hit"] for s in after)
    return pages, computed - sum(s["tokens_queried"] - s["tokens_hit"] for s in before)


def one_engine_pages(model, prompts) -> tuple[int, int]:
    engine = Engine(copy.deepcopy(model), **POOL)
    for prompt in prompts:
        engine.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0))
    stats = engine.mgr.prefix_stats()
    return stats["pages_cached"], stats["tokens_queried"] - stats["tokens_hit"]


def test_the_prefix_router_computes_about_what_one_replica_would(prefix_routed, model):
    prefix_routed.deploy("prefix", fresh=True)  # empty caches
    prompts = shared_prefix_workload(seed=1)
    alone_pages, alone_tokens = one_engine_pages(model, prompts)
    pages, tokens = pages_computed(prefix_routed, prompts)
    assert pages <= 1.2 * alone_pages, (pages, alone_pages)
    assert tokens <= 1.2 * alone_tokens, (tokens, alone_tokens)
    assert min(s["pages_cached"] for s in prefix_routed.replicas()) > 0  # both used


def test_a_replica_killed_mid_run_fails_its_requests_and_the_next_ones_succeed(
    prefix_routed, offline
):
    """12 long streams (the pool runs one at a time per replica); one replica
    is killed while they run: its streams end in an error, the others'
    finish, nothing hangs, and the next requests succeed."""
    long = {"max_tokens": 300, "temperature": 0}

    async def one(api, prompt) -> int:
        extra = {"ignore_eos": True, **TOKENS}
        return len(await stream_token_ids(api, prompt, model=MODEL, **long, extra_body=extra))

    async def run() -> list:
        api = openai.AsyncOpenAI(base_url=prefix_routed.url, api_key="none", max_retries=0)
        async with api:
            tasks = [asyncio.create_task(one(api, p)) for p in PROMPTS[:12]]
            while not all(s["running"] for s in await asyncio.to_thread(prefix_routed.replicas)):
                await asyncio.sleep(0.05)
            victim = (await asyncio.to_thread(prefix_routed.replicas))[0]["id"]
            name = next(
                a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if victim in a["name"]
            )  # fmt: skip
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(run(), 2 * TIMEOUT_S))  # a loaded machine: slack
    failed = [r for r in results if isinstance(r, Exception)]
    assert failed and len(failed) < len(results), results
    assert all(isinstance(r, openai.APIError) for r in failed), failed
    assert all(r == 300 for r in results if not isinstance(r, Exception))
    assert_greedy_as_offline(prefix_routed, offline, 4, 4)
    assert wait_until(lambda: len(prefix_routed.replicas()) == 2, timeout=TIMEOUT_S)


def test_round_robin_computes_about_twice_as_many_pages(cluster, model):
    cluster.deploy("round-robin")
    prompts = shared_prefix_workload(seed=1)
    alone_pages, _ = one_engine_pages(model, prompts)
    pages, _ = pages_computed(cluster, prompts)
    assert 1.8 * alone_pages <= pages <= 2 * alone_pages, (pages, alone_pages)


CONTEXT = [(11 * j) % 250 + 1 for j in range(5 * CONFIG.page_size)]  # five full pages


def tier_pages(c: Cluster) -> dict[tuple[str, str, str], float]:
    """``mstar_kv_tier_pages_total`` by (replica rank, tier, event), from the front's /metrics."""
    text = httpx.get(f"{c.base}/metrics", timeout=TIMEOUT_S).text
    out = {}
    for labels, value in re.findall(r"^mstar_kv_tier_pages_total{(.*)} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[got["replica"], got["tier"], got["event"]] = float(value)
    return out


def complete(c: Cluster, prompt: list[int]) -> list[int]:
    done = client(c).completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=TOKENS
    )
    return done.choices[0].token_ids


def stored_by_one(c: Cluster, tier: str) -> str:
    """The rank of the one replica whose pages of ``CONTEXT`` reach ``tier``."""
    full = len(CONTEXT) // CONFIG.page_size

    def stored() -> list[str]:
        got = tier_pages(c)
        return [r for r in ("0", "1") if got.get((r, tier, "stored"), 0) >= full]

    assert wait_until(lambda: stored(), timeout=TIMEOUT_S, every=0.2)
    (rank,) = stored()
    return rank


def test_a_second_replica_reads_the_prefix_from_the_store(cluster, store, tmp_path, offline):
    """Round-robin: the context goes to one replica, which stores its pages
    as they fill, then to the other, which loads them from the store (and
    copies them to its own disk) instead of computing them."""
    cluster.deploy("round-robin", kv_remote=store.url, kv_offload="eager", kv_disk=str(tmp_path))
    first = complete(cluster, CONTEXT)
    a = stored_by_one(cluster, "remote")
    second = complete(cluster, CONTEXT)  # the other replica's turn
    b = "1" if a == "0" else "0"
    want = offline([CONTEXT], SamplingParams(max_new_tokens=6, temperature=0))
    assert first == second == want[0].outputs[0].token_ids
    got = tier_pages(cluster)
    loaded = (len(CONTEXT) - 1) // CONFIG.page_size  # the pages before the last token's
    assert got[b, "remote", "hit"] == loaded and got.get((a, "remote", "hit"), 0) == 0
    stats = {str(s["rank"]): s for s in cluster.replicas()}
    assert stats[b]["tokens_hit"] == loaded * CONFIG.page_size
    assert wait_until(lambda: tier_pages(cluster).get((b, "disk", "promoted"), 0) == loaded)
    assert len(list((tmp_path / f"replica-{b}").glob("*.kvpage"))) >= loaded


def test_the_prefix_router_still_prefers_the_replica_holding_the_prefix(cluster, store):
    cluster.deploy("prefix", kv_remote=store.url, kv_offload="eager")
    complete(cluster, CONTEXT)
    a = stored_by_one(cluster, "remote")  # the other could load it from the store now
    before = {str(s["rank"]): s for s in cluster.replicas()}
    for suffix in ([], [3, 4, 5]):
        complete(cluster, CONTEXT + suffix)
    after = {str(s["rank"]): s for s in cluster.replicas()}
    b = "1" if a == "0" else "0"
    assert after[b]["tokens_queried"] == before[b]["tokens_queried"]  # never asked
    assert after[a]["tokens_hit"] - before[a]["tokens_hit"] >= 2 * 4 * CONFIG.page_size
    assert all(v == 0 for (_, tier, event), v in tier_pages(cluster).items() if event == "hit")


def test_the_front_asks_for_a_key_and_each_key_caches_apart(cluster):
    cluster.deploy("prefix", api_key=KEYED)
    prompt = [(13 * j) % 250 + 1 for j in range(40)]  # 5 pages of 8

    def cached(key: str) -> int:
        api = openai.OpenAI(base_url=cluster.url, api_key=key, max_retries=0, timeout=TIMEOUT_S)
        got = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        return got.usage.prompt_tokens_details.cached_tokens

    with pytest.raises(openai.AuthenticationError) as err:
        cached("nope")
    assert err.value.response.json()["error"]["code"] == "invalid_api_key"
    assert cached(KEYED[0]) == 0
    assert cached(KEYED[1]) == 0  # the same prompt, another key: its KV apart
    assert cached(KEYED[0]) >= 32  # (routed to the replica holding the prefix)
