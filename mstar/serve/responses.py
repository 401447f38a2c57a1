"""One API call's engine completions as OpenAI responses: the whole object,
or server-sent events (``data: {chunk}`` each, ``data: [DONE]`` last)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from mstar.engine import Completion, CompletionOutput

DONE = "data: [DONE]\n\n"


@dataclass
class Call:
    """What shapes the responses of one call: its ``kind`` (``text_completion``
    or ``chat.completion``), id, model name and options."""

    kind: Literal["text_completion", "chat.completion"]
    id: str
    model: str
    include_usage: bool = False
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, obj: str, choices: list[dict], **extra: object) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def whole(self, done: Completion) -> dict:
        """The non-streamed response of a finished completion."""
        choices = []
        for out in done.outputs:
            text = out.text or ""
            choice: dict = {
                "index": out.index,
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }
            if self.kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if self.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        extra = {"prompt_token_ids": list(done.prompt_token_ids)} if self.return_token_ids else {}
        return self.envelope(self.kind, choices, usage=count(done), **extra)


def count(c: Completion) -> dict[str, int]:
    """The ``usage`` object of a completion."""
    prompt, generated = len(c.prompt_token_ids), sum(len(o.token_ids) for o in c.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


class Chunker:
    """Stream chunks of one call: per completion, a chunk with each choice
    that has new text, new tokens (when asked for) or its finish reason;
    a chat choice's first chunk carries ``role``."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.obj = "chat.completion.chunk" if call.kind == "chat.completion" else call.kind
        self.sent: dict[int, int] = {}  # choice -> tokens sent
        self.finished: set[int] = set()

    def chunk(self, c: Completion) -> dict | None:
        choices = [ch for out in c.outputs if (ch := self._choice(out)) is not None]
        if not choices:
            return None
        extra = {"usage": None} if self.call.include_usage else {}
        return self.call.envelope(self.obj, choices, **extra)

    def usage_chunk(self, c: Completion) -> dict:
        return self.call.envelope(self.obj, [], usage=count(c))

    def _choice(self, out: CompletionOutput) -> dict | None:
        i = out.index
        if i in self.finished:
            return None
        first = i not in self.sent
        new_ids = out.token_ids[self.sent.get(i, 0) :]
        self.sent[i] = len(out.token_ids)
        if out.finish_reason is not None:
            self.finished.add(i)
        worth = out.delta or out.finish_reason or (self.call.return_token_ids and new_ids)
        if not (worth or (first and self.call.kind == "chat.completion")):
            return None
        choice: dict = {"index": i}
        if self.call.kind == "chat.completion":
            delta = {"role": "assistant"} if first else {}
            if out.delta or first:
                delta["content"] = out.delta
            choice["delta"] = delta
        else:
            choice["text"] = out.delta
        choice["logprobs"] = None
        choice["finish_reason"] = out.finish_reason
        if self.call.return_token_ids:
            choice["token_ids"] = list(new_ids)
        return choice


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def events(call: Call, completions: AsyncIterator[Completion]) -> AsyncIterator[str]:
    """The server-sent events of a call's completions, ``[DONE]`` excluded."""
    chunker, last = Chunker(call), None
    async for c in completions:
        last = c
        chunk = chunker.chunk(c)
        if chunk is not None:
            yield event(chunk)
    if call.include_usage and last is not None:
        yield event(chunker.usage_chunk(last))
