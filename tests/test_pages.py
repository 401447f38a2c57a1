"""PagePool: a page is free xor owned, and free again after its last owner."""

import numpy as np

from mstar.engine.resources.kv.pages import PagePool


def test_pages_return_after_the_last_owner():
    pool = PagePool(6)
    a = pool.alloc(4)
    assert len(set(a.tolist())) == 4 and pool.num_free == 2
    assert pool.refcount[a].tolist() == [1] * 4
    pool.share(a[:2])
    assert pool.shared() == 2
    pool.release(a)
    assert pool.num_free == 4 and sorted(pool.refcount[a[:2]].tolist()) == [1, 1]
    assert set(pool.free_pages().tolist()).isdisjoint(a[:2].tolist())
    pool.release(a[:2])
    assert pool.num_free == 6 and sorted(pool.free_pages().tolist()) == list(range(6))
    assert pool.shared() == 0 and not pool.refcount.any()


def test_alloc_zero_and_reuse():
    pool = PagePool(3)
    assert pool.alloc(0).size == 0 and pool.num_free == 3
    first = pool.alloc(3)
    pool.release(first)
    again = pool.alloc(3)
    assert sorted(again.tolist()) == [0, 1, 2] and pool.num_free == 0
    assert np.array_equal(np.sort(again), np.sort(first))
