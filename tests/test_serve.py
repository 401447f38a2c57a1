"""``mstar-kv serve`` on the tiny seeded model (token-id prompts, no
tokenizer): a real server on 127.0.0.1, driven by the official ``openai``
client and ``httpx``, its outputs checked against ``Engine.generate``."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servers import ServerThread, stream_token_ids, wait_until  # noqa: E402

from mstar.engine import Engine, SamplingParams  # noqa: E402
from mstar.models.seeded import build_model  # noqa: E402
from mstar.serve.app import create_app  # noqa: E402

MODEL = "random"
POOL = {"num_pages": 48, "page_size": 8, "token_budget": 64}
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 9)] for i in range(32)]
TOKENS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def models():
    """The seeded tiny Llama: a pristine copy to build engines from."""
    return build_model(0)[0]


def engine_of(models, **kwargs) -> Engine:
    return Engine(copy.deepcopy(models), **{**POOL, **kwargs})


@pytest.fixture(scope="module")
def offline(models):
    """``generate(prompts, params)`` through an offline engine of the same model."""
    engine = engine_of(models)
    return lambda prompts, params: engine.generate(prompts, params)


@pytest.fixture(scope="module")
def server(models):
    with ServerThread(create_app(engine_of(models), model_name=MODEL)) as srv:
        yield srv


def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)


def metric(srv: ServerThread, name: str) -> float:
    text = httpx.get(f"{srv.base}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def pages_used(srv: ServerThread) -> float:
    return metric(srv, 'mstar_kv_pages{state="used"}')


def streamed_ids(stream) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Token ids and finish reason per choice of a streamed completion."""
    ids: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            ids.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return ids, finish


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0, "max_tokens": 6},
        {"temperature": 0.9, "top_p": 0.9, "seed": 3, "n": 2, "max_tokens": 5, "top_k": 40},
    ],
    ids=["greedy", "seeded-n2"],
)
def test_completions_plain_and_streamed_equal_offline_generate(server, offline, params):
    sp = SamplingParams(
        max_new_tokens=params["max_tokens"],
        **{k: v for k, v in params.items() if k != "max_tokens"},
    )
    want = offline(PROMPTS[:3], sp)
    api = client(server)
    extra = {**TOKENS, "top_k": params.pop("top_k", 0)}  # vLLM's extensions
    for prompt, done in zip(PROMPTS[:3], want):
        got = api.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **params)
        assert got.object == "text_completion" and got.model == MODEL
        assert got.id.startswith("cmpl-") and got.created > 0
        assert [c.model_extra["token_ids"] for c in got.choices] == [
            o.token_ids for o in done.outputs
        ]
        assert [c.finish_reason for c in got.choices] == [o.finish_reason for o in done.outputs]
        assert got.usage.prompt_tokens == len(prompt)
        assert got.usage.completion_tokens == sum(len(o.token_ids) for o in done.outputs)
        stream = api.completions.create(
            model=MODEL, prompt=prompt, stream=True, extra_body=extra, **params
        )
        ids, finish = streamed_ids(stream)
        assert ids == {o.index: o.token_ids for o in done.outputs}
        assert finish == {o.index: o.finish_reason for o in done.outputs}


def test_raw_stream_is_server_sent_events_ending_in_done_with_usage(server):
    body = {
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]  # (earlier tests' prompt)
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert 0 <= cached < 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_streaming_clients_each_get_their_offline_output(server, offline):
    sp = SamplingParams(max_new_tokens=5)
    want = [c.outputs[0].token_ids for c in offline(PROMPTS, sp)]
    api = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)

    def one(prompt: list[int]):
        return stream_token_ids(
            api, prompt, model=MODEL, max_tokens=5, temperature=0, extra_body=TOKENS
        )

    async def all_of_them() -> list[list[int]]:
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await api.close()

    assert asyncio.run(all_of_them()) == want
    assert pages_used(server) == 0
    assert metric(server, "mstar_requests_running") == 0
    assert metric(server, "mstar_requests_waiting") == 0


