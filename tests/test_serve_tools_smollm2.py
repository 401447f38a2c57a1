"""Tool calling on SmolLM2, whose chat template has no place for tools (the
fallback system block, Hermes' call format): one server for the module.
``required``, named and parallel calls parse and validate, streamed or
not; ``auto`` separates content and calls; the agent clients' loops run."""

from __future__ import annotations

import copy
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

import toolcases  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from servers import ServerThread  # noqa: E402
from test_serve_tools import NAMED  # noqa: E402
from toolcases import check_calls, same_calls  # noqa: E402

from mstar.engine import Engine  # noqa: E402
from mstar.serve.app import create_app  # noqa: E402

MODEL = "smollm2"
NEW = 48


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    app = create_app(
        Engine(copy.deepcopy(model), tokenizer, num_pages=128, page_size=16), model_name=MODEL
    )
    assert app.state.tools.describe() == (
        "tool calls: hermes parser, tools rendered through the fallback system block's"
    )
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)


def create(api, **kwargs):
    return toolcases.create(api, MODEL, **({"max_tokens": NEW} | kwargs))


@pytest.mark.parametrize(
    "choice, parallel", [("required", False), (NAMED, True), ("required", True)],
    ids=["required", "named", "required-parallel"],
)  # fmt: skip
def test_required_named_and_parallel_calls_validate_streamed_or_not(api, choice, parallel):
    got = create(api, tool_choice=choice, parallel_tool_calls=parallel)
    c = got.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.content is None
    calls = check_calls(c.message.tool_calls)
    assert parallel or len(calls) == 1
    if choice == NAMED:
        assert [name for name, _ in calls] == ["add"]
    content, streamed, finish, usage = toolcases.streamed_calls(
        api, MODEL, max_tokens=NEW, tool_choice=choice, parallel_tool_calls=parallel
    )
    assert finish == "tool_calls" and (content or None) == c.message.content
    assert same_calls(streamed, c.message.tool_calls)
    assert usage.completion_tokens == got.usage.completion_tokens


def test_auto_separates_content_and_calls(api):
    for seed in range(3):
        got = create(api, tool_choice="auto", temperature=1.0, seed=seed)
        c = got.choices[0]
        check_calls(c.message.tool_calls or [])
        assert "<tool_call>" not in (c.message.content or "") or c.finish_reason == "length"
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"


def test_langchain_loop_and_instructor_tools_mode(server):
    lc = pytest.importorskip("langchain_openai")
    instructor = pytest.importorskip("instructor")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = lc.ChatOpenAI(
        model=MODEL, base_url=server.url, api_key="none", temperature=0, max_tokens=NEW,
        max_retries=0, timeout=300,
    )  # fmt: skip
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke(messages)
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    messages += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]),
                                 tool_call_id=ai.tool_calls[0]["id"])]  # fmt: skip
    final = llm.bind_tools([get_weather]).invoke(messages, max_tokens=24)
    assert final.content or final.tool_calls

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    person = llm.with_structured_output(Person, method="function_calling").invoke(
        "Ada Lovelace was 36."
    )
    assert isinstance(person, Person)
    client = instructor.from_openai(
        openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300),
        mode=instructor.Mode.TOOLS,
    )
    got = client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=0, max_tokens=NEW, temperature=0,
        messages=[{"role": "user", "content": "Alan Turing was 41."}],
    )  # fmt: skip
    assert isinstance(got, Person)
