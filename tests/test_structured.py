"""Structured outputs through xgrammar on SmolLM2: JSON schemas (nested
objects, enums, arrays) at temperature 0 and 1 parse and validate, in
Python and over HTTP (OpenAI's ``response_format``, vLLM's
``structured_outputs``); bad schemas are refused naming the problem."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servers import ServerThread  # noqa: E402

from mstar.engine import Engine, SamplingParams  # noqa: E402
from mstar.engine.sampling.structured import StructuredOutputs  # noqa: E402
from mstar.models.seeded import build_model  # noqa: E402
from mstar.serve.app import create_app  # noqa: E402

POOL = {"num_pages": 64, "page_size": 16}
NEW = 48
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "age"],
            }
        },
        "required": ["person"],
    },
    "enum": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
        "required": ["colour", "sure"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
}
ASK = [{"role": "user", "content": "Describe a person in JSON."}]


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tokenizer = smollm2
    return Engine(copy.deepcopy(model), tokenizer, **POOL)


def test_json_schema_outputs_parse_and_validate_at_temperature_0_and_1(engine):
    convs, params = [], []
    for schema in SCHEMAS.values():
        for temperature in (0.0, 1.0):
            convs.append(ASK)
            so = StructuredOutputs(json=schema)
            params.append(
                SamplingParams(
                    max_new_tokens=NEW, temperature=temperature, seed=7, structured_outputs=so
                )
            )
    done = engine.chat(convs, params)
    for c, p in zip(done, params):
        out = c.outputs[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), json.loads(p.structured_outputs.json))
    assert len(engine.pipeline.grammars._compiled) == len(SCHEMAS)  # compiled once per schema


def test_choice_regex_grammar_and_n_2_forks(engine):
    specs = [
        StructuredOutputs(choice=["yes", "no"]),
        StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"),
        StructuredOutputs(grammar='root ::= "up" | "down"'),
    ]
    params = [
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, n=2, structured_outputs=s)
        for s in specs
    ]
    done = engine.chat([ASK] * 3, params)
    for out in done[0].outputs:
        assert out.text in ("yes", "no")
    for out in done[1].outputs:
        assert len(out.text) == 6 and out.text[3] == "-" and out.text[:3].isdigit()
    for out in done[2].outputs:
        assert out.text in ("up", "down")


def test_a_bad_spec_or_no_tokenizer_is_refused_before_anything_is_queued(engine):
    with pytest.raises(ValueError, match="invalid structured_outputs json"):
        engine.add_request(
            "x", SamplingParams(structured_outputs=StructuredOutputs(json={"type": "objectx"}))
        )
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(json_object=True))
    ids_only = Engine(build_model(0)[1], num_pages=8)
    with pytest.raises(ValueError, match="tokenizer"):
        ids_only.add_request(
            [1, 2], SamplingParams(structured_outputs=StructuredOutputs(regex="a"))
        )
    assert not engine.has_unfinished() and not ids_only.has_unfinished()


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    app = create_app(Engine(copy.deepcopy(model), tokenizer, **POOL), model_name="smollm2")
    with ServerThread(app) as srv:
        yield srv


def test_response_format_and_structured_outputs_over_http(server):
    api = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    schema = SCHEMAS["enum"]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    got = api.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=NEW, temperature=0, response_format=fmt
    )
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    stream = api.chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=NEW,
        temperature=0,
        response_format=fmt,
        stream=True,
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == got.choices[0].message.content
    )
    ok = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    obj = api.chat.completions.create(
        model="smollm2",
        messages=ok,
        max_tokens=NEW,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = api.completions.create(
        model="smollm2", prompt="Is the sky blue?", max_tokens=8, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "response_format", "objectx"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a("}}, "response_format", "regex"),
    ],
)  # fmt: skip
def test_bad_structured_requests_get_400_naming_the_problem(server, body, param, message):
    r = httpx.post(
        f"{server.url}/chat/completions",
        json={"model": "smollm2", "messages": ASK, "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_bench_serve_measures_structured_output_beside_plain(server):
    import asyncio

    from mstar.bench.serve import (
        BURST,
        JSON_SCHEMA_BODY,
        STRUCTURED,
        format_serve,
        run_load,
        summarize,
    )

    samples, seconds = asyncio.run(
        run_load(server.url, "smollm2", 2, BURST, 8, lambda: None, JSON_SCHEMA_BODY)
    )
    assert all(s.error is None and s.tokens > 0 for s in samples)
    rows = [summarize(STRUCTURED, BURST, samples, seconds)]
    result = {"requests": 2, "max_tokens": 8, "threads": 2, "rows": rows, "peak_rss_bytes": {}}
    assert STRUCTURED in format_serve(result)


def test_a_preempted_constrained_request_keeps_its_matcher(smollm2):
    """A pool too small for three: requests are preempted and recomputed,
    their matchers untouched (accepted tokens are not chosen again)."""
    import re

    tokenizer = smollm2[1]
    model = build_model(0, vocab_size=len(tokenizer))[1]
    engine = Engine(model, tokenizer, num_pages=12, page_size=8, token_budget=16)
    params = SamplingParams(
        max_new_tokens=40,
        temperature=1.0,
        seed=2,
        structured_outputs=StructuredOutputs(regex="[0-9]{12}-[a-z]{4}"),
    )
    done = engine.generate([[5 + i] * 20 for i in range(3)], params)
    assert engine.stats.preemptions > 0
    for c in done:
        assert re.fullmatch("[0-9]{12}-[a-z]{4}", c.outputs[0].text), c.outputs[0].text


def test_logprobs_under_a_grammar_leave_out_masked_tokens(server):
    """Top logprobs past what the grammar allows would be -inf (not JSON)."""
    body = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
    }
    body["structured_outputs"] = {"choice": ["yes", "no"]}
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(1 <= len(e["top_logprobs"]) < 20 for e in content)


def test_the_mask_refuses_exactly_what_xgrammars_own_apply_refuses(engine):
    """``Grammars.mask``'s unpacked select and ``Grammars.allowed`` against
    xgrammar's reference apply, on rows mid-JSON (inside a string: most
    tokens allowed), mid-regex, unconstrained and at a start."""
    import torch
    import xgrammar

    grammars = engine.pipeline.grammars
    json_m = grammars.matcher(StructuredOutputs(json=SCHEMAS["nested"]))
    assert json_m.accept_string('{"person": {"name": "Al')
    regex_m = grammars.matcher(StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"))
    matchers = [json_m, None, regex_m, grammars.matcher(StructuredOutputs(json_object=True))]
    logits = torch.randn(len(matchers), grammars.vocab_size)
    want, before = logits.clone(), logits.clone()
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), grammars.vocab_size)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill_next_token_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(want, bitmask)
    got = grammars.mask(logits, matchers)
    assert torch.equal(got, want) and torch.equal(logits, before)
    assert torch.equal(got[1], logits[1]) and torch.isinf(got[[0, 2, 3]]).any(dim=1).all()
    for i in (0, 2, 3):  # the allowed ids alone, as a refused greedy draw reads them
        allowed = grammars.allowed(matchers[i])
        assert allowed.tolist() == torch.nonzero(~torch.isinf(want[i])).flatten().tolist()


def test_a_greedy_row_drawn_before_its_mask_takes_the_masked_argmax(engine):
    """Greedy rows without logprobs draw from the raw logits and are masked
    only when the grammar refuses the draw; with logprobs they are masked
    first. Both give the same tokens, in one batch, under a JSON schema and
    a required tool call (hermes' structural tag), the grammar refusing some
    of the raw draws (the unconstrained answer differs)."""
    from toolcases import SCHEMAS as TOOL_SCHEMAS

    from mstar.serve.tools.hermes import Hermes

    tag = Hermes().structural_tag(list(TOOL_SCHEMAS.items()), True, True)
    specs = [StructuredOutputs(json=SCHEMAS["nested"]), StructuredOutputs(structural_tag=tag)]
    params = [
        SamplingParams(max_new_tokens=NEW, temperature=0, logprobs=k, structured_outputs=so)
        for so in specs
        for k in (None, 0)
    ]
    free = engine.chat([ASK], SamplingParams(max_new_tokens=NEW, temperature=0))[0]
    done = [c.outputs[0] for c in engine.chat([ASK] * len(params), params)]
    for first, masked_first in zip(done[::2], done[1::2]):
        assert first.token_ids == masked_first.token_ids, (first.text, masked_first.text)
        assert first.token_ids[:4] != free.outputs[0].token_ids[:4]
    jsonschema.validate(json.loads(done[0].text), SCHEMAS["nested"])
    assert done[2].text.startswith('<tool_call>\n{"name": "'), done[2].text


def test_json_comes_on_one_line_with_json_dumps_separators(engine):
    """What docs/serving.md says of JSON output: one line, ``", "`` and
    ``": "`` between items (Python's ``json.dumps`` default), no other whitespace."""
    grammars = engine.pipeline.grammars
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for spec in (StructuredOutputs(json=schema), StructuredOutputs(json_object=True)):
        text = json.dumps({"a": 1, "b": [2, 3]} if spec.json_object else {"a": 1})
        assert grammars.matcher(spec).accept_string(text)
        for other in (text.replace(": ", ":"), text.replace(", ", ","), text.replace("{", "{ ")):
            if other != text:
                assert not grammars.matcher(spec).accept_string(other), other
