"""The options of one layer's attention, as ``paged_attention`` and
FlashInfer's adapter both take them."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["AttentionOptions"]


class AttentionOptions(NamedTuple):
    """What a layer's attention computes beyond its rows' keys, with
    FlashInfer's semantics. Query ``i`` of a row with ``qo_len`` queries over
    ``kv_len`` keys is at position ``p = kv_len - qo_len + i``; the options
    hide keys from it and shape its scores. Immutable, so a default is safe
    and one record serves every layer alike."""

    # Query p sees keys <= p (else every key of its row).
    causal: bool = True
    # Scores are q.k * sm_scale (None: 1 / sqrt(head_dim)).
    sm_scale: float | None = None
    # >= 0: query p also hides keys < p - window_left (a sliding window of window_left + 1).
    window_left: int = -1
    # > 0: scores become softcap * tanh(s / softcap) (None: as they are).
    softcap: float | None = None
    # [num_qo_heads] (GPT-OSS's s_aux): exp(sinks[h]) joins head h's softmax denominator.
    sinks: torch.Tensor | None = None
    # >= 1: query p sees only keys of its chunk, k // chunk_size == p // chunk_size (Llama 4).
    chunk_size: int | None = None
