"""Llama 3.1/3.2's JSON format: ``{"name": ..., "parameters": {...}}``,
calls separated by ``; `` (``arguments`` read as well)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from mstar.serve.tools.calls import ParsedCall, call_of, json_at, skip_space
from mstar.serve.tools.format import ToolFormat, dumps


class Llama3Json(ToolFormat):
    name = "llama3_json"
    start = '{"name"'
    separator = "; "

    def read_calls(self, text: str, at: int, names: Collection[str]) -> tuple[list, int]:
        calls: list[ParsedCall] = []
        pos = end = at
        while (found := json_at(text, pos)) is not None:
            call = call_of(found[0], names, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            end = found[1]
            pos = skip_space(text, end)
            if not text.startswith(";", pos):
                break
            pos += 1
        return calls, end

    def write(self, calls: Sequence[ParsedCall]) -> str:
        return self.separator.join(
            f"{self.call_begin(c.name)}{c.arguments}{self.call_end}" for c in calls
        )

    def call_begin(self, name: str) -> str:
        return f'{{"name": {dumps(name)}, "parameters": '
