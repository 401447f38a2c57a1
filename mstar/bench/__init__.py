"""Benchmarks behind ``mstar-kv bench`` and ``benchmarks/*.py``.

Every figure is ours against the issue's baseline timed in the same run (the
machine's noise hits both), so the ratio is the figure that matters.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    """One configuration: our time, the baseline's, and optionally a floor
    (the least any implementation must spend, e.g. one copy of the indices)."""

    bench: str
    config: str
    ours_us: float
    baseline_us: float
    floor_us: float | None = None
    params: dict[str, int] = field(default_factory=dict)  # the config, as numbers
    note: str = ""  # e.g. the ratio to a reference step of the same run

    @property
    def speedup(self) -> float:
        return self.baseline_us / self.ours_us

    @property
    def over_floor(self) -> float | None:
        return None if self.floor_us is None else self.ours_us / self.floor_us

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup, "over_floor": self.over_floor}


def time_us(
    fn: Callable[[], object], *, repeat: int = 5, target_s: float = 0.02, max_calls: int = 1 << 20
) -> float:
    """Microseconds per call: the best of ``repeat`` runs of a batch of calls
    sized to take about ``target_s`` (the best run is the least disturbed).
    At most ``max_calls`` calls in all, for ``fn`` that consume something
    (a decode step takes pages)."""
    number, calls = 1, 0
    while True:
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - t0
        calls += number
        if elapsed >= target_s / 4 or calls + 4 * number > max_calls // 2:
            break
        number *= 4
    per_call = max(elapsed, 1e-9) / number
    number = max(1, min(round(target_s / per_call), (max_calls - calls) // repeat))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / number * 1e6


def turns_us(
    fns: list[Callable[[], object]], *, rounds: int = 101, target_s: float = 0.001
) -> list[float]:
    """Microseconds per call of each of ``fns``, timed in turns: each round
    runs a short batch of calls of each, in a shuffled order (so no rhythm of
    the machine's other work falls on one of them), and each gets the median
    of its rounds. A loaded machine's bursts hit them alike, so their ratios
    hold where ``time_us`` one after the other would not."""
    numbers = []
    for fn in fns:  # warmed up, then a batch of about target_s each
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        numbers.append(max(1, round(target_s * 10 / max(time.perf_counter() - t0, 1e-7))))
    times: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    shuffle = random.Random(0).shuffle
    collecting = gc.isenabled()
    gc.disable()  # as timeit does: a collection lands on whichever batch runs then
    try:
        for _ in range(rounds):
            shuffle(order)
            for i in order:
                fn, number = fns[i], numbers[i]
                t0 = time.perf_counter()
                for _ in range(number):
                    fn()
                times[i].append((time.perf_counter() - t0) / number)
    finally:
        if collecting:
            gc.enable()
    return [sorted(t)[len(t) // 2] * 1e6 for t in times]


def format_table(rows: list[Row]) -> str:
    """A plain-text table of ``rows``: µs per call, the ratio, the floor."""
    head = (
        "bench",
        "config",
        "ours µs",
        "baseline µs",
        "speedup",
        "floor µs",
        "ours/floor",
        "note",
    )
    body = [
        (
            r.bench,
            r.config,
            f"{r.ours_us:.1f}",
            f"{r.baseline_us:.1f}",
            f"{r.speedup:.1f}x",
            "" if r.floor_us is None else f"{r.floor_us:.1f}",
            "" if r.over_floor is None else f"{r.over_floor:.2f}x",
            r.note,
        )
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [
        "  ".join(
            x.rjust(w) if 1 < i < 7 else x.ljust(w) for i, (x, w) in enumerate(zip(line, widths))
        )
        for line in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