def test_32_concurrent_clients_over_a_bfloat16_kv_cache_get_its_offline_output(models):
    """``serve --kv-cache-dtype bfloat16``: 32 streamed clients at once, each
    answered as the same engine answers offline, every page given back; a
    request's logprobs are the bfloat16 cache's, not a float32 one's."""
    engine = engine_of(models, kv_cache_dtype="bfloat16")
    offline = {d: engine_of(models, kv_cache_dtype=d) for d in ("bfloat16", "auto")}
    want = [
        c.outputs[0].token_ids
        for c in offline["bfloat16"].generate(PROMPTS, SamplingParams(max_new_tokens=5))
    ]
    one = SamplingParams(max_new_tokens=8, logprobs=1, ignore_eos=True)
    logprobs = {
        d: [r.chosen.logprob for r in e.generate(PROMPTS[5:6], one)[0].outputs[0].logprobs]
        for d, e in offline.items()
    }
    assert max(map(abs, np.subtract(logprobs["bfloat16"], logprobs["auto"]))) > 1e-4

    async def all_of_them(srv: ServerThread) -> list[list[int]]:
        api = openai.AsyncOpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(
                stream_token_ids(api, p, model=MODEL, max_tokens=5, temperature=0, extra_body=TOKENS)
                for p in PROMPTS
            ))  # fmt: skip
        finally:
            await api.close()

    with ServerThread(create_app(engine, model_name=MODEL)) as srv:
        assert asyncio.run(all_of_them(srv)) == want
        got = client(srv).completions.create(
            model=MODEL, prompt=PROMPTS[5], max_tokens=8, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            logprobs["bfloat16"], abs=1e-6
        )
        assert pages_used(srv) == 0


@pytest.fixture(scope="module")
def slow_server(models):
    """A server whose steps take at least 10 ms: 300 tokens take seconds."""
    engine = engine_of(models)
    step = engine.step

    def slow():
        time.sleep(0.01)
        return step()

    engine.step = slow
    with ServerThread(create_app(engine, model_name=MODEL)) as srv:
        yield srv


LONG = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 300, "temperature": 0}


def decoded(srv: ServerThread) -> int:
    """Tokens the server's engine has fed in decode rows so far."""
    return srv.app.state.engine.engine.stats.decode_tokens


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(slow_server):
    srv = slow_server
    before = decoded(srv)
    with httpx.stream(
        "POST", f"{srv.url}/completions", json={**LONG, **TOKENS, "stream": True}
    ) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break  # hang up: the response closes with the block
    assert chunks == 3
    assert wait_until(lambda: pages_used(srv) == 0, timeout=30)
    assert metric(srv, "mstar_requests_running") == 0
    assert decoded(srv) - before < LONG["max_tokens"] - 10  # aborted, not run to its end


def test_a_disconnected_non_streamed_request_is_aborted(slow_server):
    srv = slow_server
    before = decoded(srv)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/completions", json=LONG, timeout=0.5)
    assert wait_until(lambda: pages_used(srv) == 0, timeout=30)
    assert metric(srv, "mstar_requests_running") == 0
    assert decoded(srv) - before < LONG["max_tokens"] - 10


BAD = [
    ("{not json", 400, None),
    ("[1, 2]", 400, None),
    ({"prompt": PROMPTS[0], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPTS[0], "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": PROMPTS[0], "n": 0}, 400, "n"),
    ({"prompt": PROMPTS[0], "temperature": -0.5}, 400, "temperature"),
    ({"prompt": PROMPTS[0], "temperature": 2.5}, 400, "temperature"),  # OpenAI's [0, 2]
    ({"prompt": PROMPTS[0], "top_p": 0}, 400, "top_p"),
    ({"prompt": PROMPTS[0], "top_p": 1.5}, 400, "top_p"),
    ({"prompt": PROMPTS[0], "stream": "yes"}, 400, "stream"),
    ({"prompt": PROMPTS[0], "stop_token_ids": ["a"]}, 400, "stop_token_ids.0"),
    ({"prompt": PROMPTS[0], "model": "gpt-4o"}, 404, "model"),
    ({"prompt": [1, 256]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1.5]}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": PROMPTS[0], "suffix": "x"}, 400, "suffix"),
    ({"prompt": PROMPTS[0], "logprobs": 21}, 400, "logprobs"),
    ({"prompt": PROMPTS[0], "max_tokens": 600}, 400, "max_tokens"),
]


def test_a_body_without_model_is_refused_as_openai_refuses_it(server):
    r = httpx.post(f"{server.url}/completions", json={"prompt": PROMPTS[0]}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"
    assert "required" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, status, param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_gets_its_status_and_an_openai_error_naming_the_field(
    server, body, status, param
):
    content = body if isinstance(body, str) else json.dumps({"model": MODEL, **body})
    r = httpx.post(
        f"{server.url}/completions", content=content,
        headers={"content-type": "application/json"}, timeout=30,
    )  # fmt: skip
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["message"]
    assert pages_used(server) == 0 and metric(server, "mstar_requests_waiting") == 0


def test_bad_input_through_the_client_raises_its_typed_errors(server):
    api = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt=PROMPTS[0])
    with pytest.raises(openai.BadRequestError) as err:  # no tokenizer, no chat template
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "messages"
    # and it keeps serving
    assert api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2).choices


