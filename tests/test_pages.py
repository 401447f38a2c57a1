"""PagePool: a page is free xor owned xor cached-unowned; the prefix cache
finds pages by content, verifies them, and evicts least recently released."""

import numpy as np
import pytest

from mstar.engine.resources.kv.keys import _BASE, _seed
from mstar.engine.resources.kv.pages import PageKeys, PagePool
from mstar.engine.resources.kv.tails import PER_ANCHOR

MASK = (1 << 64) - 1


def ref_keys(tokens, page_size, parent, namespace):
    """The documented key, token by token in Python ints."""
    h = _seed(namespace) if parent is None else parent
    out = []
    for i in range(len(tokens) // page_size):
        for t in tokens[i * page_size : (i + 1) * page_size]:
            h = (h * _BASE + (int(t) & MASK)) & MASK
        out.append(h)
    return out


def cached_pool(num_pages, page_size, chains, namespace=""):
    """A pool with each token chain in ``chains`` allocated, registered and
    released (cached-unowned); returns the pool and each chain's pages."""
    pool = PagePool(num_pages, page_size)
    out = []
    for tokens in chains:
        keys = pool.page_keys(tokens, None, namespace)
        pages = pool.alloc(len(keys.hashes))
        pool.register(pages, keys)
        pool.release(pages)
        out.append(pages)
    pool.check()
    return pool, out


# --- ownership without the cache ---------------------------------------------------------


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
    pool.check()


def test_alloc_zero_and_reuse():
    pool = PagePool(3)
    assert pool.alloc(0).size == 0 and pool.num_free == 3
    first = pool.alloc(3)
    pool.release(first)
    again = pool.alloc(3)
    assert sorted(again.tolist()) == [0, 1, 2] and pool.num_free == 0
    assert np.array_equal(np.sort(again), np.sort(first))


# --- keys --------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_keys_match_the_documented_hash_and_chain(page_size):
    rng = np.random.default_rng(page_size)
    tokens = rng.integers(-(2**62), 2**62, size=5 * page_size + page_size // 2)
    pool = PagePool(4, page_size)
    keys = pool.page_keys(tokens, None, "ns")
    assert keys.hashes.tolist() == ref_keys(tokens, page_size, None, "ns")
    assert keys.tokens.tolist() == tokens[: 5 * page_size].reshape(5, page_size).tolist()
    rest = pool.page_keys(tokens[2 * page_size :].tolist(), keys.hashes[1].item(), "ns")
    assert rest.hashes.tolist() == keys.hashes[2:].tolist()  # chaining from a parent
    longer = pool.page_keys(np.arange(3000 * page_size), None, "")  # powers grow
    assert (
        longer.hashes[-3:].tolist() == ref_keys(range(3000 * page_size), page_size, None, "")[-3:]
    )
    assert pool.page_keys(tokens[: page_size - 1], None).last is None
    assert keys.last == keys.hashes[-1]


def test_page_keys_differ_by_prefix_and_namespace():
    pool = PagePool(4, 2)
    a = pool.page_keys([1, 2, 3, 4], None, "")
    b = pool.page_keys([9, 9, 3, 4], None, "")
    assert a.hashes[1] != b.hashes[1]  # equal page, different prefix
    assert pool.page_keys([1, 2], None, "x").hashes[0] != a.hashes[0]
    assert pool.page_keys([1, 2], None, "").hashes[0] == a.hashes[0]  # and back
    assert pool.page_keys([1, 2], None, "x").hashes[0] == ref_keys([1, 2], 2, None, "x")[0]


@pytest.mark.parametrize("bad", [[1.0, 2.0], ["a", "b"], [[1, 2]], [2**70, 1]])
def test_page_keys_refuse_non_integer_tokens(bad):
    with pytest.raises(ValueError, match="integer token ids"):
        PagePool(4, 2).page_keys(bad, None)


def test_cache_needs_a_page_size():
    with pytest.raises(ValueError, match="page_size"):
        PagePool(4).page_keys([1, 2], None)


# --- register / lookup -------------------------------------------------------------------


def test_lookup_finds_the_longest_cached_run_and_share_revives():
    tokens = np.arange(40) % 7
    pool, (pages,) = cached_pool(16, 4, [tokens[:24]])
    assert pool.num_cached == 6 and pool.num_free == 16 and pool.num_registered == 6
    keys = pool.page_keys(tokens[:39], None)
    got = pool.lookup(keys)
    assert got.tolist() == pages.tolist()
    assert pool.lookup(pool.page_keys(tokens[:10], None)).tolist() == pages[:2].tolist()
    diverged = tokens[:39].copy()
    diverged[9] += 1  # inside page 2
    assert pool.lookup(pool.page_keys(diverged, None)).tolist() == pages[:2].tolist()
    assert pool.lookup(pool.page_keys(tokens[:24], None, "other")).size == 0
    pool.share(got[:3])
    assert pool.num_cached == 3 and pool.num_free == 13
    assert pool.refcount[got[:3]].tolist() == [1, 1, 1]
    pool.check()
    # continuing a chain from a page the caller holds
    tail = pool.page_keys(tokens[12:24], keys.hashes[2].item())
    assert pool.lookup(tail, parent=int(got[2])).tolist() == pages[3:].tolist()
    assert pool.lookup(tail, parent=int(got[1])).size == 0  # wrong parent page


def test_eviction_is_lru_and_a_streams_later_pages_go_first():
    a, b = np.arange(12), np.arange(100, 112)
    pool = PagePool(6, 4)
    pa, pb = pool.alloc(3), pool.alloc(3)
    pool.register(pa, pool.page_keys(a, None))
    pool.register(pb, pool.page_keys(b, None))
    pool.release(pb)  # b first: least recently released
    pool.release(pa)
    assert pool.num_free == 6 and pool.num_cached == 6 and pool.free_pages().size == 6
    first = pool.alloc(2)
    assert first.tolist() == [pb[2], pb[1]] and pool.num_evicted == 2
    assert pool.lookup(pool.page_keys(b, None)).tolist() == [pb[0]]
    pool.share(pa[:1])  # owned again: out of the evictable set
    assert pool.alloc(2).tolist() == [pb[0], pa[2]]
    assert pool.alloc(1).tolist() == [pa[1]]
    assert pool.num_free == 0 and pool.num_cached == 0 and pool.num_registered == 1
    pool.check()


def test_free_stack_is_used_before_any_eviction():
    pool, (pages,) = cached_pool(5, 2, [np.arange(4)])
    got = pool.alloc(3)
    assert set(got.tolist()).isdisjoint(pages.tolist()) and pool.num_evicted == 0
    assert pool.alloc(1).tolist() == [pages[1]] and pool.num_evicted == 1


def test_register_keeps_the_first_page_for_a_key():
    tokens = np.arange(8)
    pool = PagePool(8, 4)
    first, dup = pool.alloc(2), pool.alloc(2)
    pool.register(first, pool.page_keys(tokens, None))
    pool.register(dup, pool.page_keys(tokens, None))
    assert pool.num_registered == 2
    assert pool.lookup(pool.page_keys(tokens, None)).tolist() == first.tolist()
    pool.register(first, pool.page_keys(tokens, None))  # registering again: no change
    pool.release(dup)
    assert pool.num_free == 6 and pool.num_cached == 0  # the duplicates were never cached
    pool.check()


def test_pages_after_a_duplicate_hang_off_its_twin_and_go_with_it():
    """A stream that computed a prefix another stream registered first:
    its later pages register after the twin's pages, and evicting the twin
    unregisters them (their parent link would lie once the twin is reused)."""
    prompt, turn = np.arange(8), np.arange(8, 12)
    pool = PagePool(6, 4)
    a, b = pool.alloc(2), pool.alloc(3)
    pool.register(a, pool.page_keys(prompt, None))
    keys = pool.page_keys(np.concatenate((prompt, turn)), None)
    pool.register(b[:2], PageKeys(keys.hashes[:2], keys.tokens[:2], ""))
    pool.register(b[2:], PageKeys(keys.hashes[2:], keys.tokens[2:], ""), parent=int(b[1]))
    assert pool.num_registered == 3
    assert pool.lookup(keys).tolist() == [a[0], a[1], b[2]]
    pool.release(a)  # the twin goes cached; b's own copies stay owned
    pool.check()
    assert pool.alloc(1).tolist() == [5]  # the free stack first
    evicted = pool.alloc(1)
    assert evicted.tolist() == [a[1]]
    assert pool.num_registered == 1  # b[2] went with its parent a[1]
    assert pool.lookup(keys).tolist() == [a[0]]
    pool.check()
    # b's later pages can no longer be registered: their parent is gone
    pool.register(b[2:], PageKeys(keys.hashes[2:], keys.tokens[2:], ""), parent=int(b[1]))
    assert pool.num_registered == 1
    pool.release(b)
    assert pool.num_cached == 1 and pool.num_free == 4
    pool.check()


def test_a_child_released_before_its_parent_is_evicted_first():
    prompt, turn = np.arange(8), np.arange(8, 16)
    pool = PagePool(6, 4)
    a, b = pool.alloc(2), pool.alloc(3)
    pool.register(a, pool.page_keys(prompt, None))
    keys = pool.page_keys(np.concatenate((prompt, turn[:4])), None)
    pool.register(b, keys)  # b[0], b[1] duplicates; b[2] after a[1]
    pool.release(b)  # b[2] cached-unowned, its parent a[1] still owned
    pool.release(np.array([a[1]], dtype=np.int32))
    pool.release(np.array([a[0]], dtype=np.int32))  # a[1] least recent, then a[0]
    assert pool.num_cached == 3
    spare = pool.num_free - pool.num_cached
    pool.alloc(spare)
    got = pool.alloc(1)  # b[2] was released first: evicted first
    assert got.tolist() == [b[2]] and pool.num_registered == 2
    got = pool.alloc(1)
    assert got.tolist() == [a[1]] and pool.num_registered == 1
    pool.check()


def test_an_evicted_parent_cascades_to_cached_children_onto_the_free_stack():
    prompt, turn = np.arange(8), np.arange(8, 12)
    pool = PagePool(5, 4)
    a, b = pool.alloc(2), pool.alloc(3)
    pool.register(a, pool.page_keys(prompt, None))
    pool.register(b, pool.page_keys(np.concatenate((prompt, turn)), None))
    pool.release(a)  # a's pages: least recently released
    pool.release(b)  # b[2] cached (after a[1]); b[0], b[1] free
    assert pool.num_cached == 3 and pool.num_free == 5
    got = pool.alloc(3)  # b[0], b[1] from the stack, then evicts a[1]: b[2] freed
    assert got.tolist()[2] == a[1]
    assert pool.num_registered == 1 and pool.num_cached == 1 and pool.num_free == 2
    assert b[2] in pool.free_pages().tolist()
    pool.check()


# --- exactness: colliding keys never hand out a page -------------------------------------


def thue_morse(n):
    return np.array([bin(i).count("1") % 2 for i in range(n)], dtype=np.int64)


def test_thue_morse_strings_collide_and_lookup_still_refuses():
    """Polynomial hashes mod 2**64 collide on a Thue-Morse string and its
    complement (2048 tokens, any odd base): the key finds the wrong page,
    verification refuses it."""
    a = thue_morse(2048)
    b = 1 - a
    pool, _ = cached_pool(4, 2048, [a])
    kb = pool.page_keys(b, None)
    assert kb.hashes.tolist() == pool.page_keys(a, None).hashes.tolist()  # a real collision
    assert pool.lookup(kb).size == 0
    other = pool.alloc(1)
    pool.register(other, kb)  # the key is taken: b stays unregistered
    assert pool.num_registered == 1 and pool.lookup(kb).size == 0
    pool.check()


def test_equal_pages_after_different_prefixes_never_match():
    """Two chains whose last pages are equal and whose keys are forced equal
    (a crafted token cancels the difference): the parent link refuses."""
    ps = 4
    pool = PagePool(8, ps)
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    pa = pool.alloc(2)
    pool.register(pa, pool.page_keys(a, None))
    b = a.copy()
    b[2] += 1  # differ by +1 at weight B**1 ...
    b[3] = np.int64(((int(a[3]) - _BASE) + (1 << 63)) % (1 << 64) - (1 << 63))  # ... and cancel
    kb = pool.page_keys(b, None)
    assert kb.hashes.tolist() == pool.page_keys(a, None).hashes.tolist()
    assert (kb.tokens[1] == a[4:]).all()  # page 1 equal; page 0 differs
    assert pool.lookup(kb).size == 0  # page 0's tokens differ: nothing
    # forged keys: page 1's key found, but its parent is not the query's
    pb = pool.alloc(1)
    pool.register(pb, PageKeys(kb.hashes[:1] ^ np.uint64(1), kb.tokens[:1], ""))
    assert pool.lookup(PageKeys(kb.hashes[1:], kb.tokens[1:], ""), parent=int(pb[0])).size == 0
    pool.check()


def test_a_found_page_after_another_parent_ends_the_match():
    """Keys forged so page 1's key finds a page with the right tokens that
    was computed after a different page 0: the parent link stops the match."""
    pool = PagePool(8, 2)
    a, b = pool.alloc(2), pool.alloc(2)
    ka = pool.page_keys([1, 2, 3, 4], None)
    pool.register(a, ka)
    kb = pool.page_keys([9, 9, 3, 4], None)
    pool.register(b, kb)
    forged = PageKeys(np.array([ka.hashes[0], kb.hashes[1]]), ka.tokens, "")
    assert (pool.registry.tokens[b[1]] == forged.tokens[1]).all()  # b[1] holds the asked tokens
    assert pool.lookup(forged).tolist() == [a[0]]
    assert pool.lookup(ka).tolist() == a.tolist() and pool.lookup(kb).tolist() == b.tolist()


def test_forged_keys_and_namespaces_are_verified():
    pool, (pages,) = cached_pool(8, 2, [np.arange(6)], namespace="img:1")
    real = pool.page_keys(np.arange(6), None, "img:1")
    assert pool.lookup(real).tolist() == pages.tolist()
    forged = PageKeys(real.hashes, real.tokens, "img:2")  # same keys, other namespace
    assert pool.lookup(forged).size == 0
    wrong = real.tokens.copy()
    wrong[1, 0] += 1
    assert pool.lookup(PageKeys(real.hashes, wrong, "img:1")).tolist() == pages[:1].tolist()


def test_register_validates_its_arguments():
    pool = PagePool(4, 2)
    pages = pool.alloc(2)
    with pytest.raises(ValueError, match="one key per page"):
        pool.register(pages, pool.page_keys([1, 2], None))
    with pytest.raises(ValueError, match="pages of 2"):
        pool.register(pages[:1], PagePool(4, 3).page_keys([1, 2, 3], None))


def test_check_names_a_broken_rule():
    pool, (pages,) = cached_pool(4, 2, [np.arange(4)])
    pool.num_cached += 1
    with pytest.raises(AssertionError, match="num_free"):
        pool.check()
    pool.num_cached -= 1
    pool.registry.parent[pages[1]] = 3
    with pytest.raises(AssertionError, match="parent"):
        pool.check()


def test_the_key_table_spills_and_still_finds_every_key():
    pool = PagePool(64, 1)
    table = pool.registry.table
    shift = int(table._shift)
    keys = np.array([(5 << shift) | i for i in range(20)], dtype=np.uint64)  # one bucket
    pages = pool.alloc(20)
    pool.register(pages, PageKeys(keys, np.arange(20).reshape(20, 1), ""))
    assert table._nspilled >= 2
    assert pool.registry.table.find(keys).tolist() == pages.tolist()
    assert pool.registry.table.find(keys + np.uint64(1 << 40)).tolist() == [-1] * 20
    pool.release(pages)
    pool.check()
    pool.alloc(64)
    assert pool.num_registered == 0 and (table._pages < 0).all()


def test_a_batch_insert_shares_buckets_and_spills_and_finds_every_key():
    """One insert of keys two to a bucket, one bucket filled past its width and
    one already full: each key gets its own slot and is found."""
    pool = PagePool(64, 1)
    table = pool.registry.table
    shift = int(table._shift)
    old = np.array([(9 << shift) | i for i in range(8)], dtype=np.uint64)  # bucket 9: full
    held = pool.alloc(8)
    pool.register(held, PageKeys(old, np.arange(8).reshape(8, 1), ""))
    buckets = [3, 3, 7, 7] + [5] * 10 + [9] * 4 + [11]
    keys = np.array([(b << shift) | (100 + i) for i, b in enumerate(buckets)], dtype=np.uint64)
    pages = pool.alloc(len(keys))
    table.insert(keys, pages)
    assert table.size == np.count_nonzero(table._pages >= 0) == 8 + len(keys)
    assert table.find(keys).tolist() == pages.tolist()
    assert table.find(old).tolist() == held.tolist()
    assert table._nspilled >= 2  # bucket 5 (ten keys) and bucket 9
    slots = table._slot[pages]
    assert len(set(slots.tolist())) == len(keys) and (table._pages.flat[slots] == pages).all()


def test_register_next_counts_two_children_of_one_parent():
    """Forks' chains: two next pages after one shared page, in one batch."""
    pool = PagePool(8, 2)
    first = pool.alloc(1)
    keys = pool.page_keys([1, 2])
    pool.register(first, keys)
    pages = pool.alloc(2)
    tokens = np.array([[3, 4], [5, 6]])
    parent_keys = np.repeat(keys.hashes, 2)
    pool.register_next(pages, tokens, parent_keys, np.repeat(first, 2))
    assert pool.registry._children[first].tolist() == [2]
    pool.check()
    pool.release(np.concatenate((first, pages)))
    pool.alloc(8)  # evicts all three: the parent's count must reach zero, not below
    assert pool.num_registered == 0
    pool.check()


def test_an_unregistered_anchor_takes_its_tails_along():
    pool = PagePool(4, 2)
    anchor, tail, other = pool.alloc(3)
    pool.register(np.array([anchor], np.int32), pool.page_keys([1, 2]))
    pool.cache_tail(int(tail), int(anchor), np.array([3]))
    pool.cache_tail(int(other), "", np.array([5]))  # a tail under the namespace root
    pool.release(np.array([anchor], np.int32))  # the anchor first: evicted first
    pool.release(np.array([tail, other], np.int32))
    assert (pool.num_free, pool.num_cached, pool.tails.size) == (4, 3, 2)
    pool.check()
    pool.alloc(2)  # the free page, then the anchor: its tail goes to the free stack
    assert (pool.num_free, pool.num_cached, pool.tails.size) == (2, 1, 1)
    assert pool.tails.under("")[0][0] == other and not pool.tails.under(int(anchor))
    pool.check()


def test_tails_under_one_anchor_are_capped_oldest_first():
    pool = PagePool(PER_ANCHOR + 1, 4)
    pages = pool.alloc(PER_ANCHOR + 1)
    for token, page in enumerate(pages.tolist()):
        pool.cache_tail(page, "", np.array([token]))  # none begins another
        pool.release(pages[token : token + 1])
    assert pool.tails.size == PER_ANCHOR and pool.num_cached == PER_ANCHOR
    assert [int(t[0]) for _, _, t in pool.tails.entries()] == list(range(1, PER_ANCHOR + 1))
    assert pool.free_pages()[:1].tolist() == [pages[0]]  # the oldest, on the free stack
    pool.check()
