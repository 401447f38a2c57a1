"""Paged attention in plain PyTorch, with FlashInfer's semantics.

The portable reference path: it runs wherever PyTorch does (the CPU included)
and reads exactly what a FlashInfer wrapper's plan reads, so the two can be
checked against each other on the same plan.
"""

from __future__ import annotations

import torch

from mstar.engine.resources.kv.plan import PagedIndptrs

__all__ = ["paged_attention"]


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    indptrs: PagedIndptrs,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    window_left: int = -1,
) -> torch.Tensor:
    """Attention of each row's queries over its pages.

    ``q`` is ``[qo_indptr[-1], num_qo_heads, head_dim]`` in plan row order;
    ``kv_layer`` is one layer ``[num_pages, 2, page_size, num_kv_heads,
    head_dim]`` of q's dtype and device; ``indptrs`` may live on any device
    (the work runs on q's). Returns q's shape and dtype.

    A row's keys are its pages in order, ``kv_len = (num_pages - 1) *
    page_size + last_page_len`` (0 for a row with no pages). Query ``i`` of a
    row with ``qo_len`` queries is at position ``p = kv_len - qo_len + i``;
    under ``causal`` it sees keys ``<= p``, and ``window_left >= 0`` also hides
    keys ``< p - window_left``. Query head ``h`` reads KV head ``h // (H /
    H_kv)``. ``sm_scale`` defaults to ``1 / sqrt(head_dim)``. A query whose
    keys are all masked gives zeros. Rows are padded to the longest and
    computed in one batch, softmax in float32.
    """
    _check_inputs(q, kv_layer, indptrs)
    device = q.device
    total_q, num_qo_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    scale = head_dim**-0.5 if sm_scale is None else sm_scale

    qo_indptr = indptrs.qo_indptr.to(device, torch.int64)
    kv_indptr = indptrs.paged_kv_indptr.to(device, torch.int64)
    qo_lens = qo_indptr.diff()
    rows = torch.nonzero(qo_lens > 0).flatten()
    out = torch.zeros_like(q)
    if rows.numel() == 0:
        return out
    qo_len = qo_lens[rows]
    num_pages = kv_indptr.diff()[rows]
    last = indptrs.paged_kv_last_page_len.to(device, torch.int64)[rows]
    kv_len = torch.where(num_pages > 0, (num_pages - 1) * page_size + last, 0)
    max_pages = int(num_pages.max())
    if max_pages == 0:
        return out

    # Queries padded to [R, max_q]; padding slots read a real token and are dropped.
    qi = torch.arange(int(qo_len.max()), device=device)
    q_valid = qi < qo_len[:, None]
    q_tok = (qo_indptr[rows, None] + qi).clamp_max(total_q - 1)
    # Pages padded to [R, max_pages] and gathered in one index op.
    page_slot = (kv_indptr[rows, None] + torch.arange(max_pages, device=device)).clamp_max(
        indptrs.paged_kv_indices.numel() - 1
    )
    kv = kv_layer[indptrs.paged_kv_indices.to(device, torch.int64)[page_slot]]
    num_rows, kv_width = rows.numel(), max_pages * page_size
    # [R, H_kv, 1, L, D]: one KV head serves a group of query heads.
    k = kv[:, :, 0].reshape(num_rows, kv_width, num_kv_heads, head_dim).transpose(1, 2)[:, :, None]
    v = kv[:, :, 1].reshape(num_rows, kv_width, num_kv_heads, head_dim).transpose(1, 2)[:, :, None]
    # [R, H_kv, G, max_q, D]
    group = num_qo_heads // num_kv_heads
    qp = q[q_tok].view(num_rows, -1, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)

    scores = (qp.float() @ k.float().transpose(-1, -2)) * scale
    key_pos = torch.arange(kv_width, device=device)
    query_pos = (kv_len - qo_len)[:, None] + qi
    visible = key_pos < kv_len[:, None, None]
    if causal:
        visible = visible & (key_pos <= query_pos[..., None])
    if window_left >= 0:
        visible = visible & (key_pos >= query_pos[..., None] - window_left)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    weights = (scores - torch.where(peak.isfinite(), peak, 0.0)).exp()
    # The denominator is >= 1 when any key is visible (the peak term is
    # exp(0)) and 0 otherwise, where the weights are all 0: clamping to 1 turns
    # fully masked queries into zeros.
    rows_out = (weights @ v.float()) / weights.sum(dim=-1, keepdim=True).clamp_min(1.0)
    rows_out = rows_out.permute(0, 3, 1, 2, 4).reshape(num_rows, -1, num_qo_heads, head_dim)
    out[q_tok[q_valid]] = rows_out[q_valid].to(q.dtype)
    return out


def _check_inputs(q: torch.Tensor, kv_layer: torch.Tensor, indptrs: PagedIndptrs) -> None:
    if q.dim() != 3:
        raise ValueError(
            f"expected q of shape [total_q, num_qo_heads, head_dim], got {tuple(q.shape)}"
        )
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(
            "expected kv_layer of shape [num_pages, 2, page_size, num_kv_heads, head_dim],"
            f" got {tuple(kv_layer.shape)}"
        )
    num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
    if q.shape[2] != head_dim:
        raise ValueError(f"expected q head_dim {head_dim} (kv_layer's), got {q.shape[2]}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"expected num_qo_heads a multiple of num_kv_heads {num_kv_heads}, got {q.shape[1]}"
        )
    if q.dtype != kv_layer.dtype:
        raise ValueError(f"expected q of dtype {kv_layer.dtype} (kv_layer's), got {q.dtype}")
    if q.device != kv_layer.device:
        raise ValueError(f"expected q on {kv_layer.device} (kv_layer's device), got {q.device}")
    if len(indptrs.qo_indptr) != len(indptrs.paged_kv_indptr):
        raise ValueError(
            f"expected qo_indptr and paged_kv_indptr of equal length,"
            f" got {len(indptrs.qo_indptr)} and {len(indptrs.paged_kv_indptr)}"
        )
    total_q = int(indptrs.qo_indptr[-1])
    if q.shape[0] != total_q:
        raise ValueError(f"expected {total_q} query tokens (qo_indptr[-1]), got {q.shape[0]}")
