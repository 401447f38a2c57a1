"""The manager's invariants, checked on demand (tests, debugging).

Every page is free xor owned; owner counts equal the streams naming each
page plus the reservations of steps in flight (fork targets such a step
replaced still own theirs); free + owned pages are all the pages; and the
stream table's and the pool's own rules hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.streams import StreamTable

if TYPE_CHECKING:
    from mstar.engine.resources.kv.admission import Admitted


def check_invariants(pool: PagePool, streams: StreamTable, in_flight: list[Admitted]) -> None:
    """Raise ``AssertionError`` naming the first broken rule."""
    free = pool.free_pages()
    live = streams.live()  # and fork targets a step in flight replaced:
    live += [s for rec in in_flight for s in rec.journal.replaced()]
    held = [streams.tables[s][: streams.npages[s]] for s in live]
    held += [rec.journal.reserved[rec.journal.taken :] for rec in in_flight]
    held = np.concatenate([np.zeros(0, np.int32), *held])
    counts = np.bincount(held, minlength=pool.num_pages)
    if len(np.unique(free)) != len(free) or counts[free].any():
        raise AssertionError("broken rule: every page is free xor owned")
    if not np.array_equal(counts, pool.refcount):
        bad = int(np.flatnonzero(counts != pool.refcount)[0])
        raise AssertionError(
            f"broken rule: owner counts equal the streams naming each page"
            f" (page {bad}: refcount {pool.refcount[bad]}, named {counts[bad]} times)"
        )
    streams.check(live, streams.page_size, pool.refcount)
    if pool.num_free + np.count_nonzero(counts) != pool.num_pages:
        raise AssertionError("broken rule: free + owned == num_pages")
    pool.check()
