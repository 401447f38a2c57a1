"""FlashInferPagedAttention: its wiring on the CPU through a stand-in module,
and the real kernels against paged_attention where CUDA and flashinfer are."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from oracles import Scenario

from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention
from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import paged_attention
from mstar.engine.resources.kv.plan import KVPlanOutput

SHAPE = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 8}


@pytest.fixture(params=["named", "kwargs", "absent"])
def fake(request, fake_flashinfer) -> tuple[FlashInferPagedAttention, list, bool]:
    """An adapter over each stand-in decode signature, its plan log, and
    whether that decode plan takes ``seq_lens``."""
    adapter, log = fake_flashinfer(request.param)
    return adapter, log, request.param != "absent"


def _plan_and_run(
    adapter: FlashInferPagedAttention,
    case: Scenario,
    plan: KVPlanOutput,
    counts: list[int],
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's output and paged_attention's on the same plan and queries,
    under ``AttentionOptions(**options)``."""
    options = AttentionOptions(**options)
    size, dtype = case.cache.page_size, case.cache.dtype
    adapter.plan(plan, page_size=size, options=options, q_dtype=dtype, **SHAPE)
    q = torch.cat(case.queries(counts, SHAPE["num_qo_heads"])).to(case.cache.device)
    return adapter.run(q, case.cache.layer(0)), paged_attention(
        q, case.cache.layer(0), plan.cpu_indptrs, options
    )


def test_decode_plan_uses_the_decode_wrapper(fake):
    """With the row lengths as seq_lens where the wrapper takes them."""
    adapter, log, takes_seq_lens = fake
    case = Scenario([(5, 1), (17, 1), (0, 1)], 3, SHAPE["num_kv_heads"], seed=0)
    plan = case.step(decode=True)
    got, expected = _plan_and_run(adapter, case, plan, [1, 1, 1], window_left=4)
    assert [kind for kind, _ in log] == ["decode"]
    if takes_seq_lens:
        assert log[0][1] is plan.cpu_indptrs.kv_lens
    else:
        assert log[0][1] is None
    assert torch.equal(got, expected)


@pytest.mark.parametrize("causal", [True, False])
def test_mixed_plan_uses_the_prefill_wrapper(fake, causal):
    adapter, log, _ = fake
    case = Scenario([(5, 3), (17, 1), (0, 4)], 3, SHAPE["num_kv_heads"], seed=1)
    plan = case.step()
    got, expected = _plan_and_run(adapter, case, plan, [3, 1, 4], causal=causal)
    assert log == [("prefill", causal)]
    assert torch.equal(got, expected)


def test_plan_is_skipped_when_nothing_changed(fake):
    """Per-layer callers plan once per step: the same plan and parameters
    again is a no-op; another plan, or other parameters, plans anew."""
    adapter, log, _ = fake
    case = Scenario([(5, 3)], 4, SHAPE["num_kv_heads"], seed=2)
    plan = case.step()
    for _ in range(3):
        adapter.plan(plan, page_size=4, **SHAPE)
    assert len(log) == 1
    adapter.plan(plan, page_size=4, options=AttentionOptions(window_left=2), **SHAPE)
    adapter.plan(
        case.streams.plan([("r0", 1)]),
        page_size=4,
        options=AttentionOptions(window_left=2),
        **SHAPE,
    )
    assert len(log) == 3


def test_run_before_plan_raises(fake):
    adapter, _, _ = fake
    with pytest.raises(RuntimeError, match="before plan"):
        adapter.run(torch.zeros(1, 4, 8), torch.zeros(1, 2, 4, 2, 8))


def test_missing_flashinfer_or_cuda_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(RuntimeError, match="needs the flashinfer package"):
        FlashInferPagedAttention()
    monkeypatch.setitem(sys.modules, "flashinfer", SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        FlashInferPagedAttention()


@pytest.fixture
def gpu_adapter() -> FlashInferPagedAttention:
    pytest.importorskip("flashinfer")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return FlashInferPagedAttention()


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_flashinfer_matches_paged_attention(gpu_adapter, page_size, decode, softcap):
    rows = [(40, 1), (3, 1), (17, 1)] if decode else [(0, 9), (40, 1), (17, 0), (33, 5)]
    case = Scenario(
        rows, page_size, SHAPE["num_kv_heads"], seed=3, dtype=torch.bfloat16, device="cuda"
    )
    plan = case.step(decode=decode)
    counts = [n for _, n in rows]
    got, expected = _plan_and_run(gpu_adapter, case, plan, counts, softcap=softcap)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_softcap_is_flashinfers_logits_soft_cap(fake_flashinfer, monkeypatch):
    """Passed to the wrapper's plan only when set (older stand-ins lack it)."""
    adapter, _ = fake_flashinfer()
    wrapper = sys.modules["flashinfer"].BatchPrefillWithPagedKVCacheWrapper
    seen = []
    plan_fn = wrapper.plan
    monkeypatch.setattr(
        wrapper, "plan", lambda self, *a, **kw: seen.append(kw) or plan_fn(self, *a, **kw)
    )
    case = Scenario([(5, 3)], 4, SHAPE["num_kv_heads"], seed=2)
    plan = case.step()
    adapter.plan(plan, page_size=4, **SHAPE)
    adapter.plan(plan, page_size=4, options=AttentionOptions(softcap=30.0), **SHAPE)
    assert "logits_soft_cap" not in seen[0] and seen[1]["logits_soft_cap"] == 30.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sinks": torch.zeros(4)}, "got attention sinks"),
        ({"chunk_size": 8}, "got chunked attention"),
    ],
)
def test_what_flashinfer_lacks_is_refused(fake_flashinfer, options, message):
    adapter, log = fake_flashinfer()
    case = Scenario([(5, 3)], 4, SHAPE["num_kv_heads"], seed=2)
    with pytest.raises(ValueError, match=f"expected an attention FlashInfer serves, {message}"):
        adapter.plan(case.step(), page_size=4, options=AttentionOptions(**options), **SHAPE)
    assert log == []


def test_value_width_other_than_key_width_is_refused(fake_flashinfer):
    adapter, _ = fake_flashinfer()
    case = Scenario([(5, 3)], 4, SHAPE["num_kv_heads"], seed=2)
    adapter.plan(case.step(), page_size=4, **SHAPE)
    pair = (torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 6))
    with pytest.raises(ValueError, match=r"got a value width \(6\) other than the key width \(8\)"):
        adapter.run(torch.zeros(3, 4, 8), pair)
