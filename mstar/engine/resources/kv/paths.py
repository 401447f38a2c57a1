"""Row-count thresholds that pick the manager's code paths: each path gives
the same plan; the counts only choose the fastest one for a step's size."""

from __future__ import annotations

from dataclasses import dataclass

LEFT_AHEAD = 8  # rows that may leave ahead of a step's reused rows


@dataclass
class Paths:
    """Row counts that pick a step's code path (each path gives the same plan)."""

    few_rows: int = 8  # up to this many rows, per-row arithmetic runs on Python ints
    splice_rows: int = 64  # from this many rows a label's indices are spliced from its last
    tail_rows: int = 8  # rows after the last plan's that are spliced from their tables
