"""A tool-call format: how a model family writes calls (``ToolFormat``),
each format's parser in its own module."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from mstar.serve.tools.calls import ParsedCall, Split

Function = tuple[str, dict]  # a function's name and its parameters' JSON schema
EXAMPLE = ParsedCall("<function-name>", '{"<argument>": "<value>"}')


class ToolFormat:
    """One family's call syntax: the ``start`` that opens its calls, a
    reader of the calls after it, how a call is written (for the fallback
    prompt and the history), and the structural tag that constrains calls
    to it (None: this format is parsed, never constrained)."""

    name = ""
    start = ""

    def split(self, text: str, names: Collection[str]) -> Split:
        """``text`` read into content, calls to ``names`` and the rest."""
        at = self.find_start(text)
        if at < 0:
            return Split(text, (), "")
        calls, end = self.read_calls(text, at, names)
        return Split(text[:at], tuple(calls), text[end if calls else at :])

    def find_start(self, text: str) -> int:
        return text.find(self.start)

    def read_calls(self, text: str, at: int, names: Collection[str]) -> tuple[list, int]:
        """The calls from ``at`` (where ``start`` is) and the end of the last."""
        raise NotImplementedError

    def write(self, calls: Sequence[ParsedCall]) -> str:
        """``calls`` as this format writes them."""
        raise NotImplementedError

    def call_begin(self, name: str) -> str:
        """The constant text before a call's arguments (JSON formats)."""
        raise NotImplementedError

    call_end = "}"
    separator = ""
    opening = ""  # what comes before the first call and is not in its ``call_begin``

    def structural_tag(
        self, functions: Sequence[Function], required: bool, parallel: bool
    ) -> dict[str, Any] | None:
        """xgrammar's structural tag for calls to ``functions``: ``required``,
        one call or more (one without ``parallel``) and nothing else;
        otherwise free text in which ``start`` opens the calls. JSON with at
        most one whitespace character in a row (no endless indentation)."""
        tags = [
            {
                "type": "tag",
                "begin": self.call_begin(name),
                "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                "end": self.call_end,
            }
            for name, schema in functions
        ]
        if required:
            fmt: dict = {
                "type": "tags_with_separator", "tags": tags, "separator": self.separator,
                "at_least_one": True, "stop_after_first": not parallel,
            }  # fmt: skip
        else:
            fmt = {
                "type": "triggered_tags", "triggers": [self.start], "tags": tags,
                "stop_after_first": not parallel,
            }  # fmt: skip
        return {"type": "structural_tag", "format": fmt}

    def instructions(self) -> str:
        """How to call, for the fallback system block."""
        return "To call a function, reply with the call alone, in this format:\n" + self.write(
            [EXAMPLE]
        )


def dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)
