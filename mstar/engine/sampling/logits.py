"""From a step's logits rows to tokens: what runs before the sampler (biases,
penalties, grammar masks), the draw, and what runs after it (matchers,
logprobs).

A greedy row without logprobs is drawn first, unmasked (``draws_first``):
the raw row's argmax, when its grammar allows it, is the masked row's; when
refused, the best of the allowed tokens is taken instead (the masked row's
argmax, ``allowed_argmax``). So no mask is built wherever the model already
writes what the grammar wants (most steps inside a JSON value or a tool
call). Every other constrained row is masked before its draw (a random draw
or its logprobs need the masked distribution), so seeded sampling draws the
same tokens as before.

``LogitsPipeline.rows`` is a pure function of the logits rows and each row's
state (request, stream label), batched over the rows, so it applies to any
rows a step produces: speculative verification (``speculative.py``) applies
it to a verify row one position at a time, after the tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mstar.engine.request import Request, Sample
from mstar.engine.sampling.logprobs import TokenNames, position_logprobs, sampled_logprobs
from mstar.engine.sampling.params import SamplingParams, sample_token
from mstar.engine.sampling.penalties import penalize, row_state
from mstar.engine.sampling.structured import Grammars, accept


class LogitsPipeline:
    """One engine's: token names (for logprobs' text) and grammars (for
    structured outputs), both None without a tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.names = None if tokenizer is None else TokenNames(tokenizer)
        self.grammars = None if tokenizer is None else Grammars(tokenizer, vocab_size, eos_ids)

    def prompt(self, logits: torch.Tensor, rows: Sequence[tuple[Request, int]]) -> None:
        """Row ``i`` of ``logits`` is request ``rows[i][0]``'s at prompt position
        ``p = rows[i][1]``: record prompt token ``p + 1``'s logprobs."""
        if not rows:
            return
        tokens = [req.prompt[p + 1] for req, p in rows]
        ks = [req.params.prompt_logprobs or 0 for req, _ in rows]
        for (req, p), record in zip(rows, position_logprobs(logits, tokens, ks, self.names)):
            assert req.prompt_logprobs is not None
            req.prompt_logprobs[p + 1] = record

    def rows(self, logits: torch.Tensor, chosen: Sequence[tuple[Request, str]]) -> torch.Tensor:
        """The logits the sampler draws from: biases and penalties, then the
        grammar masks of the rows that do not draw first."""
        logits = penalize(logits, [row_state(req, label) for req, label in chosen])
        if self.grammars is None:
            return logits
        matchers = [
            None if draws_first(req.params) else _row_matcher(req, label) for req, label in chosen
        ]
        return self.grammars.mask(logits, matchers)

    def choose(self, req: Request, sample: Sample, logits: torch.Tensor) -> int:
        """``sample``'s next token drawn from its row ``logits`` (``rows``'):
        its matcher advanced (a refused first draw, greedy, replaced by the
        best allowed token), its logprobs recorded when asked."""
        token = sample_token(logits, req.params, sample.generator)
        matcher = sample.matcher
        if matcher is None:
            pass
        elif not draws_first(req.params):  # drawn under its mask
            accept(matcher, token, req.id)
        elif not matcher.accept_token(token):  # a refused draw leaves the matcher as it was
            assert self.grammars is not None
            token = allowed_argmax(logits, self.grammars.allowed(matcher))
            accept(matcher, token, req.id)
        if sample.logprobs is not None:
            sample.logprobs.append(sampled_logprobs(logits, req.params, token, self.names))
        return token


def allowed_argmax(row: torch.Tensor, allowed: np.ndarray) -> int:
    """The masked row's argmax without the masked row: the best of the
    ``allowed`` ids (ascending, so the first of equal ones, as ``argmax``)."""
    if not len(allowed):
        raise RuntimeError("the grammar allows no token")
    if row.device.type == "cpu" and row.dtype == torch.float32:
        return int(allowed[row.detach().numpy()[allowed].argmax()])
    ids = torch.from_numpy(allowed).to(row.device)
    return int(ids[row[ids].argmax()])


def draws_first(params: SamplingParams) -> bool:
    """A greedy row without logprobs: its grammar's mask is needed only when
    the raw row's argmax is refused."""
    return params.greedy and params.logprobs is None


def _row_matcher(req: Request, label: str) -> Any:
    """The matcher constraining stream ``label``'s logits row: its sample's;
    for a prompt stream not forked yet, that of a sample with no token yet
    (all of them in their start state), None when every sample has tokens."""
    sample = req.by_label.get(label)
    if sample is not None:
        return sample.matcher
    fresh = [s for s in req.samples if not s.token_ids and s.matcher is not None]
    return fresh[0].matcher if fresh else None
