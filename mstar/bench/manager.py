"""Steady-state decode through ``KVManager`` (admit + plan + commit a step)
against the straightforward manager: Python-list page tables, every view a
list slice, the indices by list extends and ``torch.tensor``. The floor is a
bare numpy copy of the step's ``paged_kv_indices``: what any plan built on
the host must at least spend."""

from __future__ import annotations

import numpy as np

from mstar.bench import Row, time_us
from mstar.bench.plan import baseline_build
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.kv.plan import SequenceView
from mstar.engine.resources.step import KVStep, Segment

PAGE_SIZE = 16
MAX_STEPS = 4096  # decode steps timed per configuration, at most
HEADROOM_PAGES = MAX_STEPS // PAGE_SIZE + 2  # per row, for those steps


class ListManager:
    """The baseline: one decode step at a time, the obvious way."""

    def __init__(self, rows: list[str], context: int, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        per_row = -(-context // page_size) + HEADROOM_PAGES
        self.free = list(range(len(rows) * per_row))
        self.stored = {r: context + i % page_size for i, r in enumerate(rows)}
        self.tables = {
            r: [self.free.pop() for _ in range(-(-n // page_size))] for r, n in self.stored.items()
        }

    def decode(self, rows: list[str]):
        ps = self.page_size
        for r in rows:  # admit: a page for each row whose next token starts one
            if self.stored[r] + 1 > len(self.tables[r]) * ps:
                self.tables[r].append(self.free.pop())
        views = []
        for r in rows:  # plan
            length = self.stored[r] + 1
            views.append(SequenceView(r, "main", self.tables[r][: -(-length // ps)], length, 1))
        out = baseline_build(views, ps)
        for r in rows:  # commit
            self.stored[r] += 1
        return out


def decode_manager(rows: list[str], context: int, page_size: int = PAGE_SIZE) -> KVManager:
    """A KVManager with row ``i`` prefilled to ``context + i % page_size``
    tokens: staggered, so every step some rows start a page (as in a real
    batch) rather than all of them every ``page_size``-th step."""
    per_row = -(-context // page_size) + HEADROOM_PAGES
    mgr = KVManager(num_pages=len(rows) * per_row, page_size=page_size)
    prefill = KVStep(tuple(Segment(r, "main", context + i % page_size) for i, r in enumerate(rows)))
    mgr.admit(prefill)
    mgr.plan(prefill)
    mgr.commit(prefill)
    return mgr


def decode_once(mgr: KVManager, segments: tuple[Segment, ...]):
    step = KVStep(segments)
    mgr.admit(step)
    plans = mgr.plan(step)
    mgr.commit(step)
    return plans


def run(batches=(1, 32, 256), contexts=(1024, 4096, 32768)) -> list[Row]:
    rows = []
    for batch in batches:
        for context in contexts:
            names = [f"r{i}" for i in range(batch)]
            segments = tuple(Segment(r, "main", 1) for r in names)
            mgr, base = decode_manager(names, context), ListManager(names, context)
            ours_plan, base_plan = decode_once(mgr, segments)["main"], base.decode(names)
            assert len(ours_plan.cpu_indptrs.paged_kv_indices) == len(base_plan.paged_kv_indices)
            indices = ours_plan.cpu_indptrs.paged_kv_indices.numpy()
            rows.append(
                Row(
                    "decode step",
                    f"batch={batch} context={context}",
                    time_us(lambda m=mgr, s=segments: decode_once(m, s), max_calls=MAX_STEPS - 1),
                    time_us(lambda b=base, n=names: b.decode(n), max_calls=MAX_STEPS - 1),
                    time_us(lambda a=indices: np.copy(a)),
                    params={"batch": batch, "context": context},
                )
            )
    return rows
