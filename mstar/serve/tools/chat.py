"""The tool side of one server's chat endpoint: its format (from
``--tool-call-parser``), how its template takes tools, and each request's
plan, prompt, sampling parameters and reader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mstar.engine import SamplingParams
from mstar.serve.protocol import ChatCompletionRequest, ParamError
from mstar.serve.tools import tool_format
from mstar.serve.tools.plan import ToolPlan, conversation, plan
from mstar.serve.tools.render import ToolPrompt
from mstar.serve.tools.stream import CallReader


class ChatTools:
    """Tool calling for one engine's tokenizer, parsed as ``parser`` says."""

    def __init__(self, tokenizer: Any, parser: str = "auto") -> None:
        template = getattr(tokenizer, "chat_template", None)
        self.fmt = tool_format(parser, None if template is None else str(template))
        self.prompt = ToolPrompt(tokenizer, self.fmt)

    def describe(self) -> str:
        return self.prompt.describe()

    def plan(self, body: ChatCompletionRequest) -> tuple[list[dict], ToolPlan | None]:
        """The checked conversation and tool plan of ``body`` (``ParamError``
        naming the field), before anything reaches the engine."""
        messages = conversation(body.messages)
        return messages, plan(body.tools, body.tool_choice, body.parallel_tool_calls, self.fmt)

    def ids(self, messages: Sequence[dict], planned: ToolPlan | None) -> list[int]:
        """The prompt ids (call in the engine's thread: the tokenizer's)."""
        if self.prompt.tokenizer is None or self.prompt.tokenizer.chat_template is None:
            raise ValueError("expected a tokenizer with a chat template for chat, got none")
        return self.prompt.ids(messages, None if planned is None else planned.tools)

    def compile(self, engine: Any, planned: ToolPlan | None) -> None:
        """Compile (and cache) the calls' grammar now, in the engine's thread:
        ``ParamError`` naming ``tools`` when it does not compile."""
        spec = None if planned is None else planned.structured()
        grammars = getattr(engine.pipeline, "grammars", None)
        if spec is None or grammars is None:
            return
        try:
            grammars.matcher(spec)
        except ValueError as err:
            raise ParamError(f"tools: {err}", "tools") from None

    def params(self, params: SamplingParams, planned: ToolPlan | None) -> SamplingParams:
        """``params`` with the calls' grammar; ``response_format`` beside a
        tool choice that constrains is refused."""
        spec = None if planned is None else planned.structured()
        if spec is None:
            return params
        if params.structured_outputs is not None:
            raise ParamError(
                "expected response_format or tools (with tool_choice other than none), got both",
                "response_format",
            )
        try:
            return replace(params, structured_outputs=spec)
        except (TypeError, ValueError) as err:
            raise ParamError(f"tools: {err}", "tools") from None

    def reader(self, planned: ToolPlan | None) -> CallReader | None:
        """What reads the calls out of the text; None when nothing is read."""
        if planned is None or not planned.parses:
            return None
        forced = planned.choice not in ("auto", "none")
        named = planned.choice if planned.choice in planned.names else None
        names = frozenset([named] if named else planned.names)  # (what the grammar allows)
        return CallReader(self.fmt, names, forced)