def test_a_request_that_can_never_fit_the_pool_gets_400_naming_its_pages(models):
    app = create_app(engine_of(models, num_pages=4), model_name=MODEL)
    with ServerThread(app) as srv:
        r = httpx.post(
            f"{srv.url}/completions",
            json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40},
            timeout=30,
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "request_too_large"
    assert re.search(r"needs \d+ KV pages", r.json()["error"]["message"])


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.base}/health", timeout=30).json() == {
        "status": "ok",
        "forward": "eager",
    }


def gated(engine: Engine) -> threading.Event:
    """Hold the engine's steps until the returned event is set."""
    gate, step = threading.Event(), engine.step

    def held():
        assert gate.wait(60), "the test never opened the gate"
        return step()

    engine.step = held
    return gate


def test_overload_gets_503_with_retry_after_at_once(models):
    engine = engine_of(models)
    gate = gated(engine)
    app = create_app(engine, model_name=MODEL, max_waiting=2, retry_after=3)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    with ServerThread(app) as srv, httpx.Client(timeout=30) as http:
        results: list[int] = []
        waiting = [
            threading.Thread(
                target=lambda: results.append(http.post(f"{srv.url}/completions", json=body).status_code)
            )
            for _ in range(2)
        ]  # fmt: skip
        for t in waiting:
            t.start()
        assert wait_until(lambda: metric(srv, "mstar_requests_waiting") == 2)
        r = http.post(f"{srv.url}/completions", json=body, timeout=5)  # the engine is held
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "overloaded"
        gate.set()
        for t in waiting:
            t.join(timeout=60)
        assert results == [200, 200]
        assert http.post(f"{srv.url}/completions", json=body).status_code == 200


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(models, offline):
    engine = engine_of(models)
    model, calls = engine.model, []
    forward = model.forward

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return forward(*args, **kwargs)

    model.forward = flaky
    with ServerThread(create_app(engine, model_name=MODEL)) as srv:
        body = {
            "model": MODEL,
            "prompt": PROMPTS[3],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", f"{srv.url}/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "server_error" and "injected fault" in error["message"]
        assert pages_used(srv) == 0
        api = client(srv)
        got = api.completions.create(
            model=MODEL, prompt=PROMPTS[4], max_tokens=6, temperature=0, extra_body=TOKENS
        )
        want = offline([PROMPTS[4]], SamplingParams(max_new_tokens=6))[0].outputs[0].token_ids
        assert got.choices[0].model_extra["token_ids"] == want
        assert pages_used(srv) == 0


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"], ids=["full", "windowed", "hybrid"])
def test_chat_default_max_tokens_is_the_most_the_pool_admits(name):
    """Chat without ``max_tokens`` asks for ``Front.room``: the most new
    tokens a request alone can be admitted with, whatever the model's KV
    layout: every page kept, pages released behind a window (the context is
    the bound), a hybrid's groups on one pool (counting pages as tokens
    over-asked there, so every such chat was refused)."""
    from types import SimpleNamespace

    from test_architectures import _pair
    from test_groups import HYBRID

    from mstar.engine import RequestTooLarge
    from mstar.serve.app import Front

    config = {
        "llama": ("LlamaConfig", {}),
        "mistral": ("MistralConfig", {"sliding_window": 5}),
        "gemma2": HYBRID["gemma2"],
    }[name]
    _, paged = _pair(*config)
    paged.config.max_position_embeddings = 512
    eng = Engine(paged, prefix_cache=False, num_pages=14, page_size=4, token_budget=8)
    room = Front(SimpleNamespace(engine=eng), None, "m", 1).room(10)
    prompt = list(range(1, 11))
    eng.add_request(prompt, SamplingParams(max_new_tokens=room), request_id="fits")
    eng.abort("fits")
    if name == "mistral":
        assert room == 512 - 10
        return
    # full: 14 pages of 4 hold 56 tokens, the last one never fed; hybrid: 42
    # pages of one layer, 36 in the full group and 3 in each windowed one
    # (its chunks are capped at the window)
    assert room == {"llama": 14 * 4 - 10 + 1, "gemma2": 36 * 4 - 10 + 1}[name]
    with pytest.raises(RequestTooLarge):
        eng.add_request(prompt, SamplingParams(max_new_tokens=room + 1))
