"""``AsyncEngine`` without HTTP: coroutines share one engine thread; streams
equal ``Engine.generate``; stopping fails what is in flight."""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest

from mstar.engine import AsyncEngine, Engine, SamplingParams
from mstar.engine.async_engine import Overloaded, RequestFailed
from mstar.models.seeded import build_model

POOL = {"num_pages": 48, "page_size": 8, "token_budget": 32}
PROMPTS = [[(5 * i + j) % 250 + 1 for j in range(4 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def model():
    return build_model(1)[0]


def test_coroutines_share_the_engine_and_get_their_offline_outputs(model):
    params = SamplingParams(max_new_tokens=5)
    want = Engine(copy.deepcopy(model), **POOL).generate(PROMPTS, params)
    aengine = AsyncEngine(Engine(copy.deepcopy(model), **POOL))

    async def one(i: int) -> list[int]:
        stream = await aengine.add_request(PROMPTS[i], params, request_id=f"r{i}")
        outs = [c async for c in stream]
        assert outs[-1].finished and not any(c.finished for c in outs[:-1])
        return outs[-1].outputs[0].token_ids

    async def main() -> list[list[int]]:
        aengine.start()
        try:
            got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            assert not await aengine.run(lambda e: e.has_unfinished())
            return got
        finally:
            await aengine.stop()

    assert asyncio.run(main()) == [c.outputs[0].token_ids for c in want]


def test_bad_requests_raise_at_add_and_stop_fails_what_is_in_flight(model):
    engine = Engine(copy.deepcopy(model), **POOL)
    aengine = AsyncEngine(engine, max_waiting=1)
    gate, step = threading.Event(), engine.step

    def held():  # no step runs until the test opens the gate
        assert gate.wait(60)
        return step()

    engine.step = held

    async def main() -> None:
        assert not aengine.serving
        aengine.start()
        assert aengine.serving
        with pytest.raises(ValueError, match="prompt"):
            await aengine.add_request([], SamplingParams(), request_id="empty")
        long = SamplingParams(max_new_tokens=300)
        stream = await aengine.add_request(PROMPTS[0], long, request_id="long")
        with pytest.raises(Overloaded):  # "long" waits for its first token
            await aengine.add_request(PROMPTS[1], long, request_id="next")
        gate.set()
        await anext(stream)
        await aengine.stop()
        assert not aengine.serving
        with pytest.raises(RequestFailed, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(RuntimeError, match="stopped"):
            await aengine.run(lambda e: None)

    asyncio.run(main())
    assert not engine.has_unfinished()
    assert engine.mgr.num_free_pages == engine.mgr.num_pages


def test_a_prepared_request_is_added_in_the_visit_that_prepares_it(model):
    """``add_prepared``: the prompt and params are made on the engine thread
    and the request added before any other step runs (a chat rendered while
    others decode joins the next step, not the one after); what ``prepare``
    raises propagates with nothing queued."""
    engine = Engine(copy.deepcopy(model), **POOL)
    aengine = AsyncEngine(engine)
    seen: list[tuple[str, int]] = []
    step, add = engine.step, engine.add_request

    def counted():
        seen.append(("step", len(engine._running)))
        return step()

    def added(*args, **kwargs):
        seen.append(("add", len(engine._running)))
        return add(*args, **kwargs)

    engine.step, engine.add_request = counted, added
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)

    def prepare(e: Engine) -> tuple[list[int], SamplingParams]:
        assert threading.current_thread() is not threading.main_thread()
        seen.append(("prepare", len(e._running)))
        return PROMPTS[1], params

    def bad(e: Engine) -> tuple[list[int], SamplingParams]:
        raise ValueError("expected a good prompt")

    async def main() -> None:
        aengine.start()
        try:
            first = await aengine.add_request(PROMPTS[0], params, request_id="a")
            await first.__anext__()  # the engine is stepping "a" now
            second = await aengine.add_prepared(prepare, request_id="b")
            with pytest.raises(ValueError, match="good prompt"):
                await aengine.add_prepared(bad, request_id="c")
            assert aengine.num_waiting + aengine.num_running == 2

            async def drain(stream):
                return [c async for c in stream]

            await asyncio.gather(drain(first), drain(second))
        finally:
            await aengine.stop()

    asyncio.run(main())
    at = seen.index(("prepare", 1))
    assert seen[at + 1] == ("add", 1) and seen[at + 2] == ("step", 2)


def test_add_request_takes_a_cache_namespace(model):
    aengine = AsyncEngine(Engine(copy.deepcopy(model), **POOL))
    prompt = [(3 * j) % 200 + 1 for j in range(24)]  # 3 pages of 8

    async def cached(namespace: str, rid: str) -> int:
        params = SamplingParams(max_new_tokens=1)
        stream = await aengine.add_request(
            prompt, params, request_id=rid, cache_namespace=namespace
        )
        return [c async for c in stream][-1].cached_tokens

    async def main() -> list[int]:
        aengine.start()
        try:
            return [await cached(ns, f"r{i}") for i, ns in enumerate(("a", "b", "a"))]
        finally:
            await aengine.stop()

    assert asyncio.run(main()) == [0, 0, 23]
