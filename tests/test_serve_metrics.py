"""Outputs and metrics under prompts that span several prefill chunks: a
step hands out only requests that got tokens; ``AsyncEngine`` marks the first
output at the first token (so a request in prefill still waits); ``/metrics``
counts each request's prompt and first token once, each token once."""

from __future__ import annotations

import asyncio
import copy
import re
import threading

import httpx
import pytest

from mstar.engine import AsyncEngine, Engine, SamplingParams
from mstar.engine.async_engine import Overloaded
from mstar.models.seeded import build_model

POOL = {"num_pages": 32, "page_size": 8, "token_budget": 8}
LONG = [(3 * j) % 250 + 1 for j in range(40)]  # 5 prefill chunks of 8
NEW = 3


@pytest.fixture(scope="module")
def model():
    return build_model(0)[0]


def engine_of(model) -> Engine:
    return Engine(copy.deepcopy(model), **POOL)


def test_step_hands_out_only_requests_that_got_tokens(model):
    engine = engine_of(model)
    engine.add_request(LONG, SamplingParams(max_new_tokens=NEW), request_id="long")
    handed = []
    while engine.has_unfinished():
        handed.append([len(c.outputs[0].token_ids) for c in engine.step()])
    assert handed == [[], [], [], [], [1], [2], [3]]


def test_stream_yields_no_empty_completion(model):
    outs = list(engine_of(model).stream([LONG], SamplingParams(max_new_tokens=NEW)))
    assert [len(c.outputs[0].token_ids) for c in outs] == [1, 2, 3]


def counted_steps(engine: Engine, allowed: threading.Semaphore) -> None:
    """Each engine step first takes one of ``allowed``."""
    step = engine.step

    def held():
        assert allowed.acquire(timeout=60), "the test never allowed the step"
        return step()

    engine.step = held


def test_a_request_in_prefill_still_waits_and_counts_toward_max_waiting(model):
    engine = engine_of(model)
    allowed = threading.Semaphore(0)
    counted_steps(engine, allowed)
    aengine = AsyncEngine(engine, max_waiting=1)
    params = SamplingParams(max_new_tokens=NEW)

    async def main() -> None:
        aengine.start()
        try:
            stream = await aengine.add_request(LONG, params, request_id="long")
            for _ in range(2):  # two of its five prefill chunks
                allowed.release()
            while engine.stats.steps < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # what those steps handed out is delivered
            assert stream.first_output is None
            assert aengine.num_waiting == 1 and aengine.num_running == 0
            with pytest.raises(Overloaded):
                await aengine.add_request(LONG[:4], params, request_id="next")
            for _ in range(10):
                allowed.release()
            outs = [c async for c in stream]
            assert stream.first_output is not None
            assert [len(c.outputs[0].token_ids) for c in outs] == [1, 2, 3]
        finally:
            for _ in range(100):
                allowed.release()
            await aengine.stop()

    asyncio.run(main())


def scrape(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M)}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_metrics_count_a_long_prompt_once(model, streamed):
    pytest.importorskip("fastapi")
    from servers import ServerThread

    from mstar.serve.app import create_app

    body = {
        "model": "random",
        "prompt": LONG,
        "max_tokens": NEW,
        "temperature": 0,
        "stream": streamed,
    }
    with ServerThread(create_app(engine_of(model), model_name="random")) as srv:
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{srv.url}/completions", json=body)
            assert r.status_code == 200
        got = scrape(srv.base)
    assert got["mstar_prompt_tokens_total"] == len(LONG)
    assert got["mstar_generation_tokens_total"] == NEW
    assert got["mstar_time_to_first_token_seconds_count"] == 1
    assert got["mstar_requests_waiting"] == 0 and got["mstar_requests_running"] == 0
    assert got["mstar_step_seconds_count"] == len(LONG) // POOL["token_budget"] + NEW - 1
