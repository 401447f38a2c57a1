"""Tool calling on a tiny seeded model whose tokenizer has a Hermes-style
chat template, driven by the clients agents are built on (openai,
langchain-openai, instructor): ``required`` and named choices always give
calls that parse and validate (the grammar, not the model, makes them);
streamed deltas add up to the non-streamed calls; bad tool fields get
OpenAI 400s naming the field, never a 5xx."""

from __future__ import annotations

import copy
import json
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

import toolcases  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from servers import ServerThread  # noqa: E402
from toolcases import ASK_WEATHER, HERMES_TEMPLATE, TOOLS, check_calls, same_calls  # noqa: E402

from mstar.engine import Engine  # noqa: E402
from mstar.serve.app import create_app  # noqa: E402

MODEL = "tiny-hermes"
NEW = 64


@pytest.fixture(scope="module")
def hermes_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = HERMES_TEMPLATE
    return t


@pytest.fixture(scope="module")
def server(hermes_tok, text_model):
    engine = Engine(copy.deepcopy(text_model), hermes_tok, num_pages=96, page_size=16)
    app = create_app(engine, model_name=MODEL)
    assert "hermes parser" in app.state.tools.describe()
    assert "chat template" in app.state.tools.describe()
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def create(api, **kwargs):
    return toolcases.create(api, MODEL, **({"max_tokens": NEW} | kwargs))


def streamed_calls(api, **kwargs):
    return toolcases.streamed_calls(api, MODEL, **({"max_tokens": NEW} | kwargs))


NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(
    "choice, parallel",
    [("required", False), (NAMED, True), ("required", True)],
    ids=["required", "named", "required-parallel"],
)
def test_required_and_named_calls_parse_and_validate_streamed_or_not(api, choice, parallel):
    got = create(api, tool_choice=choice, parallel_tool_calls=parallel)
    c = got.choices[0]
    made = c.message.tool_calls or []
    cut = (
        c.finish_reason == "length"
    )  # in the middle of a later parallel call: its arguments so far
    calls = check_calls(made[:-1] if cut else made)
    assert c.message.content is None
    assert len({(f.function.name, f.function.arguments) for f in made}) == len(made)  # no twice
    if not cut:
        assert c.finish_reason == "tool_calls"
        assert calls and (parallel or len(calls) == 1)
    else:
        assert parallel and made
    if choice == NAMED:
        assert [name for name, _ in calls] == ["add"]
    content, streamed, finish, usage = streamed_calls(
        api, tool_choice=choice, parallel_tool_calls=parallel
    )
    assert finish == c.finish_reason and (content or None) == c.message.content
    assert same_calls(streamed, c.message.tool_calls)
    assert usage.completion_tokens == got.usage.completion_tokens > 0


@pytest.mark.parametrize(
    "max_tokens", [3, 16, 32], ids=["in-markup", "before-arguments", "in-arguments"]
)
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_cut_by_max_tokens_gives_its_arguments_so_far(api, choice, max_tokens):
    got = create(api, tool_choice=choice, max_tokens=max_tokens)
    c = got.choices[0]
    assert c.finish_reason == "length" and c.message.content is None  # never the markup
    for call in c.message.tool_calls or []:
        assert call.function.name in ("add", "get_weather")
        assert "tool_call>" not in call.function.arguments
        assert call.function.arguments == "" or call.function.arguments.startswith("{")
    if choice == NAMED:  # its name is known from the first token
        assert [t.function.name for t in c.message.tool_calls] == ["add"]
    if max_tokens == 32:  # (this model's calls' arguments begin by then)
        assert (
            len(c.message.tool_calls) == 1 and len(c.message.tool_calls[0].function.arguments) > 1
        )
    content, streamed, finish, _ = streamed_calls(api, tool_choice=choice, max_tokens=max_tokens)
    assert content == "" and finish == "length"
    assert same_calls(streamed, c.message.tool_calls or [])


def test_auto_and_none_leave_text_as_content(api):
    for choice in ("auto", "none"):
        got = create(api, tool_choice=choice, max_tokens=12)
        c = got.choices[0]
        assert c.message.tool_calls is None and c.finish_reason == "length"
        content, calls, finish, _ = streamed_calls(api, tool_choice=choice, max_tokens=12)
        assert content == c.message.content and not calls and finish == "length"


