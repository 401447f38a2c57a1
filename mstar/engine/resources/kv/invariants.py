"""The manager's invariants, checked on demand (tests, debugging).

Every page is free xor owned; owner counts equal the streams naming each
page plus the reservations of steps in flight (fork targets such a step
replaced still own theirs); free + owned pages are all the pages; and the
stream table's and the pool's own rules hold. A pool shared by several
managers (``KVGroups``) is checked against the sum of their owners
(``check_owners``); each manager alone checks only that it owns no more of a
page than the pool counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.streams import StreamTable

if TYPE_CHECKING:
    from mstar.engine.resources.kv.admission import Admitted


def check_invariants(
    pool: PagePool, streams: StreamTable, in_flight: list[Admitted], shared: bool = False
) -> None:
    """Raise ``AssertionError`` naming the first broken rule. ``shared``: the
    pool has other managers, whose pages this one does not see."""
    counts = owner_counts(pool.num_pages, streams, in_flight)
    if shared:
        if (counts > pool.refcount).any():
            bad = int(np.flatnonzero(counts > pool.refcount)[0])
            raise AssertionError(
                f"broken rule: a manager owns no more of a page than the pool counts"
                f" (page {bad}: refcount {pool.refcount[bad]}, named {counts[bad]} times)"
            )
    else:
        check_owners(pool, counts)
    streams.check(_live(streams, in_flight), streams.page_size, pool.refcount)


def owner_counts(num_pages: int, streams: StreamTable, in_flight: list[Admitted]) -> np.ndarray:
    """How many times the manager's streams and reservations name each page."""
    held = [streams.tables[s][: streams.npages[s]] for s in _live(streams, in_flight)]
    held += [rec.journal.reserved[rec.journal.taken :] for rec in in_flight]
    held = np.concatenate([np.zeros(0, np.int32), *held])
    return np.bincount(held, minlength=num_pages)


def check_owners(pool: PagePool, counts: np.ndarray) -> None:
    """``pool`` against ``counts``, every owner of each of its pages (every
    manager's): free pages are owned by none, the refcounts are the counts,
    free + owned == num_pages, and the pool's own rules."""
    free = pool.free_pages()
    if len(np.unique(free)) != len(free) or counts[free].any():
        raise AssertionError("broken rule: every page is free xor owned")
    if not np.array_equal(counts, pool.refcount):
        bad = int(np.flatnonzero(counts != pool.refcount)[0])
        raise AssertionError(
            f"broken rule: owner counts equal the streams naming each page"
            f" (page {bad}: refcount {pool.refcount[bad]}, named {counts[bad]} times)"
        )
    if pool.num_free + np.count_nonzero(counts) != pool.num_pages:
        raise AssertionError("broken rule: free + owned == num_pages")
    pool.check()


def _live(streams: StreamTable, in_flight: list[Admitted]) -> list[int]:
    """The live slots, and fork targets a step in flight replaced."""
    return streams.live() + [s for rec in in_flight for s in rec.journal.replaced()]
