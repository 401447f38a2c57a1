"""The pythonic format (Llama 3.2 / 4, ToolACE): a Python list of calls
with keyword arguments of literal values, ``[f(a=1, b="x"), g()]``. Parsed
only: no grammar constrains it (``required`` and named choices are refused)."""

from __future__ import annotations

import ast
import json
from collections.abc import Collection, Sequence

from mstar.serve.tools.calls import ParsedCall
from mstar.serve.tools.format import Function, ToolFormat, dumps


class Pythonic(ToolFormat):
    name = "pythonic"
    start = "["

    def read_calls(self, text: str, at: int, names: Collection[str]) -> tuple[list, int]:
        """The shortest ``[...]`` from ``at`` that is a list of calls."""
        close = text.find("]", at)
        while close >= 0:
            calls = _calls(text[at : close + 1], names)
            if calls:
                return calls, close + 1
            close = text.find("]", close + 1)
        return [], at

    def write(self, calls: Sequence[ParsedCall]) -> str:
        def call(c: ParsedCall) -> str:
            args = ", ".join(f"{k}={v!r}" for k, v in json.loads(c.arguments).items())
            return f"{c.name}({args})"

        return "[" + ", ".join(call(c) for c in calls) + "]"

    def structural_tag(self, functions: Sequence[Function], required: bool, parallel: bool) -> None:
        return None


def _calls(source: str, names: Collection[str]) -> list[ParsedCall]:
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        ok = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
        if not ok or node.func.id not in names or any(k.arg is None for k in node.keywords):
            return []
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(ParsedCall(node.func.id, dumps(_jsonable(args))))
        except (ValueError, TypeError):
            return []
    return calls


def _jsonable(value: object) -> object:
    """A literal as JSON holds it (tuples as lists); TypeError for what JSON cannot."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("expected str keys")
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"not JSON: {type(value).__name__}")