def test_a_history_with_calls_and_their_results_is_served(api):
    first = create(api, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
    ]
    again = create(api, messages=messages, tool_choice="none", max_tokens=4)
    assert again.choices[0].message.content and again.choices[0].finish_reason == "length"


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_a_developer_turn_is_a_system_turn(api, tools):
    def prompt_ids(role: str) -> list[int]:
        messages = [{"role": role, "content": "Answer briefly."}, *ASK_WEATHER]
        extra = {"return_token_ids": True}
        got = create(api, messages=messages, max_tokens=1, extra_body=extra, tools=tools)
        return got.model_extra["prompt_token_ids"]

    assert prompt_ids("developer") == prompt_ids("system")


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_a_bad_role_is_refused_listing_every_accepted_role(server, tools):
    body = {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(f"{server.url}/chat/completions", json=body | {"tools": tools}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages.0.role"
    for role in ("system", "developer", "user", "assistant", "tool", "'robot'"):
        assert role in error["message"]


def test_chat_cache_salt_cached_tokens_and_the_context(api):
    ask = [{"role": "user", "content": "Tell me everything about the sea, the sky. " * 8}]

    def cached(**extra) -> int:
        got = create(api, messages=ask, tools=None, max_tokens=1, extra_body=extra or None)
        return got.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="chat-1") == 0
    assert cached(cache_salt="chat-2") == 0
    assert cached(cache_salt="chat-1") >= 64
    with pytest.raises(openai.BadRequestError) as err:
        create(api, messages=ask, tools=None, max_tokens=10**6)
    error = err.value.response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "in the messages, 1000000 in the completion" in error["message"]


def test_langchain_bind_tools_loop_and_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = lc.ChatOpenAI(
        model=MODEL, base_url=server.url, api_key="none", temperature=0, max_tokens=NEW,
        max_retries=0, timeout=120,
    )  # fmt: skip
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = bound.invoke(messages)
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    result = get_weather.invoke(ai.tool_calls[0]["args"])
    assert result.startswith("sunny in ")
    messages += [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages, max_tokens=4)
    assert isinstance(final.content, str) and final.content and not final.tool_calls

    class Person(BaseModel):
        name: Literal["Ada", "Alan"]
        age: int = Field(ge=0, le=99)

    person = llm.with_structured_output(Person, method="function_calling").invoke("Who?")
    assert isinstance(person, Person)


def test_instructor_tools_mode(server):
    instructor = pytest.importorskip("instructor")

    class Weather(BaseModel):
        city: Literal["Paris", "London"]
        celsius: int = Field(ge=-40, le=50)

    client = instructor.from_openai(
        openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120),
        mode=instructor.Mode.TOOLS,
    )
    got = client.chat.completions.create(
        model=MODEL, response_model=Weather, max_retries=0, max_tokens=NEW, temperature=0,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )  # fmt: skip
    assert isinstance(got, Weather)


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
BAD = [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}, "tool_choice": "required"},
     "response_format"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages.0.tool_call_id"),
    ({"messages": [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_2", "content": "1"}]},
     "messages.2.tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "add", "arguments": "[1]"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
     "messages.0.tool_calls.0"),
]  # fmt: skip


@pytest.mark.parametrize("body, param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_tool_fields_get_400_naming_the_field(server, body, param):
    full = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 2} | body
    r = httpx.post(f"{server.url}/chat/completions", json=full, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert server.app.state.engine.engine.has_unfinished() is False


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = st.sampled_from(["tools", "tool_choice", "parallel_tool_calls", "messages"])
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def tool_like() -> st.SearchStrategy:
    """Near-valid tool fields: each key of a valid one, replaced by noise."""
    function = st.fixed_dictionaries(
        {"name": st.sampled_from(["add", "", "x" * 70]) | JSONISH},
        optional={"parameters": st.sampled_from([{"type": "object"}, {"type": 3}]) | JSONISH,
                  "description": JSONISH, "strict": JSONISH},
    )  # fmt: skip
    tool = st.fixed_dictionaries({"type": st.just("function") | JSONISH, "function": function})
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "bot"]) | JSONISH},
        optional={"content": st.none() | st.text(max_size=5) | JSONISH,
                  "tool_calls": st.lists(st.just(CALL) | JSONISH, max_size=2),
                  "tool_call_id": st.just("call_1") | JSONISH},
    )  # fmt: skip
    return st.fixed_dictionaries(
        {},
        optional={"tools": st.lists(tool, max_size=2) | JSONISH,
                  "tool_choice": st.sampled_from(["none", "auto", "required", NAMED]) | JSONISH,
                  "parallel_tool_calls": JSONISH,
                  "messages": st.lists(message, min_size=1, max_size=3)},
    )  # fmt: skip


@FUZZ
@given(body=tool_like())
def test_fuzzed_tool_fields_get_4xx_or_a_completion_never_5xx(server, body):
    full = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 1} | body
    r = httpx.post(f"{server.url}/chat/completions", json=full, timeout=60)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    else:
        json.dumps(r.json()["choices"][0]["message"])


def test_the_agent_loop_in_the_serving_docs_runs(server, capsys):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    code = re.search(r"<!-- test: tools -->\n```python\n(.*?)^```", page, re.S | re.M).group(1)
    code = code.replace("http://127.0.0.1:8000/v1", server.url).replace('"smollm2"', repr(MODEL))
    scope: dict = {"__name__": "docs"}
    exec(compile(code, "serving.md", "exec"), scope)
    roles = [m["role"] for m in scope["messages"]]
    assert roles[:4] == ["user", "assistant", "tool", "assistant"], roles
    assert scope["messages"][2]["content"].startswith("sunny")


def test_bench_serve_has_a_tools_row_counting_tokens_of_held_back_calls(server):
    import asyncio

    from mstar.bench.serve import BURST, TOOLS, TOOLS_BODY, format_serve, run_load, summarize

    samples, seconds = asyncio.run(
        run_load(server.url, MODEL, 2, BURST, 8, lambda: None, TOOLS_BODY)
    )
    assert all(s.error is None and s.tokens == 8 and s.ttft is not None for s in samples)
    rows = [summarize(TOOLS, BURST, samples, seconds)]
    result = {"requests": 2, "max_tokens": 8, "threads": 2, "rows": rows, "peak_rss_bytes": {}}
    assert TOOLS in format_serve(result)
