"""What requests an engine can take: every argument of a new request checked,
then the request built (not queued)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from numbers import Real
from typing import Any

import torch

from mstar.engine.detokenizer import TextStream
from mstar.engine.prompts import token_ids
from mstar.engine.request import GUIDED, Request, Sample
from mstar.engine.sampling.params import SamplingParams, make_generator
from mstar.engine.sampling.structured import Grammars


class RequestTooLarge(ValueError):
    """A request whose KV alone would not fit the page pool at its peak."""


@dataclass(frozen=True)
class Intake:
    """The limits of one engine: its tokenizer (or None), vocabulary, longest
    sequence (or None), page size and pool, the device samplers draw on, the
    window of each manager allocating from the pool (``windows``; None: it
    keeps every page; several: a hybrid's KV groups on one pool) and the
    step's token budget (``budget``). A step feeds a stream at most
    ``max_chunk`` tokens: the budget, capped at the smallest window when a
    manager releases pages behind one (so a stream recomputed after a
    preemption peaks at its window's pages, not at its output's)."""

    tokenizer: Any
    vocab_size: int
    max_len: int | None
    page_size: int
    num_pages: int
    device: torch.device
    windows: tuple[int | None, ...] = (None,)
    budget: int | None = None
    grammars: Grammars | None = None  # structured outputs (None: no tokenizer)

    @property
    def max_chunk(self) -> int | None:
        """The most tokens a step feeds one stream (None: the budget's)."""
        windows = [w for w in self.windows if w is not None]
        if not windows:
            return self.budget
        return min(windows) if self.budget is None else min(self.budget, *windows)

    def request(
        self,
        rid: str,
        prompt: object,
        params: object,
        uncond_prompt: object = None,
        guidance_scale: object = 1.0,
    ) -> Request:
        """Request ``rid``, or a ``TypeError``/``ValueError`` naming it and the
        bad value (``RequestTooLarge`` when its KV could never fit the pool)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"request {rid!r}: expected params a SamplingParams, got {params!r:.60}"
            )
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, Real):
            raise TypeError(
                f"request {rid!r}: expected guidance_scale a number, got {guidance_scale!r}"
            )
        if not math.isfinite(guidance_scale):
            raise ValueError(
                f"request {rid!r}: expected guidance_scale finite, got {guidance_scale!r}"
            )
        if uncond_prompt is None and guidance_scale != 1.0:
            raise ValueError(
                f"request {rid!r}: expected uncond_prompt with guidance_scale {guidance_scale!r}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"request {rid!r}: expected no stop strings without a tokenizer, got {params.stop!r}"
            )
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"request {rid!r}: expected logit_bias ids in [0, {self.vocab_size}), got {bad[0]}"
            )
        ids = token_ids(rid, prompt, self.tokenizer, self.vocab_size)
        uncond = None
        if uncond_prompt is not None:
            uncond = token_ids(rid, uncond_prompt, self.tokenizer, self.vocab_size)
            if params.n != 1:
                raise ValueError(f"request {rid!r}: expected n == 1 when guided, got n={params.n}")
            extras = params.penalized or params.logprobs is not None or params.structured_outputs
            if extras or params.prompt_logprobs is not None:
                raise ValueError(
                    f"request {rid!r}: expected no logprobs, biases, penalties or"
                    " structured_outputs"
                    " when guided (not supported together)"
                )
        self._check_fits(rid, ids, uncond, params)
        samples = [
            Sample(
                i,
                GUIDED if uncond is not None else ("main",) if params.n == 1 else (f"s{i}",),
                None if params.greedy else make_generator(params, i, self.device),
                None if self.tokenizer is None else TextStream(self.tokenizer, params.stop),
            )
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError(f"request {rid!r}: expected a tokenizer for structured_outputs")
            try:
                for s in samples:
                    s.matcher = self.grammars.matcher(params.structured_outputs)
            except ValueError as err:
                raise ValueError(f"request {rid!r}: {err}") from None
        req = Request(rid, ids, params, samples, uncond=uncond, guidance_scale=guidance_scale)
        req.restart()
        return req

    def _check_fits(
        self, rid: str, ids: list[int], uncond: list[int] | None, params: SamplingParams
    ) -> None:
        """Refuse a request longer than the model's positions or whose KV could
        never fit the pool; the message names max_new_tokens only when the
        prompt alone would fit."""
        prompt_len = max(len(ids), len(uncond or ()))
        if self.max_len is not None and prompt_len >= self.max_len:
            raise ValueError(
                f"request {rid!r}: the prompt alone ({prompt_len} tokens) leaves no room for"
                f" a new token within the model's max_position_embeddings {self.max_len}"
            )
        if self.max_len is not None and prompt_len + params.max_new_tokens > self.max_len:
            raise ValueError(
                f"request {rid!r}: prompt + max_new_tokens = {prompt_len + params.max_new_tokens}"
                f" exceeds the model's max_position_embeddings {self.max_len}"
            )
        uncond_len = None if uncond is None else len(uncond)
        alone = self.peak_pages(len(ids), replace(params, max_new_tokens=1, n=1), uncond_len)
        if alone > self.num_pages:
            raise RequestTooLarge(
                f"request {rid!r}: the prompt alone ({len(ids)} tokens) needs {alone} KV pages"
                f" at its peak, the pool has {self.num_pages}"
            )
        need = self.peak_pages(len(ids), params, uncond_len)
        if need > self.num_pages:
            raise RequestTooLarge(
                f"request {rid!r} needs {need} KV pages at its peak (prompt {len(ids)} tokens,"
                f" max_new_tokens {params.max_new_tokens}, n {params.n}), the pool has"
                f" {self.num_pages}"
            )

    def peak_pages(
        self, prompt_len: int, params: SamplingParams, uncond_len: int | None = None
    ) -> int:
        """KV pages a request holds at its peak, alone in the pool (the last
        generated token is never fed): the sum over ``windows``. With a
        window, a stream holds at most ``W + page_size - 2`` tokens' pages
        between steps (the manager releases those behind the window) plus a
        step's chunk."""
        return sum(self._peak(w, prompt_len, params, uncond_len) for w in self.windows)

    def _peak(
        self, window: int | None, prompt_len: int, params: SamplingParams, uncond_len: int | None
    ) -> int:
        """``peak_pages`` in one manager of ``window``."""
        size = self.page_size

        def full(tokens: int) -> int:
            return -(-tokens // size)

        def pages(tokens: int) -> int:
            if window is None:
                return full(tokens)
            chunk = min(tokens, self.max_chunk or tokens)
            return min(full(tokens), full(window + size - 2 + chunk))

        longest = prompt_len + params.max_new_tokens - 1
        if uncond_len is not None:
            return pages(longest) + pages(uncond_len + params.max_new_tokens - 1)
        if params.n == 1:
            return pages(longest)
        # the prompt's stream while forking, then each sample's pages past the shared ones
        shared = full(prompt_len) + params.n * (full(longest) - prompt_len // size)
        return min(shared, pages(prompt_len) + params.n * pages(longest))
