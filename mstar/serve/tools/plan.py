"""A chat request's tools checked and planned before anything reaches the
engine: which functions, the choice, the grammar calls are generated under,
and the conversation's messages with their calls."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mstar.engine.sampling.structured import StructuredOutputs
from mstar.serve.protocol import ParamError
from mstar.serve.tools.calls import ParsedCall
from mstar.serve.tools.format import Function, ToolFormat
from mstar.serve.tools.protocol import NamedToolChoice, Tool

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANY_OBJECT: dict = {"type": "object"}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """What a request with ``tools`` asks: the ``tools`` (OpenAI dicts, for
    the prompt), each function's ``(name, parameters schema)``, the
    ``choice`` (``none``, ``auto``, ``required`` or the name of the one
    function to call) and whether several calls may come (``parallel``)."""

    fmt: ToolFormat
    tools: list[dict]
    functions: list[Function]
    choice: str
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.functions]

    @property
    def parses(self) -> bool:
        """Whether generated text is read for calls (not with ``none``)."""
        return self.choice != "none"

    def structured(self) -> StructuredOutputs | None:
        """The grammar calls are generated under: ``required``, calls alone
        (one without ``parallel``); a named choice, that one call; ``auto``, free text until the format's start
        opens the calls; None for ``none`` or a format without a grammar."""
        if self.choice == "none":
            return None
        if self.choice in ("auto", "required"):
            functions, parallel = self.functions, self.parallel
        else:  # named: that one call
            functions, parallel = [f for f in self.functions if f[0] == self.choice], False
        tag = self.fmt.structural_tag(functions, self.choice != "auto", parallel)
        return None if tag is None else StructuredOutputs(structural_tag=tag)


def plan(
    tools: Sequence[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool,
    fmt: ToolFormat,
) -> ToolPlan | None:  # fmt: skip
    """The plan of a request's tool fields; None without tools.
    ``ParamError`` naming the field: a bad name, a name given twice,
    parameters xgrammar cannot compile, ``tool_choice`` without tools or
    naming none of them, a choice the format cannot constrain."""
    if isinstance(choice, str) and choice not in CHOICES:
        raise ParamError(
            f"expected tool_choice one of {CHOICES} or a named function, got {choice!r:.80}",
            "tool_choice",
        )
    if not tools:
        if choice not in (None, "none"):
            raise ParamError(
                f"expected tools with tool_choice {_shown(choice)}, got none", "tool_choice"
            )
        return None
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        name, schema = tool.function.name, tool.function.parameters
        if not NAME.fullmatch(name):
            raise ParamError(
                f"expected tools[{i}].function.name of 1-64 letters, digits, _ or -, got {name!r:.80}",
                f"tools.{i}.function.name",
            )
        if name in (n for n, _ in functions):
            raise ParamError(
                f"expected distinct tool names, got {name!r} twice", f"tools.{i}.function.name"
            )
        schema = ANY_OBJECT if schema is None else schema
        _check_schema(schema, i)
        functions.append((name, schema))
    names = [n for n, _ in functions]
    picked = "auto" if choice is None else choice
    if isinstance(picked, NamedToolChoice):
        picked = picked.function.name
        if picked not in names:
            raise ParamError(
                f"expected tool_choice to name one of the tools {names}, got {picked!r:.80}",
                "tool_choice",
            )
    done = ToolPlan(
        fmt, [t.model_dump(exclude_none=True) for t in tools], functions, picked, parallel
    )
    if picked not in ("none", "auto") and done.structured() is None:
        raise ParamError(
            f"tool_choice {picked!r} needs a tool-call parser with a grammar (hermes,"
            f" llama3_json, mistral); this server parses {fmt.name}",
            "tool_choice",
        )
    return done


def _check_schema(schema: dict, i: int) -> None:
    """``schema`` is a JSON schema xgrammar compiles."""
    try:
        import xgrammar
    except ImportError:
        raise ParamError("tools need xgrammar: pip install 'mstar-kv[serve]'", "tools") from None
    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as err:
        problem = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
        raise ParamError(
            f"invalid tools[{i}].function.parameters: {problem}", f"tools.{i}.function.parameters"
        ) from None


def _shown(choice: Any) -> str:
    return repr(choice.function.name if isinstance(choice, NamedToolChoice) else choice)


def conversation(messages: Sequence[Any]) -> list[dict]:
    """The messages of a request with tools as checked dicts (see
    ``ToolPrompt.ids``): content may be null only beside an assistant's
    calls; a call's arguments are a JSON object; a ``tool`` message
    answers a call made before it."""
    out: list[dict] = []
    called: set[str] = set()
    for i, m in enumerate(messages):
        role = m.template_role(i)
        content = m.text()
        calls = []
        for j, call in enumerate(m.tool_calls or ()):
            where = f"messages.{i}.tool_calls.{j}"
            if m.role != "assistant":
                raise ParamError(
                    f"expected tool_calls on assistant messages, got {m.role!r}", where
                )
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise ParamError(
                    f"expected {where}.function.arguments a JSON object's text,"
                    f" got {call.function.arguments!r:.80}",
                    f"{where}.function.arguments",
                )
            calls.append((call.id, ParsedCall(call.function.name, call.function.arguments)))
            called.add(call.id)
        if content is None and not calls:
            raise ParamError(
                f"expected messages[{i}].content a string, got null", f"messages.{i}.content"
            )
        if m.role == "tool" and m.tool_call_id not in called:
            raise ParamError(
                f"expected messages[{i}].tool_call_id to answer an earlier call"
                f" ({sorted(called)}), got {m.tool_call_id!r:.80}",
                f"messages.{i}.tool_call_id",
            )
        out.append(
            {
                "role": role,
                "content": content,
                "tool_calls": calls,
                "tool_call_id": m.tool_call_id,
            }
        )
    if not out:
        raise ParamError("expected at least one message, got []", "messages")
    return out
