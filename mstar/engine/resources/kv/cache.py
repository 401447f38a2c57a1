"""The paged KV cache: per-layer page tensors and the plan-driven write.

The cache owns memory only; which page holds which token is the plan's
business. ``write`` stores a step's new keys and values where the plan says
they go, so attention over the same plan reads them back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mstar.engine.resources.kv.lengths import row_lengths
from mstar.engine.resources.kv.plan import KVPlanOutput

__all__ = ["KVCache", "KVLayer", "cache_serves"]

# One layer: FlashInfer's combined NHD tensor, or its (k, v) tuple form.
KVLayer = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# The half-precision dtypes a cache may hold under float32 activations (written rounded,
# read back as float32 by attention).
HALVES = (torch.bfloat16, torch.float16)


def cache_serves(cache: torch.dtype, activations: torch.dtype) -> bool:
    """Whether a KV cache of dtype ``cache`` serves keys, values and queries
    of dtype ``activations``: the same dtype, or a half-precision cache
    (``HALVES``) under float32."""
    return cache == activations or (activations == torch.float32 and cache in HALVES)


class KVCache:
    """Per-layer page tensors in FlashInfer's NHD layouts, zero-initialised on
    ``device``: one ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
    tensor per layer (index 0 on dim 1 is K, 1 is V), or, when ``v_head_dim``
    differs from ``head_dim`` (MLA models such as DeepSeek-V3), a ``(k, v)``
    pair ``[num_pages, page_size, num_kv_heads, head_dim]`` and ``[...,
    v_head_dim]``. ``v_head_dim=None`` means ``head_dim``."""

    # The constructor's arguments of these names, each checked >= 1.
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ) -> None:
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        sizes = {
            "num_layers": num_layers,
            "num_pages": num_pages,
            "page_size": page_size,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "v_head_dim": v_head_dim,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"expected {name} >= 1, got {value}")
        vars(self).update(sizes)
        self.dtype = dtype
        self.device = indexed_device(device)
        base = (num_pages, page_size, num_kv_heads)
        self._layers: list[KVLayer] = []
        for _ in range(num_layers):
            if v_head_dim == head_dim:
                layer = torch.zeros((num_pages, 2, *base[1:], head_dim), dtype=dtype, device=device)
            else:
                layer = tuple(
                    torch.zeros((*base, d), dtype=dtype, device=device)
                    for d in (head_dim, v_head_dim)
                )
            self._layers.append(layer)
        # The write rows of the last plan written, (plan, K rows, V rows): a
        # step writes every layer through the same plan.
        self._slots: tuple[KVPlanOutput, torch.Tensor, torch.Tensor] | None = None

    def layer(self, layer: int) -> KVLayer:
        """Layer ``layer``'s pages (the storage itself, not a copy): one tensor,
        or a ``(k, v)`` pair when the value width differs."""
        self._check_layer(layer)
        return self._layers[layer]

    def write(self, layer: int, plan: KVPlanOutput, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys and values of ``layer``.

        ``k`` is ``[plan.get_total_len(), num_kv_heads, head_dim]`` and ``v``
        ``[..., v_head_dim]``, in the cache's dtype (or float32 into a
        bfloat16 or float16 cache: rounded to it) and on its device, rows in
        plan order. A row with ``n`` queries and ``kv_len`` keys (from its
        index arrays, as attention reads them) stores token ``j`` at key slot
        ``kv_len - n + j``, which for a plan built from views is ``start +
        length - to_compute + j``. Decode plans are addressed by their
        ``decode_pages`` / ``decode_offsets``. Views are never built, and the
        slots are computed once per plan, not once per layer.
        """
        self._check_layer(layer)
        # the plan's token count: its write rows' once computed (no host read per layer)
        same = self._slots is not None and self._slots[0] is plan
        total = self._slots[1].numel() if same else plan.get_total_len()
        for name, t, width in (("k", k, self.head_dim), ("v", v, self.v_head_dim)):
            expected = (total, self.num_kv_heads, width)
            if tuple(t.shape) != expected:
                raise ValueError(f"expected {name} of shape {expected}, got {tuple(t.shape)}")
            if not cache_serves(self.dtype, t.dtype):
                raise ValueError(f"expected {name} of dtype {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"expected {name} on {self.device}, got {t.device}")
        k_rows, v_rows = self.write_rows(plan)
        cache = self._layers[layer]
        k_width, v_width = self.num_kv_heads * self.head_dim, self.num_kv_heads * self.v_head_dim
        k_cache, v_cache = cache if isinstance(cache, tuple) else (cache, cache)
        k, v = k.to(self.dtype), v.to(self.dtype)  # rounded into a half-precision cache
        k_cache.view(-1, k_width).index_copy_(0, k_rows, k.reshape(total, k_width))
        v_cache.view(-1, v_width).index_copy_(0, v_rows, v.reshape(total, v_width))

    def write_rows(self, plan: KVPlanOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``plan``'s new keys and values go to, int64
        ``[plan.get_total_len()]`` each, in a layer seen as one row per token
        slot (``[..., H_kv * dim]``; K and V of a ``[num_pages, 2, ...]``
        layer are rows of one such view): what ``write`` copies into,
        computed once per plan. For a caller writing every layer of a step
        itself (a fused kernel)."""
        if self._slots is None or self._slots[0] is not plan:
            pages, offsets = _write_slots(plan, self.page_size)
            self._slots = (plan, *self._rows(pages, offsets))
        return self._slots[1], self._slots[2]

    def _rows(self, pages: np.ndarray, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V rows of slots ``(pages, offsets)`` in a layer seen as
        one row per token slot (``[..., H_kv * dim]``): one ``index_copy_``
        each writes a step's keys and values."""
        if self.v_head_dim != self.head_dim:  # (k, v) pair: [num_pages * page_size] rows each
            k_rows = v_rows = pages * self.page_size + offsets
        else:  # [num_pages, 2, page_size]: K rows then V rows of each page
            k_rows = pages * (2 * self.page_size) + offsets
            v_rows = k_rows + self.page_size
        where = torch.from_numpy(np.stack([k_rows, v_rows]).astype(np.int64)).to(self.device)
        return where[0], where[1]

    def copy_pages(self, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> None:
        """Copy page ``src[i]`` onto page ``dst[i]`` in every layer (a fork's
        partially filled last page). All sources are read before any write."""
        src_ids = np.asarray(src, dtype=np.int64)
        dst_ids = np.asarray(dst, dtype=np.int64)
        if src_ids.ndim != 1 or src_ids.shape != dst_ids.shape:
            raise ValueError(
                f"expected src and dst of equal 1-D length, got shapes {src_ids.shape}"
                f" and {dst_ids.shape}"
            )
        for name, ids in (("src", src_ids), ("dst", dst_ids)):
            bad = (ids < 0) | (ids >= self.num_pages)
            if bad.any():
                raise ValueError(
                    f"expected {name} page ids in [0, {self.num_pages}), got {int(ids[bad][0])}"
                )
        src_t = torch.from_numpy(src_ids).to(self.device)
        dst_t = torch.from_numpy(dst_ids).to(self.device)
        # index_select + index_copy_: ~0.2 ms a page over 30 layers on CPU, where
        # ``part[dst] = part[src]`` (index_put_) took ~2.7 ms
        for cache in self._layers:
            for part in cache if isinstance(cache, tuple) else (cache,):
                part.index_copy_(0, dst_t, part.index_select(0, src_t))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"expected layer in [0, {self.num_layers}), got {layer}")


def _write_slots(plan: KVPlanOutput, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each new token's ``(page, offset)``, int64 ``[plan.get_total_len()]`` each,
    from the plan's index arrays alone."""
    if plan.decode_pages is not None:
        return plan.decode_pages, plan.decode_offsets
    qo_indptr, kv_indptr, counts, _, kv_lens = row_lengths(plan.cpu_indptrs, page_size)
    if (kv_lens < counts).any():
        row = int(np.flatnonzero(kv_lens < counts)[0])
        raise ValueError(
            f"expected row {row} to hold its {counts[row]} new tokens, got kv_len {kv_lens[row]}"
        )
    # A token's key slot: its row's first new slot plus its index in the row.
    slot = np.repeat(kv_lens - counts - qo_indptr[:-1], counts) + np.arange(qo_indptr[-1])
    page = np.repeat(kv_indptr[:-1], counts) + slot // page_size
    return plan.cpu_indptrs.paged_kv_indices.numpy()[page].astype(np.int64), slot % page_size


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``"cuda"`` is the current CUDA device, so it
    compares equal to the device of tensors made on it (``cuda:0``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
