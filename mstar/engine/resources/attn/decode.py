"""Paged attention for a decode step: every row one query over its pages.

The fast path beside ``paged_attention`` (the reference, which serves any
plan): a step whose rows each have one query and at least one key is one
batch, and each layer's attention is a handful of calls however many rows
there are: one gather of the layer's pages (a row copy per page, into a
buffer the step's layers share), one copy into a head-major float32 buffer,
then ``baddbmm`` (scale and the key mask in one call), ``softmax`` and
``bmm`` over ``rows x KV heads`` batches, the query heads that share a KV
head being that head's queries. What is the same for every layer (the index
of the rows to gather, the key mask per set of options) is built once per
step. Softmax in float32, as the reference; softcap and sinks go to the
reference.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.kv.cache import indexed_device
from mstar.engine.resources.kv.lengths import row_lengths
from mstar.engine.resources.kv.plan import PagedIndptrs

__all__ = ["DecodeSchedule", "decode_schedule"]


def decode_schedule(
    indptrs: PagedIndptrs, page_size: int, device: torch.device | str = "cpu"
) -> DecodeSchedule | None:
    """The step's ``DecodeSchedule``, or None when some row of ``indptrs``
    has no key or other than one query (the reference serves that step)."""
    _, kv_indptr, qo_lens, num_pages, kv_lens = row_lengths(indptrs, page_size)
    if not len(qo_lens) or (qo_lens != 1).any() or (kv_lens < 1).any():
        return None
    return DecodeSchedule(indptrs, page_size, kv_indptr, num_pages, kv_lens, device)


class DecodeSchedule:
    """One decode step's attention over every layer (see the module).
    ``attend`` serves a layer when ``serves`` says so."""

    def __init__(
        self,
        indptrs: PagedIndptrs,
        page_size: int,
        kv_indptr: np.ndarray,
        num_pages: np.ndarray,
        kv_lens: np.ndarray,
        device: torch.device | str,
    ) -> None:
        self.indptrs, self.page_size = indptrs, page_size
        self.device = indexed_device(device)
        self.rows, self.width = len(num_pages), int(num_pages.max()) * page_size
        # each row's pages, padded with its last (masked): K rows 2p, then V rows 2p + 1
        col = np.minimum(np.arange(num_pages.max()), num_pages[:, None] - 1)
        page_ids = indptrs.paged_kv_indices.cpu().numpy()[kv_indptr[:-1, None] + col]
        page_ids = page_ids.astype(np.int64).ravel()
        self.kv_rows = torch.from_numpy(np.concatenate([2 * page_ids, 2 * page_ids + 1]))
        self.kv_rows = self.kv_rows.to(self.device)
        self.kv_lens = kv_lens
        self._masks: dict[tuple[int, int | None, int], torch.Tensor] = {}
        self._gathered: torch.Tensor | None = None
        self._heads: torch.Tensor | None = None

    def serves(self, kv_layer: object, options: AttentionOptions) -> bool:
        """Whether ``attend`` serves this layer: a contiguous ``[num_pages, 2,
        page_size, H_kv, D]`` layer, options without softcap or sinks."""
        return (
            isinstance(kv_layer, torch.Tensor)
            and kv_layer.dim() == 5
            and kv_layer.is_contiguous()
            and kv_layer.shape[2] == self.page_size
            and kv_layer.device == self.device
            and options.softcap is None
            and options.sinks is None
        )

    def attend(
        self, q: torch.Tensor, kv_layer: torch.Tensor, options: AttentionOptions
    ) -> torch.Tensor:
        """``q`` ``[rows, H, D]`` (row order) over the layer's pages:
        ``[rows, H, D]`` in q's dtype, as ``paged_attention`` gives it (causal
        or not is the same for a row's last query)."""
        num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
        num_heads = q.shape[1]
        if q.shape != (self.rows, num_heads, head_dim) or num_heads % num_kv_heads:
            raise ValueError(
                f"expected q of shape ({self.rows}, a multiple of {num_kv_heads}, {head_dim}),"
                f" got {tuple(q.shape)}"
            )
        batch = self.rows * num_kv_heads
        gathered, heads = self._buffers(kv_layer)
        torch.index_select(kv_layer.view(2 * kv_layer.shape[0], -1), 0, self.kv_rows, out=gathered)
        shape = (2, self.rows, self.width, num_kv_heads, head_dim)
        heads.copy_(gathered.view(shape).transpose(2, 3))  # [2, rows, H_kv, width, D], float32
        k, v = heads.view(2, batch, self.width, head_dim)
        queries = q.reshape(batch, num_heads // num_kv_heads, head_dim).float()
        scale = head_dim**-0.5 if options.sm_scale is None else options.sm_scale
        mask = self._mask(options.window_left, options.chunk_size, num_kv_heads)
        scores = torch.baddbmm(mask, queries, k.transpose(1, 2), alpha=scale)
        out = torch.bmm(torch.softmax(scores, dim=-1), v)
        return out.view(self.rows, num_heads, head_dim).to(q.dtype)

    def _buffers(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gather buffer (the layer's dtype) and the head-major float32
        buffer, shared by the step's layers."""
        gathered_shape = (self.kv_rows.numel(), kv_layer[0, 0].numel())
        if (
            self._gathered is None
            or self._gathered.shape != gathered_shape
            or self._gathered.dtype != kv_layer.dtype
        ):
            self._gathered = kv_layer.new_empty(gathered_shape)
            num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
            self._heads = torch.empty(
                (2, self.rows, num_kv_heads, self.width, head_dim),
                dtype=torch.float32,
                device=self.device,
            )
        return self._gathered, self._heads

    def _mask(self, window_left: int, chunk_size: int | None, num_kv_heads: int) -> torch.Tensor:
        """Additive float32 ``[rows * H_kv, 1, width]``: 0 where a row's query
        (at ``kv_len - 1``) sees the key slot, -inf elsewhere (memoized)."""
        key = (window_left, chunk_size, num_kv_heads)
        if key not in self._masks:
            slot = np.arange(self.width)
            query = self.kv_lens[:, None] - 1
            seen = slot < self.kv_lens[:, None]
            if window_left >= 0:
                seen &= slot >= query - window_left
            if chunk_size is not None:
                seen &= slot // chunk_size == query // chunk_size
            additive = np.where(seen, 0.0, -np.inf).astype(np.float32)
            mask = torch.from_numpy(np.repeat(additive[:, None, None], num_kv_heads, axis=1))
            self._masks[key] = mask.view(-1, 1, self.width).to(self.device)
        return self._masks[key]
