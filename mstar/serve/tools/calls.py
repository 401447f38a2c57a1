"""What a tool-call parser reads out of generated text: calls, and the text
around them; the shared pieces of the JSON formats."""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    """One call: a function's ``name`` and its ``arguments`` (a JSON object's text)."""

    name: str
    arguments: str

    def openai(self, call_id: str | None = None) -> dict:
        """The call as OpenAI's ``tool_calls`` entry."""
        return {
            "id": call_id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Split:
    """Generated text read by a parser: ``content`` before the first call's
    start, the ``calls`` that follow it (complete and valid, in order), and
    the ``rest`` from the first block that is not one on. With no calls,
    ``content + rest`` is the whole text."""

    content: str
    calls: tuple[ParsedCall, ...]
    rest: str

    def message(self) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` of the assistant message: with calls, text
        that is only whitespace is no content (None)."""
        if not self.calls:
            return self.content + self.rest, []
        text = self.content + (self.rest if self.rest.strip() else "")
        return (text if text.strip() else None), list(self.calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_of(obj: object, names: Collection[str], keys: tuple[str, ...]) -> ParsedCall | None:
    """``{"name": ..., <one of keys>: {...}}`` naming one of ``names`` as a
    call; None for anything else."""
    if not isinstance(obj, dict) or len(obj) != 2 or obj.get("name") not in names:
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None or not isinstance(obj[key], dict):
        return None
    return ParsedCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))


def json_at(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON value starting at ``pos`` (whitespace skipped) and where it
    ends; None when there is none (yet)."""
    pos = skip_space(text, pos)
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
