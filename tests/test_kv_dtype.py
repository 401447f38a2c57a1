"""A half-precision KV cache under float32 activations (``kv_cache_dtype``):
keys and values rounded into it (to nearest even), read back as float32 by
every attention path; refused where it is not served."""

from __future__ import annotations

import copy

import pytest
import torch
from oracles import Streams

from mstar.engine import Engine, SamplingParams
from mstar.engine.resources.kv.cache import KVCache
from mstar.models.seeded import build_model

OPTIONS = {"num_pages": 48, "page_size": 8, "token_budget": 32}


@pytest.fixture(scope="module")
def models():
    return build_model(seed=3)


def test_write_rounds_float32_into_a_half_cache():
    """``KVCache.write`` stores float32 keys and values in a bfloat16 cache
    as ``.to(bfloat16)`` rounds them; other dtypes are still refused."""
    streams = Streams(8, 4, seed=0)
    plan = streams.plan([("a", 5)])
    cache = KVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8,
                    dtype=torch.bfloat16)  # fmt: skip
    reference = KVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cache.write(0, plan, k, v)
    reference.write(0, plan, k.bfloat16().float(), v.bfloat16().float())
    assert cache.layer(0).dtype == torch.bfloat16
    assert torch.equal(cache.layer(0).float(), reference.layer(0))
    with pytest.raises(
        ValueError, match=r"expected k of dtype torch\.bfloat16, got torch\.float16"
    ):
        cache.write(0, plan, k.half(), v)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (3, TypeError, "expected kv_cache_dtype 'auto' or a dtype, got 3"),
        ("fp7", ValueError, "a dtype's name, got 'fp7'"),
        ("float64", ValueError, "under float32, bfloat16 or float16, got float64"),
        (torch.int8, ValueError, "got int8"),
    ],
)
def test_a_bad_kv_cache_dtype_is_refused_naming_it(models, value, error, message):
    with pytest.raises(error, match=message):
        Engine(copy.deepcopy(models[1]), kv_cache_dtype=value, **OPTIONS)


def test_a_half_cache_needs_float32_activations(models):
    half = copy.deepcopy(models[1]).bfloat16()
    with pytest.raises(ValueError, match=r"the model's torch\.bfloat16 or, under float32"):
        Engine(half, kv_cache_dtype="float16", **OPTIONS)
    assert Engine(half, kv_cache_dtype=torch.bfloat16, **OPTIONS).cache.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("fused", "half_dtype"),
    [(True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float16)],
    ids=["fused layers", "HF forward", "float16 (paged_attention under fused layers)"],
)
def test_a_half_cache_stays_close_to_float32(models, fused, half_dtype):
    """The same prompts (one sharing another's prefix: the prefix cache copies
    its partial page in half precision) through a float32 and a half cache:
    the pool holds twice the pages in the same memory, the mode is checked
    against eager float32 at start-up, and every step's logits stay within
    the rounding of the keys and values."""
    engines = {
        dtype: Engine(copy.deepcopy(models[1]), kv_cache_dtype=dtype, fused=fused, page_size=8)
        for dtype in ("auto", half_dtype)
    }
    exact, half = engines["auto"], engines[half_dtype]
    assert exact.cache.dtype == torch.float32 and exact.mode_check is None
    assert half.cache.dtype == half_dtype and half.mgr.num_pages == 2 * exact.mgr.num_pages
    assert half.mode_check is not None and half.mode_check.ok
    base = [(5 * i) % 250 + 1 for i in range(21)]
    prompts = [base, [*base, 7, 9, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
    runs = {d: e.generate(prompts[:1], params) + e.generate(prompts[1:], params)
            for d, e in engines.items()}  # fmt: skip
    assert half.stats.prefill_tokens < sum(map(len, prompts))  # the second took the first's
    worst = 0.0
    for a, b in zip(runs["auto"], runs[half_dtype]):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for u, w in zip(x.top, y.top):
                if u.token_id == w.token_id:
                    worst = max(worst, abs(u.logprob - w.logprob))
            if x.chosen.token_id != y.chosen.token_id:
                break  # a near tie flipped: the rest follows another token
    assert 0 < worst < 0.01
