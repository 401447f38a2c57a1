"""The pinned index ring: page-locked host buffers for the index arrays a plan hands out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mstar.engine.resources.kv.lengths import INT32_MAX, INT_TYPES


class PinnedIndexRing:
    """A ring of page-locked int32 host buffers for the index arrays a plan
    hands FlashInfer, so its ``copy_(non_blocking=True)`` calls are really
    asynchronous (from pageable memory the driver stages each one).

    The ring holds ``depth`` buffer sets, one per plan. ``begin_plan`` moves to
    the next set, and each ``take`` until the next ``begin_plan`` fills a buffer
    of that set no other take uses (the set grows if needed), so every label of
    a plan keeps its arrays however many labels there are. A set is rewritten
    only after the copies out of it have completed: ``begin_plan`` records an
    event on the current stream for the set just used, and a set waits on its
    own event before reuse. Without CUDA the buffers are plain tensors and
    nothing is recorded.
    """

    def __init__(self, numel: int = 4096, depth: int = 2, per_plan: int = 4) -> None:
        for name, value in (("numel", numel), ("depth", depth), ("per_plan", per_plan)):
            if value < 1:
                raise ValueError(f"expected {name} >= 1, got {value}")
        self._numel = numel
        self._pinned = torch.cuda.is_available()
        # Each buffer is kept with its numpy view, so a take is one numpy copy.
        self._sets = [[self._alloc(numel) for _ in range(per_plan)] for _ in range(depth)]
        self._events: list[Any] = [None] * depth
        self._current: int | None = None
        self._used = 0

    def _alloc(self, numel: int) -> tuple[torch.Tensor, np.ndarray]:
        buf = torch.empty(numel, dtype=torch.int32, pin_memory=self._pinned)
        return buf, buf.numpy()

    def begin_plan(self) -> None:
        """Start a plan: move to the next buffer set, waiting until the copies
        out of its last use have completed. A set no take has written since
        the last ``begin_plan`` (a plan refused before its arrays, or one
        ``discard_plan`` dropped) is reused instead: it holds nothing a
        handed-out plan reads."""
        if self._current is not None and self._used == 0:
            return
        if self._current is not None and self._pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[self._current] = event
        self._current = 0 if self._current is None else (self._current + 1) % len(self._sets)
        self._used = 0
        event = self._events[self._current]
        if event is not None:
            event.synchronize()
            self._events[self._current] = None

    def discard_plan(self) -> None:
        """The plan begun last will not be handed out (it failed after some
        takes): the next ``begin_plan`` reuses its buffer set, so the plan
        before it keeps its arrays."""
        self._used = 0

    def take(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Copy ``values`` into a buffer no other take of this plan uses and
        return an int32 view of exactly ``len(values)``. Values must be
        integers (Python ``int`` or numpy integer, not bool) in int32 range:
        anything else raises ``ValueError`` and takes nothing."""
        if not isinstance(values, np.ndarray) or values.dtype != np.int32 or values.ndim != 1:
            values = _int32_values(values)
        if self._current is None:
            self.begin_plan()
        n = len(values)
        buffers = self._sets[self._current]
        if self._used == len(buffers):
            buffers.append(self._alloc(max(self._numel, n)))
        buf, arr = buffers[self._used]
        if n > arr.size:
            buffers[self._used] = buf, arr = self._alloc(max(n, 2 * arr.size))
        self._used += 1
        arr[:n] = values
        return buf[:n]


def _int32_values(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """``values`` as a 1-D int32 array, or ``ValueError`` naming the first
    value that is no integer or out of int32 range."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ValueError(f"expected a 1-D integer array, got {values.dtype} {values.shape}")
        if values.size and (
            np.minimum.reduce(values) < -INT32_MAX - 1 or np.maximum.reduce(values) > INT32_MAX
        ):
            i = int(np.flatnonzero((values < -INT32_MAX - 1) | (values > INT32_MAX))[0])
            raise ValueError(f"expected int32 values, got {values[i]} at index {i}")
        return values.astype(np.int32)
    values = list(values)
    if INT_TYPES.issuperset(map(type, values)):
        try:
            return np.array(values, dtype=np.int32)
        except OverflowError:
            pass
    for i, v in enumerate(values):
        if type(v) not in INT_TYPES:
            raise ValueError(
                f"expected integer values, got {v!r} ({type(v).__name__}) at index {i}"
            )
        if not -INT32_MAX - 1 <= v <= INT32_MAX:
            raise ValueError(f"expected int32 values, got {v} at index {i}")
    raise AssertionError("int32 conversion failed but every value is valid")
