"""A step's rotary position embedding, computed once and applied per layer.

``StepRotary`` takes the model's own rotary module (HF's ``rotary_emb``: its
frequencies, scaling and ``attention_scaling`` whatever the rope type) at the
step's positions, once per step, and applies it to the query and key heads
of every layer in three ops: ``x * cos + swap(x) * sin'``, where ``swap``
exchanges each head's two halves and ``sin'`` is ``sin`` with its first half
negated. That is HF's ``x * cos + rotate_half(x) * sin`` (``rotate_half(x) =
cat(-x2, x1)``, and ``-x2 * s == x2 * -s`` exactly), without the concat and
the negation per layer. ``RotaryTable`` holds those tables at every position
up to the highest one seen, made by the module once, so that a step gathers
its rows instead of calling the module (~0.1-0.2 ms of Python a step).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["STATIC_ROPE", "RotaryTable", "StepRotary"]

# rope types whose frequencies are fixed when the module is made (HF's
# ``dynamic_rope_update`` recomputes the others' at a call, from its positions)
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
TABLE_BYTES = 16 << 20  # most bytes of a ``RotaryTable``'s two tables (8192 positions of 256)


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

    @classmethod
    def of_rows(cls, cos_rows: torch.Tensor, sin_rows: torch.Tensor) -> StepRotary:
        """The tables of a step as given: ``cos`` and ``sin'`` ``[T, D]``, contiguous."""
        rotary = cls.__new__(cls)
        rotary.half, rotary.signs = cos_rows.shape[-1] // 2, None
        rotary.cos_rows, rotary.sin_rows = cos_rows, sin_rows
        return rotary

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


class RotaryTable:
    """``rotary_emb``'s tables (``StepRotary``'s ``cos_rows``, ``sin_rows``) at
    positions ``0 .. n-1``, float32 on the CPU, made by the module at once: a
    step's rows gathered from them are the module's at those positions bit
    for bit (each element is computed on its own: a product, then cos or sin
    and the module's scaling). For rope types whose frequencies are fixed
    (``STATIC_ROPE``, ``serves``); ``n`` doubles past the largest position
    asked, up to ``TABLE_BYTES`` (a step past that gets None: computed by the
    module), and the tables are made anew when the module's ``inv_freq`` or
    ``attention_scaling`` changed."""

    def __init__(self, rotary_emb: torch.nn.Module, n: int = 1024) -> None:
        self.rotary_emb = rotary_emb
        self._make(n)

    @staticmethod
    def serves(rotary_emb: torch.nn.Module) -> bool:
        """Whether the module's frequencies are fixed (a table holds at any step)."""
        return getattr(rotary_emb, "rope_type", None) in STATIC_ROPE and isinstance(
            getattr(rotary_emb, "inv_freq", None), torch.Tensor
        )

    def __call__(self, position_ids: torch.Tensor) -> StepRotary | None:
        """The step's tables at ``position_ids`` (int64 ``[T]``, CPU), or None
        past the most positions the tables may hold."""
        emb = self.rotary_emb
        current = emb.inv_freq is self._inv_freq and emb.inv_freq._version == self._version
        if not current or emb.attention_scaling != self._scaling:
            self._make(len(self.cos))
        if len(position_ids) and (top := int(position_ids.max())) >= len(self.cos):
            most = TABLE_BYTES // (8 * self.cos.shape[-1])
            if top >= most:
                return None
            self._make(min(most, 2 * top + 2))
        return StepRotary.of_rows(self.cos[position_ids], self.sin[position_ids])

    def _make(self, n: int) -> None:
        emb = self.rotary_emb
        self._inv_freq, self._version = emb.inv_freq, emb.inv_freq._version
        self._scaling = emb.attention_scaling
        whole = StepRotary(emb, torch.arange(n), torch.float32)
        self.cos, self.sin = whole.cos_rows, whole.sin_rows


def _fits(signs: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``signs`` are ``[D]`` of ``sin`` ``[..., D]``'s dtype and device."""
    return signs.shape == sin.shape[-1:] and signs.dtype == sin.dtype and signs.device == sin.device


def _signs(half: int, like: torch.Tensor) -> torch.Tensor:
    """``[2 * half]``: -1 then +1, in ``like``'s dtype and on its device."""
    signs = torch.ones(2 * half, dtype=like.dtype, device=like.device)
    signs[:half] = -1
    return signs
