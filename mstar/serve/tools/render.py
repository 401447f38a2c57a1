"""A conversation with tools as prompt ids: through the model's chat
template when it has a place for tools, else through the fallback.

The fallback (a template that ignores ``tools``, e.g. SmolLM2's): a system
block listing each function's JSON schema and how to call (``FALLBACK``
with the format's own syntax), joined to the first system message or
before the conversation; an assistant message's calls written in the
format after its content; a ``tool`` message as a ``user`` message
``<tool_response>\\n{content}\\n</tool_response>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mstar.serve.tools.format import ToolFormat

FALLBACK = (
    "# Tools\n\nYou may call one or more functions to answer. The functions, as JSON"
    " schemas, within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n{instructions}"
)
_PROBE = "mstar_probe_function"


class ToolPrompt:
    """Renders conversations with tools for one tokenizer and format;
    ``native``: whether the chat template writes the tools itself."""

    def __init__(self, tokenizer: Any, fmt: ToolFormat) -> None:
        self.tokenizer, self.fmt = tokenizer, fmt
        self.native = tokenizer is not None and _has_tools(tokenizer)

    def describe(self) -> str:
        """One line for the start-up log."""
        how = "the chat template's" if self.native else "the fallback system block's"
        return f"tool calls: {self.fmt.name} parser, tools rendered through {how}"

    def ids(self, messages: Sequence[Mapping], tools: Sequence[dict] | None) -> list[int]:
        """The prompt ids of ``messages`` (checked dicts: ``role``, ``content``
        (None or str), ``tool_calls`` (``(id, ParsedCall)`` pairs),
        ``tool_call_id``), the generation prompt added; ``tools``: OpenAI
        tool dicts or None. ``ValueError`` when the template refuses them."""
        from jinja2 import TemplateError

        try:
            if self.native:
                rendered = [_native(m) for m in messages]
                out = self.tokenizer.apply_chat_template(
                    rendered, tools=list(tools) if tools else None, add_generation_prompt=True
                )
            else:
                out = self.tokenizer.apply_chat_template(
                    self._fallback(messages, tools), add_generation_prompt=True
                )
        except TemplateError as err:  # the template's raise_exception: a bad conversation
            raise ValueError(f"the chat template refused the messages: {err}") from None
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    def _fallback(self, messages: Sequence[Mapping], tools: Sequence[dict] | None) -> list[dict]:
        out = []
        for m in messages:
            text = m["content"] or ""
            if m.get("tool_calls"):
                calls = self.fmt.write([c for _, c in m["tool_calls"]])
                text = f"{text}\n{calls}" if text else calls
            if m["role"] == "tool":
                out.append(
                    {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
                )
            else:
                out.append({"role": m["role"], "content": text})
        if tools:
            block = FALLBACK.format(
                tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools),
                instructions=self.fmt.instructions(),
            )
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out


def _native(m: Mapping) -> dict:
    """A message as HF chat templates take it (a call's arguments a dict)."""
    out: dict = {"role": m["role"], "content": m["content"] or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for call_id, c in m["tool_calls"]
        ]
    if m["role"] == "tool":
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _has_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes a probe function's name when given it."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    probe = {"type": "function", "function": {"name": _PROBE, "parameters": {"type": "object"}}}
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
    except Exception:  # a template that fails on tools has no place for them
        return False
    return _PROBE in text
