"""Log-probabilities of sampled and prompt tokens, and the top alternatives.

A sampled token's come from the logits the sampler used: after biases and
penalties, divided by ``temperature`` (not when greedy), before ``top_k`` /
``top_p`` / ``min_p`` filtering (as vLLM reports by default). A prompt
token's come from the model's own logits at the position before it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability; ``token`` its text (None without a tokenizer)."""

    token_id: int
    logprob: float
    token: str | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """A position's token (``chosen``) and the ``k`` most likely there
    (``top``, most likely first)."""

    chosen: Logprob
    top: tuple[Logprob, ...]


class TokenNames:
    """Token ids to their text and UTF-8 bytes through a Hugging Face fast
    tokenizer (a byte-level BPE's tokens map back to their exact bytes, so
    a piece of a multi-byte character has its own bytes)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        byte_level = "ByteLevel" in type(tokenizer.backend_tokenizer.decoder).__name__
        self._unicode_bytes = _byte_level_alphabet() if byte_level else None

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def bytes(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            table = self._unicode_bytes
            if table is not None and piece is not None and all(c in table for c in piece):
                found = bytes(table[c] for c in piece)
            else:
                found = self._tokenizer.decode([token_id]).encode("utf-8")
            self._bytes[token_id] = found
        return found


def sampled_logprobs(
    logits: torch.Tensor, params: SamplingParams, token: int, names: TokenNames | None
) -> TokenLogprobs:
    """``token``'s record from the logits row ``[vocab]`` it was sampled from."""
    scores = logits.float()
    if not params.greedy:
        scores = scores / params.temperature
    assert params.logprobs is not None
    return position_logprobs(scores.unsqueeze(0), [token], [params.logprobs], names)[0]


def position_logprobs(
    scores: torch.Tensor, tokens: Sequence[int], ks: Sequence[int], names: TokenNames | None
) -> list[TokenLogprobs]:
    """The record of ``tokens[i]`` at row ``i`` of ``scores`` ``[R, vocab]``
    (log-softmax in float32) with the ``ks[i]`` most likely tokens of its row
    (fewer when fewer are possible: masked tokens, at -inf, are left out)."""
    lp = torch.log_softmax(scores.float(), dim=-1)
    ids = torch.as_tensor(list(tokens), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = max(ks, default=0)
    top = lp.topk(k, dim=-1) if k else None
    top_ids = top.indices.tolist() if top is not None else [[] for _ in tokens]
    top_lps = top.values.tolist() if top is not None else [[] for _ in tokens]

    def record(token_id: int, value: float) -> Logprob:
        return Logprob(token_id, value, None if names is None else names.text(token_id))

    return [
        TokenLogprobs(
            record(t, c),
            tuple(record(i, v) for i, v in zip(ti[:kr], tv[:kr]) if v != float("-inf")),
        )
        for t, c, ti, tv, kr in zip(tokens, chosen, top_ids, top_lps, ks)
    ]


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, mapped back to the byte:
    printable Latin-1 bytes stand for themselves, the others for 256 + i in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table
