"""Paged attention in plain PyTorch, with FlashInfer's semantics.

The portable reference path: it runs wherever PyTorch does (the CPU included)
and reads exactly what a FlashInfer wrapper's plan reads, so the two can be
checked against each other on the same plan.

A step's rows are computed in batches of similar shape, each padded only to
its own longest row, so a decode row is never padded to a prefill chunk's
length. A batch is one gather of its pages (a row copy per page) and one
fused ``scaled_dot_product_attention`` call; softcap and sinks, which sdpa
cannot express, take an explicit float32 softmax.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.kv.cache import cache_serves, indexed_device
from mstar.engine.resources.kv.lengths import row_lengths
from mstar.engine.resources.kv.plan import PagedIndptrs

__all__ = ["AttentionSchedule", "paged_attention"]

KVLayer = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def paged_attention(
    q: torch.Tensor,
    kv_layer: KVLayer,
    indptrs: PagedIndptrs,
    options: AttentionOptions = AttentionOptions(),
    *,
    schedule: AttentionSchedule | None = None,
) -> torch.Tensor:
    """Attention of each row's queries over its pages.

    ``q`` is ``[qo_indptr[-1], num_qo_heads, head_dim]`` in plan row order;
    ``kv_layer`` is one layer ``[num_pages, 2, page_size, num_kv_heads,
    head_dim]``, or a ``(k, v)`` pair ``[num_pages, page_size, num_kv_heads,
    head_dim]`` and ``[..., v_head_dim]``, of q's dtype (or bfloat16 or
    float16 under float32 ``q``: read as float32) and device;
    ``indptrs`` may live on any device (the work runs on q's). Returns
    ``[total_q, num_qo_heads, v_head_dim]`` in q's dtype.

    A row's keys are its pages in order, ``kv_len = (num_pages - 1) *
    page_size + last_page_len`` (0 for a row with no pages); ``options``
    (``AttentionOptions``: causal, window, chunks, scale, softcap, sinks)
    say which of them each query sees and how it scores them. Query head
    ``h`` reads KV head ``h // (H / H_kv)``. A query whose keys are all
    masked gives zeros. Softmax in float32.
    ``schedule`` (an ``AttentionSchedule`` of ``indptrs``) saves a layer the
    host-side work that is the same for every layer of a step.
    """
    k_pages, v_pages = _check_inputs(q, kv_layer, indptrs, options)
    if schedule is None:
        schedule = AttentionSchedule(indptrs, k_pages.shape[1], q.device)
    elif schedule.indptrs is not indptrs or schedule.page_size != k_pages.shape[1]:
        raise ValueError(
            "expected a schedule built from these indptrs and page size"
            f" {k_pages.shape[1]}, got one for page size {schedule.page_size}"
        )
    elif schedule.device != q.device:
        raise ValueError(f"expected a schedule for {q.device}, got one for {schedule.device}")
    scale = q.shape[2] ** -0.5 if options.sm_scale is None else options.sm_scale
    softcap, sinks = options.softcap, options.sinks
    sink = None if sinks is None else sinks.to(q.device, torch.float32)
    shape = (q.shape[0], q.shape[1], v_pages.shape[-1])
    out = q.new_empty(shape) if schedule.writes_all else q.new_zeros(shape)
    masks = schedule.masks(options.causal, options.window_left, options.chunk_size)
    for i, (batch, (visible, blind)) in enumerate(zip(schedule.batches, masks)):
        k, v = _gather(kv_layer, k_pages, v_pages, batch, schedule.scratch(i, kv_layer))
        if k.dtype != q.dtype:  # a half-precision cache under float32 queries
            k, v = k.to(q.dtype), v.to(q.dtype)
        if batch.span is None:
            rows_q = q[batch.tokens]
        else:
            rows_q = q[batch.span].view(*batch.tokens.shape, *q.shape[1:])
        if softcap is None and sink is None:
            rows_out = _sdpa(rows_q, k, v, visible, scale, blind)
        else:
            rows_out = _attend(rows_q, k, v, visible, scale, softcap, sink)
        if batch.span is None:
            # A padding query repeats its row's last, so it writes the same value again.
            out[batch.tokens] = rows_out.to(q.dtype)
        else:
            out[batch.span] = rows_out.flatten(0, 1)
    return out


# A batch's visibility mask [R, max_q, L] (None: all visible) and its queries
# that see no key [R, max_q] (None: none).
_Masks = tuple[torch.Tensor | None, torch.Tensor | None]


class _Batch(NamedTuple):
    """Rows computed together, padded to their longest query and most pages
    with each row's last ones (the padding is masked, or written twice)."""

    tokens: torch.Tensor  # int64 [R, max_q]: each query's token in q
    span: slice | None  # the same tokens when they are a run of q in order, unpadded
    page_ids: torch.Tensor  # int64 [R, max_pages]
    kv_rows: torch.Tensor  # int64 [2 * R * max_pages]: the pages' K rows, then V rows (_gather)
    kv_lens: np.ndarray  # int64 [R]
    query_pos: np.ndarray  # int64 [R, max_q]: each query's key slot


class AttentionSchedule:
    """The layer-independent part of ``paged_attention`` over one plan's
    index arrays: rows batched by shape (``_batch_rows``), each batch's
    tokens and pages as index tensors on ``device``, and its masks, built
    once per set of mask options. Build it once per step and pass it to
    every layer's call (a call without one builds its own). A row without
    queries or keys is in no batch: its queries give zeros. The schedule
    also lends each batch a gather buffer that every layer reuses (a fresh
    one each layer costs page faults as large as the copy)."""

    def __init__(
        self, indptrs: PagedIndptrs, page_size: int, device: torch.device | str = "cpu"
    ) -> None:
        self.indptrs = indptrs
        self.page_size = page_size
        self.device = indexed_device(device)
        qo_indptr, kv_indptr, qo_lens, num_pages, kv_lens = row_lengths(indptrs, page_size)
        live = np.flatnonzero((qo_lens > 0) & (num_pages > 0))
        groups = _batch_rows(live, qo_lens, kv_lens)
        host_indices = indptrs.paged_kv_indices.cpu().numpy()
        self.batches: list[_Batch] = []
        for rows in groups:
            qi = np.minimum(np.arange(qo_lens[rows].max()), qo_lens[rows, None] - 1)
            col = np.minimum(np.arange(num_pages[rows].max()), num_pages[rows, None] - 1)
            page_ids = host_indices[kv_indptr[rows, None] + col].astype(np.int64)
            tokens = qo_indptr[rows, None] + qi
            first = int(tokens[0, 0])
            in_order = np.array_equal(tokens.ravel(), np.arange(first, first + tokens.size))
            kv_rows = np.concatenate([2 * page_ids.ravel(), 2 * page_ids.ravel() + 1])
            self.batches.append(
                _Batch(
                    torch.from_numpy(tokens).to(self.device),
                    slice(first, first + tokens.size) if in_order else None,
                    torch.from_numpy(page_ids).to(self.device),
                    torch.from_numpy(kv_rows).to(self.device),
                    kv_lens[rows],
                    (kv_lens - qo_lens)[rows, None] + qi,
                )
            )
        self.writes_all = not qo_lens[num_pages == 0].any()  # every query is in a batch
        self._masks: dict[tuple, list[_Masks]] = {}
        self._scratch: list[torch.Tensor | None] = [None] * len(self.batches)

    def scratch(self, i: int, kv_layer: KVLayer) -> torch.Tensor | None:
        """Batch ``i``'s gather buffer for a contiguous ``[num_pages, 2, ...]``
        layer (None for a ``(k, v)`` pair or a strided layer)."""
        if not isinstance(kv_layer, torch.Tensor) or not kv_layer.is_contiguous():
            return None
        shape = (2 * self.batches[i].page_ids.numel(), kv_layer[0, 0].numel())
        buf = self._scratch[i]
        if buf is None or buf.shape != shape or buf.dtype != kv_layer.dtype:
            buf = self._scratch[i] = kv_layer.new_empty(shape)
        return buf

    def masks(self, causal: bool, window_left: int, chunk_size: int | None) -> list[_Masks]:
        """Each batch's visibility mask under these options, and its queries
        that see no key (memoized)."""
        key = (causal, window_left, chunk_size)
        if key not in self._masks:
            self._masks[key] = []
            for b in self.batches:
                seen = _visible(b, self.page_size, causal, window_left, chunk_size, self.device)
                blind = None if seen is None else ~seen.any(dim=-1)
                self._masks[key].append(
                    (seen, blind if blind is not None and blind.any() else None)
                )
        return self._masks[key]


# A batch takes a row while its padded ``queries x keys`` stays within
# PAD_RATIO x its rows' own plus PAD_SLACK: padding is gathered and attended
# like keys, and one batch more costs a few calls, about as much as PAD_SLACK
# pairs on SmolLM2's attention shape.
PAD_RATIO, PAD_SLACK = 1.1, 256


def _batch_rows(rows: np.ndarray, qo_lens: np.ndarray, kv_lens: np.ndarray) -> list:
    """Rows in batches, most queries (then keys) first, padded within
    ``PAD_RATIO`` and ``PAD_SLACK``, so decode rows of similar lengths share
    one batch and are never padded to a prefill chunk's queries."""
    groups: list[list[int]] = []
    actual = widest = 0
    for row in rows[np.lexsort((kv_lens[rows], qo_lens[rows]))[::-1]].tolist():
        q_len, kv_len = int(qo_lens[row]), int(kv_lens[row])
        if groups:  # the batch's first row has its most queries
            padded = (len(groups[-1]) + 1) * int(qo_lens[groups[-1][0]]) * max(kv_len, widest)
            if padded <= PAD_RATIO * (actual + q_len * kv_len) + PAD_SLACK:
                groups[-1].append(row)
                actual, widest = actual + q_len * kv_len, max(widest, kv_len)
                continue
        groups.append([row])
        actual, widest = q_len * kv_len, kv_len
    return [np.array(sorted(g)) for g in groups]  # in plan order: q's tokens in a run


def _visible(
    batch: _Batch,
    page_size: int,
    causal: bool,
    window_left: int,
    chunk_size: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Bool ``[R, max_q, width]``: which key slots each query sees; None
    when it sees them all."""
    width = batch.page_ids.shape[1] * page_size
    max_q = batch.query_pos.shape[1]
    if (
        (batch.kv_lens == width).all()
        and (max_q == 1 or not causal)
        and window_left < 0
        and chunk_size is None
    ):
        return None
    key = torch.arange(width, device=device)
    query = torch.from_numpy(batch.query_pos).to(device)[..., None]
    seen = key < torch.from_numpy(batch.kv_lens).to(device)[:, None, None]
    if causal:
        seen = seen & (key <= query)
    if window_left >= 0:
        seen = seen & (key >= query - window_left)
    if chunk_size is not None:
        seen = seen & (key // chunk_size == query // chunk_size)
    return seen.expand(-1, max_q, -1)


def _gather(
    kv_layer: KVLayer,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: _Batch,
    scratch: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys and values, ``[R, L, H_kv, dim]`` each, from the
    batch's pages ``[R, max_pages]``. A page is one row of a ``[pages,
    page_size * H_kv * dim]`` view, so gathering copies rows; a contiguous
    ``[num_pages, 2, ...]`` layer is one such view of ``2 * num_pages`` rows
    (page ``p``'s keys row ``2p``, its values ``2p + 1``: ``batch.kv_rows``),
    read in one call into ``scratch`` (given exactly for such a layer)."""
    num_rows = batch.page_ids.shape[0]
    _, page_size, num_kv_heads, _ = k_pages.shape
    width = batch.page_ids.shape[1] * page_size
    if scratch is not None:
        rows = kv_layer.view(2 * kv_layer.shape[0], -1)
        torch.index_select(rows, 0, batch.kv_rows, out=scratch)
        k, v = scratch.view(2, num_rows, width, num_kv_heads, -1)
        return k, v
    ids = batch.page_ids.flatten()
    k = k_pages.flatten(1).index_select(0, ids).view(num_rows, width, num_kv_heads, -1)
    v = v_pages.flatten(1).index_select(0, ids).view(num_rows, width, num_kv_heads, -1)
    return k, v


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    blind: torch.Tensor | None,
) -> torch.Tensor:
    """``_attend`` without softcap or sinks, as one
    ``scaled_dot_product_attention`` call on strided views (its fused
    kernel softmaxes in float32); queries in ``blind`` (``[R, max_q]``,
    seeing no key) give zeros, whatever the backend makes of them. With one
    query per row (decode) the query heads that share a KV head are that
    head's queries, so the kernel reads each KV head once, not once per
    query head. Returns ``[R, max_q, H, v_dim]`` in q's dtype."""
    num_rows, max_q, num_heads, _ = q.shape
    num_kv_heads = k.shape[2]
    mask = None if visible is None else visible[:, None]
    if max_q == 1:
        grouped = q.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, -1)
        rows_out = F.scaled_dot_product_attention(
            grouped, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
        ).reshape(num_rows, 1, num_heads, -1)
    else:
        rows_out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
    if blind is not None:
        rows_out = rows_out.masked_fill(blind[..., None, None], 0.0)
    return rows_out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sink: torch.Tensor | None,
) -> torch.Tensor:
    """``R`` rows padded to a common shape, with softcap or sinks (which
    sdpa cannot express): ``q`` ``[R, max_q, H, D]`` over keys and values
    ``[R, L, H_kv, dim]``, ``visible`` ``[R, max_q, L]`` (None: all); returns
    float32 ``[R, max_q, H, v_dim]``."""
    num_rows, max_q, num_heads, head_dim = q.shape
    num_kv_heads, width = k.shape[2], k.shape[1]
    group = num_heads // num_kv_heads
    # [R, H_kv, G * max_q, D]: the query heads that share a KV head, stacked.
    qg = q.reshape(num_rows, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(num_rows, num_kv_heads, group * max_q, head_dim).float()
    scores = _matmul(qg, k.float().permute(0, 2, 3, 1)).mul_(scale)
    scores = scores.view(num_rows, num_kv_heads, group, max_q, width)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if visible is not None:
        scores = scores.masked_fill_(~visible[:, None, None], float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    if sink is not None:
        sink = sink.view(1, num_kv_heads, group, 1, 1)
        peak = torch.maximum(peak, sink)
    peak = torch.where(peak.isfinite(), peak, 0.0)
    weights = scores.sub_(peak).exp_()
    denom = weights.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + (sink - peak).exp()
    # The denominator is >= 1 when any key (or a sink) is visible, since the
    # peak term is exp(0), and 0 otherwise, where the weights are all 0:
    # clamping to 1 turns fully masked queries into zeros.
    weights = weights.div_(denom.clamp_min_(1.0))
    weights = weights.view(num_rows, num_kv_heads, group * max_q, width)
    rows_out = _matmul(weights, v.float().transpose(1, 2))
    rows_out = rows_out.reshape(num_rows, num_kv_heads, group, max_q, -1)
    return rows_out.permute(0, 3, 1, 2, 4).reshape(num_rows, max_q, num_heads, -1)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``[R, H_kv, M, K] @ [R, H_kv, K, N]`` where ``b`` is a
    strided view of gathered pages: with few query rows per KV head (decode)
    one ``bmm`` per KV head reads ``b`` in place, where ``matmul`` would first
    copy it whole; returns ``[R, H_kv, M, N]`` (possibly a transposed view)."""
    if a.shape[2] > 16:
        return a @ b
    out = a.new_empty(a.shape[1], a.shape[0], a.shape[2], b.shape[3])
    for head in range(a.shape[1]):
        torch.bmm(a[:, head], b[:, head], out=out[head])
    return out.transpose(0, 1)


def _check_inputs(
    q: torch.Tensor,
    kv_layer: KVLayer,
    indptrs: PagedIndptrs,
    options: AttentionOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V pages ``[num_pages, page_size, num_kv_heads, dim]``."""
    if q.dim() != 3:
        raise ValueError(
            f"expected q of shape [total_q, num_qo_heads, head_dim], got {tuple(q.shape)}"
        )
    if isinstance(kv_layer, tuple):
        if len(kv_layer) != 2 or any(t.dim() != 4 for t in kv_layer):
            raise ValueError(
                "expected a (k, v) pair of [num_pages, page_size, num_kv_heads, dim] each,"
                f" got shapes {[tuple(t.shape) for t in kv_layer]}"
            )
        k_pages, v_pages = kv_layer
        if k_pages.shape[:3] != v_pages.shape[:3] or k_pages.dtype != v_pages.dtype:
            raise ValueError(
                f"expected k and v pages alike but for their width, got {tuple(k_pages.shape)}"
                f" {k_pages.dtype} and {tuple(v_pages.shape)} {v_pages.dtype}"
            )
    else:
        if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
            raise ValueError(
                "expected kv_layer of shape [num_pages, 2, page_size, num_kv_heads, head_dim],"
                f" got {tuple(kv_layer.shape)}"
            )
        k_pages, v_pages = kv_layer[:, 0], kv_layer[:, 1]
    num_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    if q.shape[2] != head_dim:
        raise ValueError(f"expected q head_dim {head_dim} (kv_layer's), got {q.shape[2]}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"expected num_qo_heads a multiple of num_kv_heads {num_kv_heads}, got {q.shape[1]}"
        )
    if not cache_serves(k_pages.dtype, q.dtype):
        raise ValueError(f"expected q of dtype {k_pages.dtype} (kv_layer's), got {q.dtype}")
    if q.device != k_pages.device:
        raise ValueError(f"expected q on {k_pages.device} (kv_layer's device), got {q.device}")
    sinks, softcap, chunk_size = options.sinks, options.softcap, options.chunk_size
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"expected sinks of shape ({q.shape[1]},), got {tuple(sinks.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"expected softcap > 0 or None, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"expected chunk_size >= 1 or None, got {chunk_size}")
    if len(indptrs.qo_indptr) != len(indptrs.paged_kv_indptr):
        raise ValueError(
            f"expected qo_indptr and paged_kv_indptr of equal length,"
            f" got {len(indptrs.qo_indptr)} and {len(indptrs.paged_kv_indptr)}"
        )
    total_q = int(indptrs.qo_indptr[-1])
    if q.shape[0] != total_q:
        raise ValueError(f"expected {total_q} query tokens (qo_indptr[-1]), got {q.shape[0]}")
    return k_pages, v_pages
