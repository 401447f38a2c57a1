"""``build_paged_indptrs`` against building the same arrays with
``torch.tensor(list)`` (the two timed in turns), and ``max()`` over a
``HostLens`` against a plain tensor."""

from __future__ import annotations

import numpy as np
import torch

from mstar.bench import Row, time_us, turns_us
from mstar.engine.resources.kv.plan import (
    HostLens,
    PagedIndptrs,
    SequenceView,
    build_paged_indptrs,
)

PAGE_SIZE = 16


def baseline_build(views: list[SequenceView], page_size: int) -> PagedIndptrs:
    """The straightforward way: Python lists, then ``torch.tensor`` on each."""
    qo, kv_indptr, indices, last, lens = [0], [0], [], [], []
    for v in views:
        qo.append(qo[-1] + v.to_compute)
        kv_indptr.append(kv_indptr[-1] + len(v.page_idxs))
        indices.extend(v.page_idxs)
        lp = v.last_page_len(page_size) or page_size
        last.append(lp)
        lens.append(max(len(v.page_idxs) - 1, 0) * page_size + lp)
    return PagedIndptrs(
        *(torch.tensor(x, dtype=torch.int32) for x in (qo, kv_indptr, indices, last, lens))
    )


def make_views(batch: int, pages_per_row: int, page_size: int = PAGE_SIZE) -> list[SequenceView]:
    """Decode-shaped rows: each computes one token, its last page half full."""
    rng = np.random.default_rng(0)
    pool = rng.permutation(batch * pages_per_row)
    length = (pages_per_row - 1) * page_size + page_size // 2 + 1
    return [
        SequenceView(
            f"r{i}", "main", pool[i * pages_per_row : (i + 1) * pages_per_row].tolist(), length, 1
        )
        for i in range(batch)
    ]


def run(batches=(1, 32, 128, 256), pages=(1, 10, 256)) -> list[Row]:
    rows = []
    for batch in batches:
        for per_row in pages:
            views = make_views(batch, per_row)
            ours = build_paged_indptrs(views, PAGE_SIZE)
            base = baseline_build(views, PAGE_SIZE)
            assert all(torch.equal(a, b) for a, b in zip(ours, base)), "baseline disagrees"
            ours_us, base_us = turns_us(
                [
                    lambda v=views: build_paged_indptrs(v, PAGE_SIZE),
                    lambda v=views: baseline_build(v, PAGE_SIZE),
                ]
            )
            rows.append(
                Row(
                    "build_paged_indptrs",
                    f"batch={batch} pages/row={per_row}",
                    ours_us,
                    base_us,
                    params={"batch": batch, "pages_per_row": per_row},
                )
            )
    values = np.arange(128, dtype=np.int32) * 7 % 1000
    lens, plain = HostLens(values), torch.from_numpy(values.copy())
    assert max(lens).item() == max(plain).item()
    rows.append(
        Row(
            "max(kv_lens)",
            "128 rows: HostLens vs tensor",
            time_us(lambda: max(lens)),
            time_us(lambda: max(plain)),
        )
    )
    return rows
