"""A request's state inside the engine, and what the engine hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mstar.engine.detokenizer import TextStream
from mstar.engine.sampling.logprobs import TokenLogprobs
from mstar.engine.sampling.params import SamplingParams

FinishReason = Literal["stop", "length"]
GUIDED = ("cond", "uncond")


@dataclass
class CompletionOutput:
    """One sample: ``token_ids`` generated (the EOS/stop token that ended it
    included, and every token up to one that completed a stop string),
    ``text`` decoded so far without that token and ending before a stop string
    (``None`` without a tokenizer), ``finish_reason`` (``None`` while running),
    ``delta``: the text made final since this sample was last handed out by
    ``step()`` (all deltas joined are the final ``text``); ``logprobs``: one
    record per token in ``token_ids`` with ``SamplingParams.logprobs`` (else None)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason | None
    delta: str = ""
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class Completion:
    """A request's prompt and its ``n`` samples; with
    ``SamplingParams.prompt_logprobs``, ``prompt_logprobs`` has a record per
    prompt token (None for the first, and for those not computed yet)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache gave

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass(eq=False)
class Sample:
    """One of a request's outputs: the streams it feeds its tokens to (one,
    or ``cond``/``uncond`` when guided), its own generator, and its text
    (``None`` without a tokenizer), of which ``shown`` characters were handed out."""

    index: int
    labels: tuple[str, ...]
    generator: torch.Generator | None
    text: TextStream | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    shown: int = 0
    handed: int = 0  # tokens handed out
    logprobs: list[TokenLogprobs] | None = None
    matcher: Any = None  # the grammar's matcher with structured outputs

    def output(self) -> CompletionOutput:
        """Its record now; what it carries as ``delta`` counts as handed out."""
        text = None if self.text is None else self.text.text
        delta = "" if text is None else text[self.shown :]
        self.shown += len(delta)
        self.handed = len(self.token_ids)
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(
            self.index, list(self.token_ids), text, self.finish_reason, delta, logprobs
        )


@dataclass(eq=False)
class Request:
    """A request being served.

    ``streams`` maps each live KV stream label to its tokens (prompt, then the
    generated tokens still to be fed) and ``fed`` to how many are in the KV
    cache. A plain request has ``main``; with ``n > 1``, ``main`` until its
    prompt is in, then ``s0..s{n-1}``; a guided one ``cond``/``uncond``.
    ``pending`` holds a guided stream's last logits until its twin's arrive;
    ``draft`` the speculative tokens a stream ends with this step;
    ``by_label`` maps a sample's stream labels to it.
    """

    id: str
    prompt: list[int]
    params: SamplingParams
    samples: list[Sample]
    uncond: list[int] | None = None
    guidance_scale: float = 1.0
    streams: dict[str, list[int]] = field(default_factory=dict)
    fed: dict[str, int] = field(default_factory=dict)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    draft: dict[str, list[int]] = field(default_factory=dict)  # speculative tokens ending streams
    by_label: dict[str, Sample] = field(init=False)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cache_namespace: str = ""  # the prefix cache's namespace of its KV
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (as it last started)

    def __post_init__(self) -> None:
        self.by_label = {label: s for s in self.samples for label in s.labels}
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt)
        if self.params.logprobs is not None:
            for s in self.samples:
                s.logprobs = []

    def prompt_positions(self, label: str, fed: int, count: int) -> list[int]:
        """The stream positions of ``label``'s next ``count`` tokens (from
        ``fed``) whose logits give a prompt token's logprobs not recorded yet
        (position ``p`` predicts prompt token ``p + 1``)."""
        if self.prompt_logprobs is None or label != "main":
            return []
        end = min(fed + count, len(self.prompt) - 1)
        return [p for p in range(fed, end) if self.prompt_logprobs[p + 1] is None]

    @property
    def forked(self) -> bool:
        """True when the samples have their own streams (always, unless n > 1)."""
        return "main" not in self.streams or self.params.n == 1

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def has_news(self) -> bool:
        """True when a sample got tokens since the request was last handed out."""
        return any(len(s.token_ids) > s.handed for s in self.samples)

    def completion(self) -> Completion:
        """Its record now (each sample's ``Sample.output``)."""
        outputs = [s.output() for s in self.samples]
        prompt_lp = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return Completion(self.id, list(self.prompt), outputs, prompt_lp, self.cached_tokens)

    def holds_kv(self) -> bool:
        return any(self.fed.values())

    def feed(self, label: str, count: int) -> tuple[list[int], bool]:
        """The next ``count`` tokens of stream ``label`` go into the KV cache:
        they, and whether the stream is then in to its end (its logits choose
        the next token)."""
        fed = self.fed[label]
        self.fed[label] = fed + count
        tokens = self.streams[label]
        return tokens[fed : fed + count], fed + count == len(tokens)

    def restart(self) -> None:
        """Nothing in the KV cache any more: every stream is fed again from its
        start, generated tokens included. A forked request goes back to one
        ``main`` stream of the prompt and forks again once it is in."""
        live = [s for s in self.samples if s.finish_reason is None]
        if self.uncond is not None:
            done = live[0].token_ids if live else []
            self.streams = {"cond": self.prompt + done, "uncond": self.uncond + done}
        elif self.params.n == 1:
            self.streams = {"main": self.prompt + (live[0].token_ids if live else [])}
        else:
            self.streams = {"main": list(self.prompt)}
        self.fed = dict.fromkeys(self.streams, 0)
        self.pending = {}
        self.draft = {}
