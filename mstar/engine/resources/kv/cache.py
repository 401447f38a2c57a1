"""The paged KV cache: per-layer page tensors and the plan-driven write.

The cache owns memory only; which page holds which token is the plan's
business. ``write`` stores a step's new keys and values where the plan says
they go, so attention over the same plan reads them back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mstar.engine.resources.kv.plan import KVPlanOutput
from mstar.engine.resources.position import positions

__all__ = ["KVCache"]


class KVCache:
    """One tensor per layer in FlashInfer's combined NHD layout
    ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (index 0 on dim 1 is
    K, 1 is V), zero-initialised on ``device``."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        sizes = {
            "num_layers": num_layers,
            "num_pages": num_pages,
            "page_size": page_size,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"expected {name} >= 1, got {value}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, 2, page_size, num_kv_heads, head_dim)
        self._layers = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    def layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s page tensor (the storage itself, not a copy)."""
        self._check_layer(layer)
        return self._layers[layer]

    def write(self, layer: int, plan: KVPlanOutput, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys and values of ``layer``.

        ``k``/``v`` are ``[plan.get_total_len(), num_kv_heads, head_dim]`` in
        the cache's dtype and on its device, rows in plan order. Token ``j`` of
        a row lands at page-space position ``start + length - to_compute + j``
        of that row. Decode plans are addressed by their ``decode_pages`` /
        ``decode_offsets`` alone, without building views.
        """
        self._check_layer(layer)
        expected = (plan.get_total_len(), self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(f"expected {name} of shape {expected}, got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise ValueError(f"expected {name} of dtype {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"expected {name} on {self.device}, got {t.device}")
        pages, offsets = _write_slots(plan, self.page_size)
        where = torch.from_numpy(np.stack([pages, offsets])).to(self.device)
        cache = self._layers[layer]
        cache[where[0], 0, where[1]] = k
        cache[where[0], 1, where[1]] = v

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
        for cache in self._layers:
            cache[dst_t] = cache[src_t]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"expected layer in [0, {self.num_layers}), got {layer}")


def _write_slots(plan: KVPlanOutput, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each new token's ``(page, offset)``, int64 ``[plan.get_total_len()]`` each."""
    if plan.decode_pages is not None:
        return plan.decode_pages, plan.decode_offsets
    indptrs = plan.cpu_indptrs
    counts = np.diff(indptrs.qo_indptr.numpy().astype(np.int64))
    starts = np.fromiter((view.start for view in plan.views), np.int64, len(counts))
    # A token's place in its row's page space: its position, shifted by the row's start.
    pos = positions(plan).numpy() + np.repeat(starts, counts)
    kv_indptr = indptrs.paged_kv_indptr.numpy().astype(np.int64)
    slot = np.repeat(kv_indptr[:-1], counts) + pos // page_size
    return indptrs.paged_kv_indices.numpy()[slot].astype(np.int64), pos % page_size
