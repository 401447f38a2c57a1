"""logprobs, echo and penalties over HTTP, read by the official ``openai``
client (chat and completions, streamed and not), equal to the engine's own
records; a tiny random Llama over SmolLM2's tokenizer (text and bytes)."""

from __future__ import annotations

import copy

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servers import ServerThread  # noqa: E402

from mstar.engine import Engine, SamplingParams  # noqa: E402
from mstar.serve.app import create_app  # noqa: E402

POOL = {"num_pages": 64, "page_size": 8, "token_budget": 16}
ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def offline(text_model, tok):
    return Engine(copy.deepcopy(text_model), tok, **POOL)


@pytest.fixture(scope="module")
def server(text_model, tok):
    app = create_app(Engine(copy.deepcopy(text_model), tok, **POOL), model_name="m")
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def test_chat_logprobs_whole_and_streamed_equal_the_engines(api, offline, tok):
    want = offline.generate(
        [offline.encode_chat(ASK)], SamplingParams(max_new_tokens=6, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    kwargs = {"model": "m", "messages": ASK, "max_tokens": 6, "temperature": 0}
    kwargs |= {"logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    got = api.chat.completions.create(**kwargs)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == len(want.token_ids)
    for entry, rec, token in zip(content, want.logprobs, want.token_ids):
        assert entry.logprob == pytest.approx(rec.chosen.logprob, abs=1e-6)
        assert entry.token == tok.decode([token]) or "\ufffd" in tok.decode([token])
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [t.logprob for t in rec.top], abs=1e-6
        )
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.decode("utf-8", "replace").startswith(got.choices[0].message.content)
    streamed = []
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in streamed] == [
        (e.token, e.logprob, e.bytes) for e in content
    ]


def test_completions_echo_with_max_tokens_0_scores_the_prompt(api, offline, tok):
    """lm-eval's loglikelihood request: echo + logprobs, max_tokens 0."""
    text = "The capital of France is Paris"
    ids = tok.encode(text)
    want = offline.generate([ids], SamplingParams(max_new_tokens=1, prompt_logprobs=2))[0]
    got = api.completions.create(model="m", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = got.choices[0]
    assert choice.text == text and got.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [r.chosen.logprob for r in want.prompt_logprobs[1:]], abs=1e-6
    )
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]


def test_completions_logprobs_streamed_with_echo_equal_the_whole(api):
    body = {"model": "m", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    body |= {"logprobs": 1, "echo": True}
    whole = api.completions.create(**body).choices[0]
    tokens, logprobs, text = [], [], ""
    for chunk in api.completions.create(stream=True, **body):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
    assert text == whole.text and text.startswith("Hello there")
    assert tokens == whole.logprobs.tokens and logprobs == whole.logprobs.token_logprobs
    assert len(tokens) == 2 + 4  # "Hello", " there", then four generated


@pytest.mark.parametrize(
    "fields, params",
    [
        ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"presence_penalty": 1.5, "frequency_penalty": 0.5}),
        ({"logit_bias": {"42": 100}}, {"logit_bias": {42: 100}}),
        ({"extra_body": {"repetition_penalty": 1.8, "min_p": 0.1}}, {"repetition_penalty": 1.8, "min_p": 0.1}),
    ],
    ids=["presence-frequency", "logit-bias", "repetition-min-p"],
)  # fmt: skip
def test_penalties_and_biases_over_http_equal_the_engine(api, offline, tok, fields, params):
    prompt = "One two three one two three"
    want = offline.generate(prompt, SamplingParams(max_new_tokens=8, **params))[0].outputs[0]
    got = api.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0, **fields)
    assert got.choices[0].text == want.text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("chat/completions", {"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
        (
            "chat/completions",
            {"messages": ASK, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ("completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_logprobs_and_penalty_fields_get_400_naming_them(server, path, body, param):
    r = httpx.post(f"{server.url}/{path}", json={"model": "m", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_several_prompts_in_one_call_as_lm_eval_sends_them(api, server, tok):
    """lm-eval's local-completions: a list of token-id prompts, echo +
    logprobs + max_tokens 0; each choice equals that prompt's own call."""
    prompts = [tok.encode("The sky is blue"), tok.encode("Two plus two is four")]
    body = {"model": "m", "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    got = api.completions.create(prompt=prompts, **body)
    assert [c.index for c in got.choices] == [0, 1]
    for prompt, choice in zip(prompts, got.choices):
        alone = api.completions.create(prompt=prompt, **body).choices[0]
        assert choice.text == alone.text == tok.decode(prompt)
        assert choice.logprobs.token_logprobs == alone.logprobs.token_logprobs
    assert got.usage.prompt_tokens == sum(map(len, prompts)) and got.usage.completion_tokens == 0
    texts = api.completions.create(
        model="m", prompt=["Hello", "Bye"], max_tokens=2, n=2, temperature=0
    )
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]
    r = httpx.post(
        f"{server.url}/completions",
        json={"model": "m", "prompt": ["a", "b"], "stream": True},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
