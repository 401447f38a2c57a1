"""One API call's engine completions as OpenAI responses: the whole object,
or server-sent events (``data: {chunk}`` each, ``data: [DONE]`` last)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Literal

from mstar.engine import Completion, CompletionOutput
from mstar.engine.sampling.logprobs import Logprob, TokenLogprobs, TokenNames
from mstar.serve.tools.stream import CallReader, CallStream, finish_reason

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
    names: TokenNames | None = None  # token text and bytes for logprobs
    echo: str | None = None  # completions: the prompt's text, first in each choice
    nothing: bool = False  # max_tokens 0 (with echo): the one token generated is not shown
    tools: CallReader | None = None  # chat with tools: the text read for calls
    namespace: str = ""  # the prefix cache's namespace of its requests (``Access.namespace``)
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
        done = self.shown(done)
        choices = []
        for out in done.outputs:
            text = out.text or ""
            choice: dict = {
                "index": out.index,
                "logprobs": self.logprobs(done, out, 0, first=True),
                "finish_reason": out.finish_reason,
            }
            if self.tools is not None:
                choice["message"], choice["finish_reason"] = self.tools.message(
                    text, out.finish_reason
                )
            elif self.kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = (self.echo or "") + text
            if self.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        extra = {"prompt_token_ids": list(done.prompt_token_ids)} if self.return_token_ids else {}
        return self.envelope(self.kind, choices, usage=count(done), **extra)

    def shown(self, c: Completion) -> Completion:
        """``c`` as the client sees it: with ``nothing``, no generated token."""
        if not self.nothing:
            return c
        outputs = [
            replace(
                o, token_ids=[], text=None if o.text is None else "", delta="",
                logprobs=None if o.logprobs is None else [],
                finish_reason=None if o.finish_reason is None else "length",
            )
            for o in c.outputs
        ]  # fmt: skip
        return replace(c, outputs=outputs)

    def logprobs(self, c: Completion, out: CompletionOutput, sent: int, first: bool) -> dict | None:
        """``out``'s logprobs from token ``sent`` on, in the call's shape
        (chat: ``content``; completions: the legacy arrays, the echoed
        prompt's first when ``first``); None when not asked for."""
        records = None if out.logprobs is None else out.logprobs[sent:]
        if self.kind == "chat.completion":
            if records is None:
                return None
            return {"content": [self._chat_entry(r) for r in records], "refusal": None}
        echoed = self.echo is not None and first and c.prompt_logprobs is not None
        if records is None and not echoed:
            return None
        rows: list[tuple[int, TokenLogprobs | None]] = []
        if echoed:
            rows += zip(c.prompt_token_ids, c.prompt_logprobs)
        rows += [(r.chosen.token_id, r) for r in records or ()]
        return self._legacy(rows)

    def _text(self, token: Logprob | int) -> str:
        token_id = token if isinstance(token, int) else token.token_id
        if self.names is None:
            return f"token_id:{token_id}"  # vLLM's name for a token without a tokenizer
        return self.names.text(token_id)

    def _chat_entry(self, r: TokenLogprobs) -> dict:
        entry = self._entry(r.chosen)
        entry["top_logprobs"] = [self._entry(t) for t in r.top]
        return entry

    def _entry(self, t: Logprob) -> dict:
        raw = None if self.names is None else list(self.names.bytes(t.token_id))
        return {"token": self._text(t), "logprob": t.logprob, "bytes": raw}

    def _legacy(self, rows: list[tuple[int, TokenLogprobs | None]]) -> dict:
        tokens = [self._text(token_id) for token_id, _ in rows]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if r is None else r.chosen.logprob for _, r in rows],
            "top_logprobs": [
                None if r is None else {self._text(t): t.logprob for t in r.top} for _, r in rows
            ],
            "text_offset": offsets,
        }


def merged(wholes: list[dict]) -> dict:
    """One response of the responses of a call's prompts: their choices in
    order (``index`` running over them all), their usage summed."""
    first, choices = wholes[0], []
    for whole in wholes:
        for choice in whole["choices"]:
            choices.append({**choice, "index": len(choices)})
    usage = _summed([whole["usage"] for whole in wholes])
    rest = {k: v for k, v in first.items() if k not in ("choices", "usage", "prompt_token_ids")}
    return {**rest, "choices": choices, "usage": usage}


def _summed(usages: list[dict]) -> dict:
    """Usage objects added up, key by key (their nested details too)."""
    out: dict = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, dict):
                out[key] = _summed([out.get(key, {}), value])
            else:
                out[key] = out.get(key, 0) + value
    return out


