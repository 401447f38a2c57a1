"""A step's rotary position embedding, computed once and applied per layer.

``StepRotary`` takes the model's own rotary module (HF's ``rotary_emb``: its
frequencies, scaling and ``attention_scaling`` whatever the rope type) at the
step's positions, once per step, and applies it to the query and key heads
of every layer in three ops: ``x * cos + swap(x) * sin'``, where ``swap``
exchanges each head's two halves and ``sin'`` is ``sin`` with its first half
negated. That is HF's ``x * cos + rotate_half(x) * sin`` (``rotate_half(x) =
cat(-x2, x1)``, and ``-x2 * s == x2 * -s`` exactly), without the concat and
the negation per layer.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["StepRotary"]


class StepRotary:
    """The rotary tables of one step: ``cos`` and ``sin'`` ``[T, 1, D]`` at
    ``position_ids`` (int64 ``[T]``), in ``dtype``; applied out of place
    (``__call__``) or in place by the layer ops (``rotate_``).

    ``sin'`` is ``sin * signs`` (``signs`` ``[D]``: -1 over the first half,
    +1 over the second; the same bits as negating the first half, sines
    being finite): a caller that builds one a step passes the last one's
    ``signs`` back in, made here when None or of another width, dtype or
    device."""

    def __init__(
        self,
        rotary_emb: torch.nn.Module,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        signs: torch.Tensor | None = None,
    ) -> None:
        probe = torch.empty(0, dtype=dtype, device=position_ids.device)
        cos, sin = rotary_emb(probe, position_ids[None])
        self.half = cos.shape[-1] // 2
        if signs is None or not _fits(signs, sin):
            signs = _signs(self.half, sin)
        self.signs = signs
        # [T, D] each, contiguous (the layer ops' rotary_ reads them so)
        self.cos_rows = cos[0].contiguous()
        self.sin_rows = torch.mul(sin[0], signs)

    @functools.cached_property
    def cos(self) -> torch.Tensor:
        """``cos`` ``[T, 1, D]`` (the aten path's; the layer ops read ``cos_rows``)."""
        return self.cos_rows[:, None, :]

    @functools.cached_property
    def sin(self) -> torch.Tensor:
        """``sin'`` ``[T, 1, D]``."""
        return self.sin_rows[:, None, :]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, D]`` (any strides) rotated, a new tensor."""
        swapped = x.unflatten(-1, (2, self.half)).flip(-2).flatten(-2)
        return torch.addcmul(x * self.cos, swapped, self.sin)

    def rotate_(self, rows: torch.Tensor, heads: int) -> None:
        """The first ``heads`` heads of each row of ``rows`` ``[T, W]``
        (contiguous float32) rotated in place, by the layer ops."""
        torch.ops.mstar_layer.rotary_.default(
            rows, self.cos_rows, self.sin_rows, heads, 2 * self.half
        )


def _fits(signs: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``signs`` are ``[D]`` of ``sin`` ``[..., D]``'s dtype and device."""
    return signs.shape == sin.shape[-1:] and signs.dtype == sin.dtype and signs.device == sin.device


def _signs(half: int, like: torch.Tensor) -> torch.Tensor:
    """``[2 * half]``: -1 then +1, in ``like``'s dtype and on its device."""
    signs = torch.ones(2 * half, dtype=like.dtype, device=like.device)
    signs[:half] = -1
    return signs
