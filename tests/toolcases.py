"""What the tool-calling tests share: tools with bounded arguments (a tiny
random model's calls end within a few dozen tokens), a Hermes-style chat
template (Qwen 2.5's shape), and checks of OpenAI ``tool_calls``."""

from __future__ import annotations

import json

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} of its arguments", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def create(api, model: str, **kwargs):
    """A greedy chat completion asking for the weather with ``TOOLS``."""
    args = {"model": model, "messages": ASK_WEATHER, "tools": TOOLS, "max_tokens": 64,
            "temperature": 0} | kwargs  # fmt: skip
    return api.chat.completions.create(**args)


def streamed_calls(api, model: str, **kwargs) -> tuple[str, list[dict], str, object]:
    """Content, calls (accumulated by index), finish reason and usage of a
    streamed ``create``."""
    content, calls, finish, usage = "", {}, None, None
    chunks = create(api, model, stream=True, stream_options={"include_usage": True}, **kwargs)
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": d.id, "type": d.type, "function": {}})
                if d.function.name:
                    call["function"]["name"] = d.function.name
                args = call["function"].get("arguments", "")
                call["function"]["arguments"] = args + (d.function.arguments or "")
    return content, [calls[k] for k in sorted(calls)], finish, usage


def same_calls(streamed: list[dict], whole: list) -> bool:
    """Whether accumulated streamed calls are the non-streamed ones (ids aside)."""
    return [(x["function"]["name"], x["function"]["arguments"]) for x in streamed] == [
        (x.function.name, x.function.arguments) for x in whole
    ] and all(x["id"].startswith("call_") and x["type"] == "function" for x in streamed)


def check_calls(calls: list, names: set[str] | None = None) -> list[tuple[str, dict]]:
    """``(name, arguments)`` of OpenAI ``tool_calls`` (client objects or
    dicts), each validated against its function's schema."""
    import jsonschema

    out = []
    for call in calls:
        c = call if isinstance(call, dict) else call.model_dump()
        assert c["type"] == "function" and c["id"].startswith("call_")
        name, args = c["function"]["name"], json.loads(c["function"]["arguments"])
        assert name in (names or SCHEMAS), name
        jsonschema.validate(args, SCHEMAS[name])
        out.append((name, args))
    return out
