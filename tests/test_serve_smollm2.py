"""``mstar-kv serve`` on SmolLM2 with its tokenizer and chat template:
text and chat, plain and streamed, equal ``Engine.generate``; a multi-byte
answer streams whole characters; a stop string spanning tokens ends it."""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib.util

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servers import ServerThread  # noqa: E402

from mstar.engine import Engine, SamplingParams  # noqa: E402
from mstar.serve.app import create_app  # noqa: E402

MODEL = "smollm2"
POOL = {"num_pages": 64, "page_size": 16}


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def offline(smollm2):
    model, tokenizer = smollm2
    return Engine(copy.deepcopy(model), tokenizer, **POOL)


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    app = create_app(Engine(copy.deepcopy(model), tokenizer, **POOL), model_name=MODEL)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def answer(offline: Engine, messages: list[dict], **params):
    ids = offline.encode_chat(messages)
    return offline.generate([ids], SamplingParams(**params))[0].outputs[0]


def stream_chat(api, messages: list[dict], **kwargs) -> tuple[list[str], str | None, dict]:
    """Content deltas, finish reason and the usage chunk's usage of a streamed chat."""
    deltas, finish, usage, roles = [], None, None, []
    stream = api.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, stream=True,
        stream_options={"include_usage": True}, **kwargs,
    )  # fmt: skip
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert roles[0] == "assistant" and set(roles[1:]) <= {None}
    return deltas, finish, usage


def test_chat_plain_and_streamed_equal_offline_generate(api, offline):
    messages = ask("What is the capital of France?")
    want = answer(offline, messages, max_new_tokens=20)
    got = api.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(offline.encode_chat(messages))
    deltas, finish, usage = stream_chat(api, messages, max_tokens=20)
    assert "".join(deltas) == want.text and finish == want.finish_reason
    assert usage.completion_tokens == len(want.token_ids)


def test_completion_of_a_string_prompt_equals_offline_generate(api, offline):
    prompt = "The three primary colors are"
    want = offline.generate([prompt], SamplingParams(max_new_tokens=12))[0].outputs[0]
    got = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    stream = api.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_a_multi_byte_answer_streams_whole_characters(api, offline):
    messages = ask("Reply with a single emoji for a happy face.")
    want = answer(offline, messages, max_new_tokens=6)  # two emojis of three tokens each
    pieces = [offline.tokenizer.decode([t]) for t in want.token_ids]
    assert want.text and all("\ufffd" in p for p in pieces)  # each token a broken piece
    deltas, _, _ = stream_chat(api, messages, max_tokens=6)
    assert "".join(deltas) == want.text
    assert not any("\ufffd" in d for d in deltas)


def test_a_stop_string_spanning_tokens_ends_the_answer_before_it(api, offline):
    messages = ask("Write one sentence about autumn.")
    full = answer(offline, messages, max_new_tokens=24)
    pieces = [offline.tokenizer.decode([t]) for t in full.token_ids]
    # the end of one token and the start of the next, both at least 2 characters
    k = next(
        i for i in range(2, len(pieces) - 1) if len(pieces[i].strip()) > 2 < len(pieces[i + 1])
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    want = full.text[: full.text.index(stop)]
    got = api.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24, stop=[stop, "never seen"]
    )
    assert got.choices[0].message.content == want
    assert got.choices[0].finish_reason == "stop"
    deltas, finish, _ = stream_chat(api, messages, max_tokens=24, stop=stop)
    assert "".join(deltas) == want and finish == "stop"


def test_bench_load_generator_measures_every_request(server, tmp_path):
    from mstar.bench.serve import BURST, format_serve, run_load, summarize

    rows = []
    for rate in (BURST, 20.0):
        ticks: list[int] = []
        samples, seconds = asyncio.run(
            run_load(
                server.url, MODEL, 4, rate, max_tokens=3, tick=functools.partial(ticks.append, 1)
            )
        )
        assert len(ticks) == 4 and all(s.error is None for s in samples)
        assert all(s.tokens == 3 and 0 < s.ttft <= s.latency for s in samples)
        rows.append(summarize("ours", rate, samples, seconds))
    assert [r["completed"] for r in rows] == [4, 4]
    assert all(r["output_tokens"] == 12 and None not in r["ttft_s"] + r["tpot_s"] for r in rows)
    result = {"requests": 4, "max_tokens": 3, "threads": 2, "rows": rows, "peak_rss_bytes": {}}
    table = format_serve(result)
    assert "ours" in table and "burst" in table and "20.0" in table
    named = {**result, "cpu": "AMD EPYC (AVX2; ...)", "modes": {"ours": "mstar-kv: float32 ..."}}
    lines = format_serve(named).splitlines()
    assert lines[1] == "CPU: AMD EPYC (AVX2; ...)" and lines[3].startswith("---")
    assert "ours: mstar-kv: float32 ..." in lines
    if importlib.util.find_spec("matplotlib"):
        from mstar.bench.serve import plot_serve

        plot_serve(result, str(tmp_path / "serve.png"))
        assert (tmp_path / "serve.png").stat().st_size > 0
