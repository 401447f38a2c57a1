"""FlashInfer on plans from ``KVManager`` against ``paged_attention`` on the
same CUDA cache (CUDA and flashinfer only; the GPU check's last CUDA stage).

Head width 64 and bf16, as SmolLM2 (FlashInfer's kernels take 64, 128 or
256). The tests run in the order their kernels are JIT-compiled, cheapest
and most used first, so a stage cut at its timeout still says the most:
decode, prefill, mixed, the engine's forward, then the soft-capping and
window variants (each a kernel of its own)."""

from __future__ import annotations

import copy

import pytest
import torch

from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention
from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import paged_attention
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.kv.plan import KVPlanOutput, PinnedIndexRing
from mstar.engine.resources.step import KVStep, Segment

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 8, 2, 64, torch.bfloat16
ROWS = {  # (tokens already stored, tokens this step) per request
    "decode": [(40, 1), (3, 1), (17, 1), (1, 1), (300, 1)],
    "prefill": [(0, 9), (0, 33), (0, 2), (0, 130)],
    "mixed": [(40, 1), (17, 0), (33, 5), (0, 12), (8, 1), (0, 1), (64, 40)],
}


@pytest.fixture(scope="module")
def adapter() -> FlashInferPagedAttention:
    pytest.importorskip("flashinfer")
    return FlashInferPagedAttention()


def _step(rows: list[tuple[int, int]], page_size: int, seed: int):
    """A CUDA cache holding each request's history, and the step's plan
    (the manager's, index arrays from a pinned ring), written; plus queries."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = sum(-(-(h + n) // page_size) for h, n in rows) + 4
    cache = KVCache(1, num_pages, page_size, KV_HEADS, HEAD_DIM, DTYPE, "cuda:0")
    mgr = KVManager(num_pages, page_size, cache=cache, ring=PinnedIndexRing())
    plan = None
    for part in (0, 1):
        step = KVStep(tuple(Segment(f"r{i}", "main", r[part]) for i, r in enumerate(rows)))
        mgr.admit(step)
        plan = mgr.plan(step)["main"]
        total = plan.get_total_len()
        k, v = (
            torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
            for _ in range(2)
        )
        cache.write(0, plan, k, v)
        if part == 0:
            mgr.commit(step)
    q = torch.randn(
        plan.get_total_len(), HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE
    )
    return cache, plan, q


def _compare(adapter, cache: KVCache, plan: KVPlanOutput, q: torch.Tensor, **options) -> None:
    adapter.plan(
        plan,
        num_qo_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        page_size=cache.page_size,
        options=AttentionOptions(**options),
        q_dtype=DTYPE,
    )
    got = adapter.run(q, cache.layer(0))
    expected = paged_attention(q, cache.layer(0), plan.cpu_indptrs, AttentionOptions(**options))
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("kind", list(ROWS))
def test_flashinfer_matches_paged_attention(adapter, kind, page_size):
    cache, plan, q = _step(ROWS[kind], page_size, seed=len(kind) + page_size)
    assert plan.is_decode == (kind == "decode")
    _compare(adapter, cache, plan, q)


def test_flashinfer_prefill_not_causal(adapter):
    cache, plan, q = _step(ROWS["mixed"], 16, seed=5)
    _compare(adapter, cache, plan, q, causal=False)


@torch.no_grad()
def test_engine_forward_through_flashinfer(adapter):
    """The seeded tiny Llama widened to head width 64, in bf16, through
    ``forward_step``: FlashInfer's logits against paged_attention's, step
    after step (decode and mixed)."""
    transformers = pytest.importorskip("transformers")
    from mstar.models.hf import forward_step, kv_spec, register
    from mstar.models.seeded import build_model

    config = copy.deepcopy(build_model(seed=0)[0].config)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", DTYPE)
    spec = kv_spec(model)
    model.set_attn_implementation(register())
    caches = [
        KVCache(num_pages=64, page_size=16, dtype=DTYPE, device="cuda:0", **spec.cache_kwargs())
        for _ in range(2)
    ]
    mgr = KVManager(64, 16, ring=PinnedIndexRing())
    gen = torch.Generator().manual_seed(1)
    spans = [[37, 5, 60], [1, 1, 1], [1, 9, 1], [1, 1, 1]]
    for step_spans in spans:
        step = KVStep(tuple(Segment(f"r{i}", "main", s) for i, s in enumerate(step_spans)))
        mgr.admit(step)
        plan = mgr.plan(step)["main"]
        ids = torch.randint(0, 256, (plan.get_total_len(),), generator=gen).cuda()
        paged = forward_step(model, ids, plan, caches[0])
        flash = forward_step(model, ids, plan, caches[1], flashinfer=adapter)
        error = (flash.float() - paged.float()).abs().max() / paged.float().abs().max()
        assert error < 0.05, f"logits differ by {error:.3f} of their largest"
        mgr.commit(step)


def test_flashinfer_adapter_is_the_engines_default_on_cuda():
    """``flashinfer_or_none("cuda")`` builds the adapter when flashinfer imports."""
    pytest.importorskip("flashinfer")
    from mstar.models.device import flashinfer_or_none

    assert isinstance(flashinfer_or_none("cuda"), FlashInferPagedAttention)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_flashinfer_softcap(adapter, kind):
    cache, plan, q = _step(ROWS[kind], 16, seed=7)
    _compare(adapter, cache, plan, q, softcap=5.0)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_flashinfer_window(adapter, kind):
    cache, plan, q = _step(ROWS[kind], 16, seed=8)
    _compare(adapter, cache, plan, q, window_left=15)