def count(c: Completion) -> dict:
    """The ``usage`` object of a completion: ``prompt_tokens_details.cached_tokens``
    counts the prompt tokens whose KV came from the prefix cache."""
    prompt, generated = len(c.prompt_token_ids), sum(len(o.token_ids) for o in c.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }


class Chunker:
    """Stream chunks of one call: per completion, a chunk with each choice
    that has new text, new tokens (when asked for) or its finish reason;
    a chat choice's first chunk carries ``role``. With tools, a call's
    ``id``, ``type`` and name come in one chunk and its arguments in the
    next (its choice's finish reason with the last)."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.obj = "chat.completion.chunk" if call.kind == "chat.completion" else call.kind
        self.sent: dict[int, int] = {}  # choice -> tokens sent
        self.finished: set[int] = set()
        self.calls: dict[int, CallStream] = {}  # choice -> its calls read so far

    def chunks(self, c: Completion) -> list[dict]:
        c = self.call.shown(c)
        rounds: list[list[dict]] = []
        for out in c.outputs:
            for k, choice in enumerate(self._choice(c, out)):
                if k == len(rounds):
                    rounds.append([])
                rounds[k].append(choice)
        extra = {"usage": None} if self.call.include_usage else {}
        return [self.call.envelope(self.obj, choices, **extra) for choices in rounds]

    def usage_chunk(self, c: Completion) -> dict:
        return self.call.envelope(self.obj, [], usage=count(self.call.shown(c)))

    def _choice(self, c: Completion, out: CompletionOutput) -> list[dict]:
        """The pieces of ``out`` this completion adds, one per chunk."""
        i = out.index
        if i in self.finished:
            return []
        first, sent = i not in self.sent, self.sent.get(i, 0)
        new_ids = out.token_ids[sent:]
        self.sent[i] = len(out.token_ids)
        if out.finish_reason is not None:
            self.finished.add(i)
        tokens_wanted = self.call.return_token_ids or out.logprobs is not None
        worth = out.delta or out.finish_reason or (tokens_wanted and new_ids)
        echo = first and self.call.echo is not None
        if not (worth or echo or (first and self.call.kind == "chat.completion")):
            return []
        choice: dict = {"index": i}
        after: list[dict] = []
        if self.call.tools is not None:
            choice["delta"], after = self._tool_delta(out, first)
            if not (choice["delta"] or after or out.finish_reason or (tokens_wanted and new_ids)):
                return []  # text held back: it may open a call
        elif self.call.kind == "chat.completion":
            delta = {"role": "assistant"} if first else {}
            if out.delta or first:
                delta["content"] = out.delta
            choice["delta"] = delta
        else:
            choice["text"] = (self.call.echo if echo else "") + out.delta
        choice["logprobs"] = self.call.logprobs(c, out, sent, first)
        reason = out.finish_reason
        if self.call.tools is not None:
            reason = finish_reason(reason, self.calls[i].calls > 0)
        choice["finish_reason"] = None if after else reason
        if self.call.return_token_ids:
            choice["token_ids"] = list(new_ids)
        if after:
            after[-1]["finish_reason"] = reason
        return [choice, *after]

    def _tool_delta(self, out: CompletionOutput, first: bool) -> tuple[dict, list[dict]]:
        """The delta of a choice read for calls, and the pieces with the
        arguments of the calls it completes."""
        stream = self.calls.setdefault(out.index, CallStream(self.call.tools))
        text, calls = stream.feed(out.delta, out.finish_reason)
        delta: dict = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [
                {"index": k, "id": call_id, "type": "function",
                 "function": {"name": call.name, "arguments": ""}}
                for k, call_id, call in calls
            ]  # fmt: skip
        after = [
            {"index": out.index, "delta": {"tool_calls": [
                {"index": k, "function": {"arguments": call.arguments}}]}, "logprobs": None}
            for k, _, call in calls
        ]  # fmt: skip
        if self.call.return_token_ids:
            for piece in after:
                piece["token_ids"] = []
        return delta, after


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def events(call: Call, completions: AsyncIterator[Completion]) -> AsyncIterator[str]:
    """The server-sent events of a call's completions, ``[DONE]`` excluded."""
    chunker, last = Chunker(call), None
    async for c in completions:
        last = c
        for chunk in chunker.chunks(c):
            yield event(chunk)
    if call.include_usage and last is not None:
        yield event(chunker.usage_chunk(last))
