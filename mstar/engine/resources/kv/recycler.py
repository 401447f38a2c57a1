"""Index memory: int32 arrays whose memory is reused once nothing outside holds it.

Fresh multi-MB memory costs more in page faults than the copy into it. An
array is handed out again only when this pool's reference is its last: a
published tensor, a view or a lazy view builder keeps its base alive, so
memory in use is never reused.
"""

from __future__ import annotations

import sys

import numpy as np


class Recycler:
    """Up to ``keep`` large int32 arrays, handed out again once unreferenced."""

    def __init__(self, keep: int = 6) -> None:
        self._arrays: list[np.ndarray] = []
        self._keep = keep

    def empty(self, n: int) -> np.ndarray:
        if n < 1 << 14:  # small: fresh memory is cheap, not worth the search
            return np.empty(n, dtype=np.int32)
        arrays = self._arrays
        free = [i for i in range(len(arrays)) if sys.getrefcount(arrays[i]) == 2]
        for i in free:
            if len(arrays[i]) >= n:
                return arrays[i][:n]
        fresh = np.empty(n + n // 8 + 64, dtype=np.int32)  # room for steps to come
        if free:
            arrays[free[0]] = fresh
        elif len(arrays) < self._keep:
            arrays.append(fresh)
        return fresh[:n]
