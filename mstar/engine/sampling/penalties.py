"""Logit biases and penalties, batched over a step's rows.

``penalize(logits, rows)`` is a pure function of the step's logits rows and
each row's state (its ``SamplingParams``, prompt and generated tokens): the
token counts come from one ``scatter_add`` over the padded rows, each penalty
is one tensor expression over every row, so no Python runs per vocabulary
entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.engine.request import Request
from mstar.engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class RowState:
    """What a logits row's penalties read: its request's settings, its prompt
    and the tokens its sample generated so far."""

    params: SamplingParams
    prompt: Sequence[int]
    generated: Sequence[int]


def row_state(req: Request, label: str) -> RowState:
    """The state of stream ``label``'s logits row (a prompt stream not
    forked yet has generated nothing)."""
    sample = req.by_label.get(label)
    return RowState(req.params, req.prompt, () if sample is None else sample.token_ids)


def penalize(logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
    """``logits`` ``[R, vocab]`` with each row's ``logit_bias`` added, then
    HF's repetition penalty over prompt + generated (a seen token's logit
    divided by it when positive, multiplied when not), then OpenAI's
    presence/frequency penalties over generated tokens (``- presence * (count
    > 0) - frequency * count``). Returns a float32 copy when any row has
    one, else ``logits`` itself."""
    assert len(rows) == logits.shape[0], "a state per logits row"
    picked = [i for i, r in enumerate(rows) if r.params.penalized]
    if not picked:
        return logits
    out = logits.float().clone()
    sub = out[picked]
    states = [rows[i] for i in picked]
    device = logits.device

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    bias = [(j, t, v) for j, s in enumerate(states) for t, v in s.params.logit_bias]
    if bias:
        at_row, at_token, value = zip(*bias)
        sub.index_put_(
            (torch.tensor(at_row, device=device), torch.tensor(at_token, device=device)),
            torch.tensor(value, dtype=torch.float32, device=device),
            accumulate=True,
        )
    repetition = column([s.params.repetition_penalty for s in states])
    if bool((repetition != 1).any()):
        seen = _counts(sub.shape[1], [[*s.prompt, *s.generated] for s in states], device) > 0
        scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, scaled, sub)
    presence = column([s.params.presence_penalty for s in states])
    frequency = column([s.params.frequency_penalty for s in states])
    if bool((presence != 0).any() or (frequency != 0).any()):
        counts = _counts(sub.shape[1], [s.generated for s in states], device)
        sub = sub - presence * (counts > 0) - frequency * counts
    out[picked] = sub
    return out


def _counts(vocab: int, ids: list[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``[len(ids), vocab]`` float32: how often each token occurs in each row's ids."""
    width = max((len(row) for row in ids), default=0)
    if width == 0:
        return torch.zeros(len(ids), vocab, dtype=torch.float32, device=device)
    padded = torch.full((len(ids), width), vocab, dtype=torch.int64)
    for i, row in enumerate(ids):
        padded[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.int64)
    padded = padded.to(device)
    ones = (padded < vocab).float()
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, ones)
    return counts[:, :vocab]
