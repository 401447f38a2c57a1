"""KVCache: plan-addressed writes, page copies, and input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import Streams

from mstar.engine.resources.kv import cache as cache_module
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import (
    KVPlanOutput,
    PagedIndptrs,
    SequenceView,
    build_paged_indptrs,
)

HEADS, DIM = 2, 4


def _plan(views: list[SequenceView], page_size: int) -> KVPlanOutput:
    return KVPlanOutput(build_paged_indptrs(views, page_size), views=views)


@st.composite
def written_views(draw):
    """Views with a page-space offset ``start``, their pages drawn without
    repetition from a pool one page larger than needed (so rows never share a
    page, and one page stays unused)."""
    page_size = draw(st.sampled_from([1, 3, 16]))
    rows = draw(
        st.lists(
            st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20)),
            min_size=1,
            max_size=4,
        )
    )
    need = [-(-(start + stored + new) // page_size) for start, stored, new in rows]
    pool = draw(st.permutations(range(sum(need))))
    views, taken = [], 0
    for i, ((start, stored, new), n) in enumerate(zip(rows, need)):
        pages = list(pool[taken : taken + n])
        taken += n
        views.append(SequenceView(f"r{i}", "text", pages, stored + new, new, start))
    return page_size, sum(need) + 1, views


@settings(max_examples=30, deadline=None)
@given(case=written_views(), seed=st.integers(0, 2**16))
def test_write_lands_where_the_plan_says(case, seed):
    """Token j of a row goes to position start + length - to_compute + j of
    its page space; nothing else in the layer, nor any other layer, changes."""
    page_size, num_pages, views = case
    cache = KVCache(2, num_pages, page_size, HEADS, DIM)
    plan = _plan(views, page_size)
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, plan.get_total_len(), HEADS, DIM, generator=gen)
    cache.write(1, plan, k, v)

    expected = torch.zeros(num_pages, 2, page_size, HEADS, DIM)
    token = 0
    for view in views:
        for j in range(view.to_compute):
            pos = view.start + view.length - view.to_compute + j
            page, offset = view.page_idxs[pos // page_size], pos % page_size
            expected[page, 0, offset], expected[page, 1, offset] = k[token], v[token]
            token += 1
    assert torch.equal(cache.layer(1), expected)
    assert not cache.layer(0).any()


@settings(max_examples=20, deadline=None)
@given(
    history=st.lists(st.integers(0, 30), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 3, 16]),
    seed=st.integers(0, 2**16),
)
def test_decode_write_equals_general_write(history, page_size, seed):
    """The decode path (decode_pages/decode_offsets, views never built)
    stores exactly what the general path stores."""
    names = [f"r{i}" for i in range(len(history))]
    num_pages = sum(h // page_size + 1 for h in history)
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, len(history), HEADS, DIM, generator=gen)
    caches = []
    for decode in (True, False):
        streams = Streams(num_pages, page_size, seed)
        for name, h in zip(names, history):
            streams.view(name, h)
        plan = streams.decode_plan(names) if decode else streams.plan([(n, 1) for n in names])
        cache = KVCache(1, num_pages, page_size, HEADS, DIM)
        cache.write(0, plan, k, v)
        caches.append(cache.layer(0))
    assert caches[0].any()
    assert torch.equal(caches[0], caches[1])


def test_a_narrower_value_width_is_stored_apart():
    """v_head_dim != head_dim: each layer is a (k, v) pair, written and
    copied like the combined layout."""
    cache = KVCache(2, 4, 3, HEADS, DIM, v_head_dim=DIM - 1)
    k_layer, v_layer = cache.layer(1)
    assert k_layer.shape == (4, 3, HEADS, DIM) and v_layer.shape == (4, 3, HEADS, DIM - 1)
    plan = _plan([SequenceView("r", "text", [2, 0], 5, 3)], 3)
    k, v = torch.randn(3, HEADS, DIM), torch.randn(3, HEADS, DIM - 1)
    cache.write(1, plan, k, v)
    # Positions 2, 3, 4: page 2 offset 2, then page 0 offsets 0 and 1.
    assert torch.equal(k_layer[[2, 0, 0], [2, 0, 1]], k)
    assert torch.equal(v_layer[[2, 0, 0], [2, 0, 1]], v)
    assert not cache.layer(0)[0].any() and not cache.layer(0)[1].any()
    cache.copy_pages([2], [3])
    assert torch.equal(k_layer[3], k_layer[2]) and torch.equal(v_layer[3], v_layer[2])
    with pytest.raises(ValueError, match=r"expected v of shape \(3, 2, 3\), got \(3, 2, 4\)"):
        cache.write(0, plan, k, torch.randn(3, HEADS, DIM))


def test_write_slots_are_computed_once_per_plan(monkeypatch):
    """Every layer of a step writes through the same plan: its slots are
    computed on the first write only, and anew for the next plan."""
    calls = []
    slots = cache_module._write_slots
    monkeypatch.setattr(
        cache_module, "_write_slots", lambda plan, size: calls.append(plan) or slots(plan, size)
    )
    streams = Streams(8, 4)
    cache = KVCache(3, 8, 4, HEADS, DIM)
    for plan, tokens in ((streams.plan([("a", 5), ("b", 2)]), 7), (streams.plan([("a", 1)]), 1)):
        for layer in range(3):
            cache.write(
                layer, plan, torch.randn(tokens, HEADS, DIM), torch.randn(tokens, HEADS, DIM)
            )
        assert calls[-1] is plan
    assert len(calls) == 2


def test_write_rejects_a_plan_whose_rows_cannot_hold_their_tokens():
    """Index arrays giving a row fewer keys than it has new tokens."""
    one = torch.tensor
    indptrs = PagedIndptrs(*(one(a, dtype=torch.int32) for a in ([0, 3], [0, 1], [0], [2])))
    plan = KVPlanOutput(indptrs, views=[])
    cache = KVCache(1, 2, 4, HEADS, DIM)
    with pytest.raises(ValueError, match="expected row 0 to hold its 3 new tokens, got kv_len 2"):
        cache.write(0, plan, _kv(), _kv())


def _random_cache() -> KVCache:
    cache = KVCache(2, 5, 3, HEADS, DIM)
    for i in range(cache.num_layers):
        cache.layer(i).copy_(torch.randn_like(cache.layer(i)))
    return cache


@pytest.mark.parametrize(
    ("src", "dst"),
    [([1, 3], [4, 0]), (np.array([0, 1]), np.array([1, 0])), ([], [])],
    ids=["copy", "swap", "empty"],
)
def test_copy_pages_copies_in_every_layer(src, dst):
    """Sources are all read before any destination is written, so a swap swaps."""
    cache = _random_cache()
    before = [cache.layer(i).clone() for i in range(cache.num_layers)]
    cache.copy_pages(src, dst)
    for i, old in enumerate(before):
        expected = old.clone()
        expected[list(dst)] = old[list(src)]
        assert torch.equal(cache.layer(i), expected)


def _step() -> tuple[KVCache, KVPlanOutput]:
    view = SequenceView("r", "text", [0, 1], 5, 3)
    return KVCache(2, 4, 3, HEADS, DIM), _plan([view], 3)


def _kv(tokens: int = 3, **kwargs) -> torch.Tensor:
    return torch.zeros(tokens, HEADS, DIM, **kwargs)


@pytest.mark.parametrize(
    ("layer", "k", "v", "message"),
    [
        (2, _kv(), _kv(), r"expected layer in \[0, 2\), got 2"),
        (-1, _kv(), _kv(), r"expected layer in \[0, 2\), got -1"),
        (0, _kv(4), _kv(4), r"expected k of shape \(3, 2, 4\), got \(4, 2, 4\)"),
        (0, _kv(), _kv(2), r"expected v of shape \(3, 2, 4\), got \(2, 2, 4\)"),
        (0, torch.zeros(3, HEADS, DIM + 1), _kv(), r"expected k of shape"),
        (0, _kv(dtype=torch.float16), _kv(), "expected k of dtype torch.float32"),
        (0, _kv(), _kv(dtype=torch.float64), "expected v of dtype torch.float32"),
        (0, _kv(device="meta"), _kv(), "expected k on cpu, got meta"),
    ],
)
def test_write_rejects_bad_input(layer, k, v, message):
    cache, plan = _step()
    with pytest.raises(ValueError, match=message):
        cache.write(layer, plan, k, v)
    assert not cache.layer(0).any()


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([0, 1], [2], "expected src and dst of equal 1-D length"),
        ([[0]], [[1]], "expected src and dst of equal 1-D length"),
        ([4], [0], r"expected src page ids in \[0, 4\), got 4"),
        ([0], [-1], r"expected dst page ids in \[0, 4\), got -1"),
    ],
)
def test_copy_pages_rejects_bad_input(src, dst, message):
    cache, _ = _step()
    with pytest.raises(ValueError, match=message):
        cache.copy_pages(src, dst)


def test_layer_rejects_out_of_range():
    cache, _ = _step()
    with pytest.raises(ValueError, match=r"expected layer in \[0, 2\), got 5"):
        cache.layer(5)


@pytest.mark.parametrize(
    "name", ["num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim", "v_head_dim"]
)
def test_constructor_rejects_empty_sizes(name):
    sizes = {"num_layers": 1, "num_pages": 1, "page_size": 1, "num_kv_heads": 1, "head_dim": 1}
    sizes[name] = 0
    with pytest.raises(ValueError, match=f"expected {name} >= 1, got 0"):
        KVCache(**sizes)
