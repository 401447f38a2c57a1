"""Hermes' format (Qwen 2.5/3, Hermes 2/3, and the fallback prompt):
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence

from mstar.serve.tools.calls import ParsedCall, call_of, skip_space
from mstar.serve.tools.format import ToolFormat, dumps


class Hermes(ToolFormat):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    call_end = "}\n</tool_call>"
    separator = "\n"

    def read_calls(self, text: str, at: int, names: Collection[str]) -> tuple[list, int]:
        calls: list[ParsedCall] = []
        pos = end = at
        while text.startswith(self.start, pos):
            close = text.find(self.end, pos)
            if close < 0:
                break
            try:
                call = call_of(
                    json.loads(text[pos + len(self.start) : close]), names, ("arguments",)
                )
            except ValueError:
                call = None
            if call is None:
                break
            calls.append(call)
            end = close + len(self.end)
            pos = skip_space(text, end)
        return calls, end

    def write(self, calls: Sequence[ParsedCall]) -> str:
        return "\n".join(f"{self.call_begin(c.name)}{c.arguments}{self.call_end}" for c in calls)

    def call_begin(self, name: str) -> str:
        return f'{self.start}\n{{"name": {dumps(name)}, "arguments": '
