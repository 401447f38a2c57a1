"""Mistral's format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from mstar.serve.tools.calls import ParsedCall, call_of, json_at, skip_space
from mstar.serve.tools.format import Function, ToolFormat, dumps


class Mistral(ToolFormat):
    name = "mistral"
    start = "[TOOL_CALLS]"
    separator = ", "
    opening = "[TOOL_CALLS]["

    def read_calls(self, text: str, at: int, names: Collection[str]) -> tuple[list, int]:
        calls: list[ParsedCall] = []
        pos = skip_space(text, at + len(self.start))
        if not text.startswith("[", pos):
            return calls, at
        pos, end = pos + 1, at
        while (found := json_at(text, pos)) is not None:
            call = call_of(found[0], names, ("arguments",))
            if call is None:
                break
            calls.append(call)
            end = pos = skip_space(text, found[1])
            if text.startswith("]", pos):
                return calls, pos + 1
            if not text.startswith(",", pos):
                break
            pos += 1
        return calls, end

    def write(self, calls: Sequence[ParsedCall]) -> str:
        inner = self.separator.join(f"{self.call_begin(c.name)}{c.arguments}}}" for c in calls)
        return f"{self.start}[{inner}]"

    def call_begin(self, name: str) -> str:
        return f'{{"name": {dumps(name)}, "arguments": '

    def structural_tag(
        self, functions: Sequence[Function], required: bool, parallel: bool
    ) -> dict[str, Any] | None:
        """The calls' list after ``[TOOL_CALLS]``: one tag around the
        separated calls of the JSON formats."""
        calls = super().structural_tag(functions, True, parallel)["format"]
        whole = {"type": "tag", "begin": f"{self.start}[", "content": calls, "end": "]"}
        if not required:
            whole = {
                "type": "triggered_tags", "triggers": [self.start], "tags": [whole],
                "stop_after_first": True,
            }  # fmt: skip
        return {"type": "structural_tag", "format": whole}
