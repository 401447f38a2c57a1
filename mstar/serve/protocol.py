"""The OpenAI API's request bodies (pydantic), and their sampling parameters.

Types are checked here; ranges and the rest of the sampling contract are
``SamplingParams``'s (see ``sampling_params``). Fields a client may send that
the engine does not implement are refused when set to anything but their
neutral value, never silently ignored.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from mstar.engine import SamplingParams
from mstar.engine.sampling.params import MAX_LOGPROBS
from mstar.engine.sampling.structured import StructuredOutputs
from mstar.serve.tools.protocol import Tool, ToolCallIn, ToolChoice

# fields with no effect at these values; any other value is refused
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
# SamplingParams field -> the request field it comes from
PARAM_FIELDS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "n": "n",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "logit_bias": "logit_bias",
    "prompt_logprobs": "logprobs",
    "logprobs": "logprobs",
    "structured_outputs": "response_format",
}
_FIELD_NAMES = re.compile(r"\b(" + "|".join(sorted(PARAM_FIELDS, key=len, reverse=True)) + r")\b")
Number = StrictFloat | StrictInt
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: a system turn


class ParamError(ValueError):
    """A request field with a bad value: ``param`` names it."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields both endpoints share (vLLM's ``top_k``, ``stop_token_ids``,
    ``ignore_eos``, ``return_token_ids`` included)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr  # required, as OpenAI requires it
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    min_p: Number = 0.0
    logit_bias: dict[StrictStr, Number] | None = None
    response_format: dict[StrictStr, Any] | None = None
    structured_outputs: dict[StrictStr, Any] | None = None  # vLLM's
    cache_salt: StrictStr | None = None  # vLLM's: KV reused only among requests of one salt

    def structured(self) -> StructuredOutputs | None:
        """What the output must match: OpenAI's ``response_format`` (``text``,
        ``json_object``, ``json_schema``) or vLLM's ``structured_outputs``
        (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)."""
        fmt, vllm = self.response_format, self.structured_outputs
        if fmt is not None and fmt.get("type") != "text" and vllm is not None:
            raise ParamError(
                "expected response_format or structured_outputs, got both", "response_format"
            )
        if vllm is not None:
            try:
                return StructuredOutputs(**vllm)
            except (TypeError, ValueError) as err:
                raise ParamError(f"structured_outputs: {err}", "structured_outputs") from None
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return StructuredOutputs(json_object=True)
        schema = (
            (fmt.get("json_schema") or {}).get("schema")
            if fmt.get("type") == "json_schema"
            else None
        )
        if not isinstance(schema, dict):
            raise ParamError(
                "expected response_format {'type': 'text' | 'json_object'} or {'type':"
                f" 'json_schema', 'json_schema': {{'name': ..., 'schema': {{...}}}}}}, got {fmt!r:.80}",
                "response_format",
            )
        return StructuredOutputs(json=schema)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """``(logprobs, prompt_logprobs)`` of ``SamplingParams`` this body asks for."""
        return None, None

    def check_supported(self) -> None:
        """``ParamError`` for a field this server refuses: one it does not
        implement, ``temperature`` outside [0, 2] (OpenAI's range), an empty
        ``cache_salt``."""
        for name, value in (self.model_extra or {}).items():
            if name in NEUTRAL and value not in NEUTRAL[name]:
                raise ParamError(f"{name}={value!r} is not supported by this server", name)
        if not 0 <= self.temperature <= 2:
            raise ParamError(
                f"expected temperature in [0, 2], got {self.temperature}", "temperature"
            )
        if self.cache_salt == "":
            raise ParamError("expected cache_salt a non-empty string, got ''", "cache_salt")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """The legacy completions body: ``logprobs=k`` (the ``k`` most likely
    per token) and ``echo`` (the prompt first; its tokens' logprobs too with
    ``logprobs``; ``max_tokens=0`` then generates nothing). ``prompt``: a
    string, token ids, or a list of either (one request each, not streamed:
    what lm-eval's ``local-completions`` sends)."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts this body asks for: one, or each of a list."""
        p = self.prompt
        several = isinstance(p, list) and p and not isinstance(p[0], int)
        return list(p) if several else [p]

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """A message; ``content`` may be null beside an assistant's ``tool_calls``
    (checked with the tools, ``mstar.serve.tools.plan.conversation``)."""

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None

    def text(self) -> str | None:
        text = self.content
        if text is None or isinstance(text, str):
            return text
        return "".join(part.text for part in text)

    def template_role(self, i: int) -> str:
        """The role the chat template sees (``developer``, OpenAI's newer name
        for ``system``, as ``system``); ``ParamError`` listing every accepted
        role for any other."""
        if self.role not in ROLES:
            raise ParamError(
                f"expected messages[{i}].role one of {', '.join(ROLES)}, got {self.role!r:.40}",
                f"messages.{i}.role",
            )
        return "system" if self.role == "developer" else self.role

    def as_dict(self, i: int) -> dict[str, str]:
        """The message as ``Engine.encode_chat`` takes it (no tool fields)."""
        role = self.template_role(i)
        text = self.text()
        if text is None:
            raise ParamError(
                f"expected messages[{i}].content a string, got null", f"messages.{i}.content"
            )
        return {"role": role, "content": text}


class ChatCompletionRequest(_Sampling):
    """The chat body: ``logprobs`` (a bool) and ``top_logprobs`` (how many
    alternatives, with ``logprobs`` only)."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @property
    def with_tools(self) -> bool:
        """Whether tools, or calls in the history, take the tool path."""
        return (
            bool(self.tools)
            or self.tool_choice not in (None, "none")
            or any(m.tool_calls or m.role == "tool" for m in self.messages)
        )

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ParamError(
                f"expected top_logprobs in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                "top_logprobs",
            )
        return (self.top_logprobs or 0) if self.logprobs else None, None


def sampling_params(body: _Sampling, max_tokens: int) -> SamplingParams:
    """``SamplingParams`` from ``body`` (``max_tokens`` when it sets none);
    ``ParamError`` naming the request field when they refuse a value."""
    logprobs, prompt_logprobs = body.logprob_counts()
    structured = body.structured()
    try:
        bias = {_token_id(k): v for k, v in (body.logit_bias or {}).items()}
        return SamplingParams(
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_p=body.min_p,
            logit_bias=bias,
            structured_outputs=structured,
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=0 if body.top_k == -1 else body.top_k,  # vLLM's "all" is -1
            n=body.n,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            stop=() if body.stop is None else body.stop,  # "" refused as in Python
        )
    except (TypeError, ValueError) as err:
        raise ParamError(str(err), param_named(str(err), None)) from err


def _token_id(key: str) -> int:
    """A ``logit_bias`` key: a token id written as a JSON object key."""
    if not key.lstrip("-").isdigit():
        raise ValueError(f"expected logit_bias keys token ids, got {key!r}")
    return int(key)


def param_named(message: str, default: str | None) -> str | None:
    """The request field behind the first ``SamplingParams`` field ``message`` names."""
    named = _FIELD_NAMES.search(message)
    return PARAM_FIELDS[named.group(1)] if named else default
