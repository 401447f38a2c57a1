"""From a step's logits rows to tokens, beside the sampler: what runs before
it (biases, penalties, grammar masks) and after it (logprobs, matchers).

``LogitsPipeline.rows`` is a pure function of the logits rows and each row's
state (request, stream label), batched over the rows, so it applies to any
rows a step produces (speculative verify rows included, later).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mstar.engine.logprobs import TokenNames, record_prompt_logprobs, sampled_logprobs
from mstar.engine.penalties import penalize, row_state
from mstar.engine.request import Request, Sample
from mstar.engine.structured import Grammars, accept, row_matcher


class LogitsPipeline:
    """One engine's: token names (for logprobs' text) and grammars (for
    structured outputs), both None without a tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.names = None if tokenizer is None else TokenNames(tokenizer)
        self.grammars = None if tokenizer is None else Grammars(tokenizer, vocab_size, eos_ids)

    def prompt(self, logits: torch.Tensor, rows: Sequence[tuple[Request, int]]) -> None:
        """Record prompt logprobs from ``logits`` at ``(request, position)`` rows."""
        record_prompt_logprobs(logits, rows, self.names)

    def rows(self, logits: torch.Tensor, chosen: Sequence[tuple[Request, str]]) -> torch.Tensor:
        """The logits the sampler draws from: biases and penalties, then grammar masks."""
        logits = penalize(logits, [row_state(req, label) for req, label in chosen])
        if self.grammars is None:
            return logits
        return self.grammars.mask(logits, [row_matcher(req, label) for req, label in chosen])

    def chose(self, req: Request, sample: Sample, logits: torch.Tensor, token: int) -> None:
        """``token`` was drawn for ``sample`` from ``logits``: advance its
        matcher, record its logprobs when asked."""
        if sample.matcher is not None:
            accept(sample.matcher, token, req.id)
        if sample.logprobs is not None:
            sample.logprobs.append(sampled_logprobs(logits, req.params, token, self.names))
