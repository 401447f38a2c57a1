"""What one engine step asks of the KV resource.

The scheduler speaks in segments: request ``r``'s stream ``label`` grows by
``span`` tokens this step. The KV manager turns a step into a plan; nothing
downstream of the plan sees these records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


class Segment(NamedTuple):
    """One step's addition to the (request_id, label) stream.

    ``span`` may be 0: the segment reads its stream without extending it.
    ``tokens``, when given, are the ``span`` token ids the segment appends
    (the prefix cache keys full pages by them; nothing else reads them).
    A step may carry them all instead (``KVStep.tokens``), which costs a
    decode step nothing.
    """

    request_id: str
    label: str
    span: int
    tokens: Sequence[int] | None = None


@dataclass(frozen=True, eq=False)
class KVStep:
    """Everything one step asks of the KV manager.

    ``combined_labels`` maps a tuple of source labels to the plan label that
    packs them (see ``group_by_plan_label``). A fork ``(from_label, to_label)``
    applies to every request with a segment in the step: ``pre_forks`` before
    the step's spans, ``post_forks`` after them. ``commit=False`` marks a step
    whose tokens are not kept. Compared by identity: a step is an event.

    ``tokens``, when given, are the step's new token ids as one 1-D integer
    numpy array: the segments' in segment order (``sum(span)`` ids), for the
    prefix cache, in place of each segment's ``tokens`` (both given is
    refused). Segments without tokens stay equal to the last step's, so a
    decode step takes the manager's fast path with the prefix cache on too.
    Read (its count checked) only with the prefix cache on, as segment
    tokens are; the manager copies what it keeps.
    """

    segments: tuple[Segment, ...]
    combined_labels: dict[tuple[str, ...], str] = field(default_factory=dict)
    pre_forks: tuple[tuple[str, str], ...] = ()
    post_forks: tuple[tuple[str, str], ...] = ()
    commit: bool = True
    tokens: Any = None  # np.ndarray, int [sum of spans], or None

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "pre_forks", tuple(tuple(f) for f in self.pre_forks))
        object.__setattr__(self, "post_forks", tuple(tuple(f) for f in self.post_forks))
        t = self.tokens
        if t is not None and not (type(t) is np.ndarray and t.ndim == 1 and t.dtype.kind in "iu"):
            what = f"{t.dtype} {t.shape}" if isinstance(t, np.ndarray) else type(t).__name__
            first = f" (first row {self.segments[0][:2]!r})" if self.segments else ""
            raise TypeError(
                f"expected KVStep tokens a 1-D integer numpy array or None, got {what}{first}"
            )
