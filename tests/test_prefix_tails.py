"""The prefix cache's tails: a prompt's partial last page served from a freed
stream's partial page (or a registered full page), copied, never shared.

Oracles: a token store (``TokenCache``: each slot holds the token written
there) for what a stream reads back and what a cached tail still holds, and
for the KV, a real ``KVCache`` whose entries are a fixed function of (token,
position), so a stream started on the cache must attend exactly as one that
computed its whole prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvsteps import CopyFailed, TokenCache
from oracles import dense_attention
from test_prefix import serve

from mstar.engine.resources.attn.paged import paged_attention
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.manager import InvalidStep, KVManager
from mstar.engine.resources.step import KVStep, Segment

PS = 16
PROMPT = list(range(100, 137))  # 37 tokens: two full pages and 5 on a third


def cached(tokens, num_pages=16, cache=True):
    """A manager (over a ``TokenCache`` unless ``cache`` is False) whose
    stream ``a`` computed ``tokens`` and was freed."""
    store = TokenCache(num_pages, PS)
    mgr = KVManager(num_pages, PS, cache=store if cache else None, prefix_cache=True)
    serve(mgr, store, [("a", "main", tokens)])
    mgr.release("a")
    return mgr, store


def test_a_repeated_prompt_hits_all_but_its_last_token():
    mgr, store = cached(PROMPT)
    assert mgr.prefix_stats()["tails_cached"] == 1
    assert mgr.match_prefix("b", "main", PROMPT) == 36
    view = serve(mgr, store, [("b", "main", PROMPT[36:])])["b", "main"]
    assert store.read(view, 37) == PROMPT
    stats = mgr.prefix_stats()
    assert (stats["tokens_queried"], stats["tokens_hit"]) == (37, 36)
    mgr.check_invariants()


def test_a_prompt_diverging_inside_the_tail_uses_the_common_prefix():
    mgr, store = cached(PROMPT)
    other = [*PROMPT[:34], 7, 8, 9]
    assert mgr.match_prefix("b", "main", other) == 34
    view = serve(mgr, store, [("b", "main", other[34:])])["b", "main"]
    assert store.read(view, 37) == other
    assert mgr.match_prefix("c", "main", [*PROMPT[:32], 7]) == 32  # no common token: no tail
    mgr.check_invariants()


def test_a_prompt_shorter_than_a_page_continues_a_namespaces_tail():
    mgr, store = cached(PROMPT[:5])
    assert mgr.match_prefix("b", "main", PROMPT[:5], namespace="other") == 0
    assert mgr.match_prefix("c", "main", PROMPT[:5]) == 4
    assert store.read(serve(mgr, store, [("c", "main", PROMPT[4:5])])["c", "main"], 5) == PROMPT[:5]


def test_an_exact_multiple_of_the_page_size_hits_all_but_one_token():
    mgr, store = cached(PROMPT[:32])
    assert mgr.prefix_stats()["tails_cached"] == 0  # two full pages, no tail
    assert mgr.match_prefix("b", "main", PROMPT[:32]) == 31  # the second page, copied
    assert mgr.held_pages("b", "main") == 2 and mgr.shared_pages() == 0
    view = serve(mgr, store, [("b", "main", PROMPT[31:32])])["b", "main"]
    assert store.read(view, 32) == PROMPT[:32]
    assert mgr.match_prefix("c", "main", PROMPT[:16]) == 15
    mgr.check_invariants()


def test_a_prompt_ending_inside_a_cached_page_is_served_from_a_copy_of_it():
    longer = [*PROMPT, *range(11)]  # a's third page is full and registered
    store = TokenCache(16, PS)
    mgr = KVManager(16, PS, cache=store, prefix_cache=True)
    serve(mgr, store, [("a", "main", longer)])
    assert mgr.match_prefix("b", "main", PROMPT) == 36  # a holds it: copied, not shared
    serve(mgr, store, [("b", "main", [*PROMPT[36:], 7, 7])])
    assert mgr.match_prefix("c", "main", longer) == 47
    assert store.read(serve(mgr, store, [("c", "main", longer[47:])])["c", "main"], 48) == longer
    mgr.release("b")  # its tail shares 7 tokens with d's prompt, a's third page 5
    other = [*PROMPT, 7, 7, 9]
    assert mgr.match_prefix("d", "main", other) == 39
    assert store.read(serve(mgr, store, [("d", "main", other[39:])])["d", "main"], 40) == other
    mgr.check_invariants()


def test_a_page_registered_after_another_is_forgotten_with_its_content():
    mgr, store = cached([*PROMPT, *range(11)], num_pages=5)  # 3 full pages
    serve(mgr, store, [("z", "main", [99] * 33)])  # evicts a's third, writes one token there
    mgr.release("z")
    assert mgr.match_prefix("b", "main", PROMPT) == 32
    mgr, store = cached(PROMPT[:16], num_pages=1)  # one full page: the namespace's first
    serve(mgr, store, [("z", "main", [99] * 5)])
    mgr.release("z")
    assert mgr.match_prefix("b", "main", PROMPT[:10]) == 0
    mgr.check_invariants()


def test_without_a_free_page_or_a_cache_only_full_pages_are_taken():
    cache = TokenCache(2, PS)
    mgr = KVManager(2, PS, cache=cache, prefix_cache=True)
    serve(mgr, cache, [("a", "main", PROMPT[:32])])  # a holds every page
    assert mgr.match_prefix("b", "main", PROMPT[:32]) == 16  # a's second page: no page to copy to
    mgr.check_invariants()
    mgr, _ = cached(PROMPT, cache=False)
    assert mgr.match_prefix("b", "main", PROMPT) == 32


def test_a_tail_that_is_the_only_free_page_is_taken_over():
    mgr, store = cached(PROMPT, num_pages=8)
    serve(mgr, store, [("filler", "main", [0] * 5 * PS)])  # the 5 uncached pages
    assert mgr.num_free_pages == 3  # two full pages and the tail, all cached
    assert mgr.match_prefix("b", "main", PROMPT) == 36  # evicted for its own copy
    assert mgr.prefix_stats()["tails_cached"] == 0
    assert store.read(serve(mgr, store, [("b", "main", PROMPT[36:])])["b", "main"], 37) == PROMPT
    mgr.check_invariants()


def test_a_tail_is_evicted_when_its_page_is_needed():
    mgr, store = cached(PROMPT, num_pages=8)
    serve(mgr, store, [("filler", "main", [0] * (5 * PS + 1))])  # one page past the free
    stats = mgr.prefix_stats()
    assert (stats["tails_cached"], stats["pages_evicted"]) == (0, 0)  # the tail went first
    assert mgr.match_prefix("b", "main", PROMPT) == 32
    mgr.check_invariants()


def test_a_tail_is_copied_never_shared_nor_changed():
    mgr, store = cached(PROMPT)
    (tail,) = np.flatnonzero(mgr.pool.tails.is_tail)
    before = store.slots[tail].copy()
    assert mgr.match_prefix("b", "main", PROMPT) == 36
    assert tail not in mgr.page_ids("b", "main")
    serve(mgr, store, [("b", "main", [1, 2, 3, 4])])  # writes over its copy's slots 4..7
    assert (store.slots[tail] == before).all() and mgr.pool.refcount[tail] == 0
    assert mgr.match_prefix("c", "main", PROMPT) == 36  # the same tail, unchanged
    assert store.read(serve(mgr, store, [("c", "main", PROMPT[36:])])["c", "main"], 37) == PROMPT
    mgr.check_invariants()


def test_a_copied_tail_records_on_and_its_page_registers_when_full():
    mgr, store = cached(PROMPT)
    serve(mgr, store, [("z", "main", [1])])  # a's slot: b's is a fresh one, nothing recorded
    mgr.match_prefix("b", "main", PROMPT)
    serve(mgr, store, [("b", "main", [*PROMPT[36:], *range(11)])])  # fills the third page
    assert mgr.prefix_stats()["pages_cached"] == 3
    longer = [*PROMPT, *range(11), 5]
    assert mgr.match_prefix("c", "main", longer) == 48
    mgr.check_invariants()


def test_a_longer_tail_covers_a_shorter_one_under_the_same_page():
    mgr, store = cached(PROMPT[:20])
    serve(mgr, store, [("b", "main", PROMPT[:23])])
    mgr.release("b")  # 7 tokens after the same page, beginning with the first's 4
    tails = mgr.pool.tails
    assert [len(tokens) for _, _, tokens in tails.entries()] == [7]
    serve(mgr, store, [("c", "main", PROMPT[:18])])
    mgr.release("c")  # covered: freed at once
    assert tails.size == 1 and mgr.match_prefix("d", "main", PROMPT[:22]) == 21
    mgr.check_invariants()


# --- the KV through the plan ------------------------------------------------------------

HEADS, KV_HEADS, DIM = 4, 2, 8


def write_fresh(mgr, cache, request_id, tokens, table):
    """One step computing ``tokens`` past what the stream holds, their K/V
    ``table[token, position]`` (``[2, V, L, H_kv, D]``); returns its plan."""
    start = mgr.stored_len(request_id, "main") if mgr.labels(request_id) else 0
    new = tokens[start:]
    step = KVStep((Segment(request_id, "main", len(new), new),))
    mgr.admit(step)
    (out,) = mgr.plan(step).values()
    positions = torch.arange(start, len(tokens))
    k, v = table[:, torch.tensor(new), positions]
    cache.write(0, out, k, v)
    mgr.commit(step)
    return out


def test_attention_over_a_copied_tail_equals_a_fresh_computation():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(2, 200, 64, KV_HEADS, DIM, generator=gen)  # K/V by (token, position)
    cache = KVCache(1, 16, PS, KV_HEADS, DIM)
    mgr = KVManager(16, PS, cache=cache, prefix_cache=True)
    write_fresh(mgr, cache, "a", PROMPT, table)
    mgr.release("a")
    assert mgr.match_prefix("b", "main", PROMPT) == 36
    out = write_fresh(mgr, cache, "b", PROMPT, table)
    q = torch.randn(1, HEADS, DIM, generator=gen)
    k, v = table[:, torch.tensor(PROMPT), torch.arange(37)]
    torch.testing.assert_close(
        paged_attention(q, cache.layer(0), out.cpu_indptrs), dense_attention(q, k, v)
    )
    pages = mgr.page_ids("b", "main")
    held = cache.layer(0)[torch.from_numpy(pages).long()]  # [3, 2, PS, H_kv, D]
    held = held.permute(1, 0, 2, 3, 4).reshape(2, 3 * PS, KV_HEADS, DIM)[:, :37]
    assert torch.equal(held, torch.stack([k, v]))


def test_a_stream_on_a_copied_tail_rewinds_into_it_not_behind_its_full_pages():
    mgr, store = cached(PROMPT)
    mgr.match_prefix("b", "main", PROMPT)
    mgr.rewind("b", "main", 3)  # its own page: allowed
    with pytest.raises(InvalidStep, match="registered page"):
        mgr.rewind("b", "main", 2)  # into the second page, cached
    view = serve(mgr, store, [("b", "main", PROMPT[33:])])["b", "main"]
    assert store.read(view, 37) == PROMPT
    mgr.check_invariants()


def test_a_failed_copy_changes_nothing():
    mgr, store = cached(PROMPT)
    free, cached_pages = mgr.num_free_pages, mgr.num_cached_pages
    store.fail = True
    with pytest.raises(CopyFailed):
        mgr.match_prefix("b", "main", PROMPT)
    assert mgr.labels("b") == [] and mgr.shared_pages() == 0
    assert (mgr.num_free_pages, mgr.num_cached_pages) == (free, cached_pages)
    mgr.check_invariants()
    assert mgr.match_prefix("b", "main", PROMPT) == 36
