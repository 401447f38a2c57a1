"""Token positions of a packed step, read from the KV plan.

A stream's next token sits right after what it has stored, so positions come
from the plan rather than from a counter of their own: a fork that shares a
source's pages and length continues the source's positions.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.engine.resources.kv.plan import KVPlanOutput

__all__ = ["positions"]


def positions(plan: KVPlanOutput) -> torch.Tensor:
    """Each query token's position, int64 ``[plan.get_total_len()]`` on the
    CPU in plan order. With ``kv_offsets`` (a windowed plan) token ``j`` of a
    row is at ``kv_offsets[row] + kv_len - to_compute + j`` (its key slot
    shifted by the tokens released before the row's first page); else at
    ``length - to_compute + j`` of its view (``start`` is page-space
    bookkeeping, not a position).

    Read from ``qo_indptr`` and ``kv_lens`` (``start + length`` of each row
    that has pages) while the plan's views are unbuilt or it has
    ``kv_offsets``, so a decode step never builds them; from the views once
    they exist or without ``kv_lens``."""
    indptrs = plan.cpu_indptrs
    qo_indptr = indptrs.qo_indptr.numpy().astype(np.int64)
    counts = np.diff(qo_indptr)
    offsets = plan.kv_offsets
    if offsets is None and (plan.views_built or indptrs.kv_lens is None):
        views = plan.views
        stored = np.fromiter((v.length - v.to_compute for v in views), np.int64, len(views))
    else:  # the builder's kv_lens are the page-space lengths
        stored = np.asarray(indptrs.kv_lens, dtype=np.int64) - counts
        if offsets is not None:
            stored += offsets
    if qo_indptr[-1] == len(counts) and counts.min(initial=1) == 1:  # decode: a token a row
        return torch.from_numpy(stored)
    first = np.repeat(stored - qo_indptr[:-1], counts)
    return torch.from_numpy(first + np.arange(qo_indptr[-1]))
