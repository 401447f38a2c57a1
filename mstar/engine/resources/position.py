"""Token positions of a packed step, read from the KV plan.

A stream's next token sits right after what it has stored, so positions come
from the plan's views rather than from a counter of their own: a fork that
shares a source's pages and length continues the source's positions.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.engine.resources.kv.plan import KVPlanOutput

__all__ = ["positions"]


def positions(plan: KVPlanOutput) -> torch.Tensor:
    """Each query token's position, int64 ``[plan.get_total_len()]`` on the
    CPU in plan order: token ``j`` of a row is at ``length - to_compute + j``
    of its view (``start`` is page-space bookkeeping, not a position)."""
    views = plan.views
    stored = np.fromiter((view.length - view.to_compute for view in views), np.int64, len(views))
    qo_indptr = plan.cpu_indptrs.qo_indptr.numpy().astype(np.int64)
    first = np.repeat(stored - qo_indptr[:-1], np.diff(qo_indptr))
    return torch.from_numpy(first + np.arange(qo_indptr[-1]))
