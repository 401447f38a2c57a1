"""paged_attention on CUDA against the same call on the CPU (CUDA only; the
GPU check's first stage). Two scenarios with one seed hold the same pages and
K/V, one per device, so the plans are equal and only the device differs."""

from __future__ import annotations

import pytest
import torch
from oracles import Scenario

from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import AttentionSchedule, paged_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
ROWS = {
    "decode": [(40, 1), (3, 1), (17, 1), (0, 1)],
    "prefill": [(0, 9), (0, 33), (0, 1)],
    "mixed": [(40, 1), (17, 0), (33, 5), (0, 12), (8, 1)],
}
OPTIONS = {
    "plain": {},
    "not causal": {"causal": False},
    "window": {"window_left": 6},
    "softcap": {"softcap": 5.0},
    "sinks": {"sinks": torch.linspace(-1.0, 1.0, HEADS)},
    "chunks": {"chunk_size": 8},
    "scale": {"sm_scale": 0.05},
}


def _pair(rows, page_size, dtype):
    """The CPU scenario, the CUDA one, their step plans and the queries."""
    cases = [
        Scenario(rows, page_size, KV_HEADS, seed=11, head_dim=HEAD_DIM, dtype=dtype, device=d)
        for d in ("cpu", "cuda:0")  # an index: KVCache and AttentionSchedule compare devices
    ]
    decode = all(n == 1 for _, n in rows)
    plans = [case.step(decode=decode) for case in cases]
    q = torch.cat(cases[0].queries([n for _, n in rows], HEADS)).to(dtype)
    return cases, plans, q


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", list(ROWS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_equals_cpu_float32(kind, option, page_size):
    if option == "not causal" and kind == "decode":
        pytest.skip("a decode row sees its whole history either way")
    (cpu, cuda), (cpu_plan, cuda_plan), q = _pair(ROWS[kind], page_size, torch.float32)
    opts = {k: v.cuda() if torch.is_tensor(v) else v for k, v in OPTIONS[option].items()}
    got = paged_attention(
        q.cuda(), cuda.cache.layer(0), cuda_plan.cpu_indptrs, AttentionOptions(**opts)
    )
    expected = paged_attention(
        q, cpu.cache.layer(0), cpu_plan.cpu_indptrs, AttentionOptions(**OPTIONS[option])
    )
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(ROWS))
def test_cuda_schedule_serves_every_layer_and_bfloat16(kind):
    """A schedule built on CUDA once (as forward_step does) and bf16 K/V and
    queries give the CPU's float32 result to bf16 precision."""
    (cpu, cuda), (cpu_plan, cuda_plan), q = _pair(ROWS[kind], 16, torch.bfloat16)
    schedule = AttentionSchedule(cuda_plan.cpu_indptrs, 16, "cuda:0")
    expected = paged_attention(
        q.float(), cpu.cache.layer(0).float(), cpu_plan.cpu_indptrs, AttentionOptions(window_left=9)
    )
    for _ in range(2):  # the schedule's masks are reused by the second layer
        got = paged_attention(
            q.cuda(),
            cuda.cache.layer(0),
            cuda_plan.cpu_indptrs,
            AttentionOptions(window_left=9),
            schedule=schedule,
        )
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_cuda_plan_indices_on_the_device_give_the_same_result():
    """Index arrays copied to the GPU (``to_device``) are read as the host ones."""
    (_, cuda), (_, plan), q = _pair(ROWS["mixed"], 16, torch.float32)
    host = paged_attention(q.cuda(), cuda.cache.layer(0), plan.cpu_indptrs)
    device = paged_attention(q.cuda(), cuda.cache.layer(0), plan.cpu_indptrs.to_device("cuda"))
    torch.testing.assert_close(device, host, atol=0, rtol=0)
