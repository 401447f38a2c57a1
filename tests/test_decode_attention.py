"""The decode fast path (DecodeSchedule) against the dense oracle and the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import Scenario, dense_attention

from mstar.engine.resources.attn.decode import decode_schedule
from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import paged_attention

TOL = 1e-5


@settings(max_examples=30, deadline=None)
@given(
    history=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 3, 16]),
    heads=st.sampled_from([(4, 2), (4, 1), (6, 3)]),
    window_left=st.sampled_from([-1, 0, 2, 7]),
    chunk_size=st.sampled_from([None, 4]),
    sm_scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_decode_step_matches_dense(
    history, page_size, heads, window_left, chunk_size, sm_scale, seed
):
    num_qo_heads, num_kv_heads = heads
    case = Scenario([(h, 1) for h in history], page_size, num_kv_heads, seed)
    plan = case.step(decode=True)
    q = torch.cat(case.queries([1] * len(history), num_qo_heads))
    opts = {"sm_scale": sm_scale, "window_left": window_left, "chunk_size": chunk_size}
    schedule = decode_schedule(plan.cpu_indptrs, page_size)
    layer = case.cache.layer(0)
    assert schedule is not None and schedule.serves(layer, AttentionOptions(**opts))
    out = schedule.attend(q, layer, AttentionOptions(**opts))
    expected = torch.cat(
        [dense_attention(q[i : i + 1], *case.kv[n], **opts) for i, n in enumerate(case.names)]
    )
    assert (out - expected).abs().max().item() <= TOL
    reference = paged_attention(q, layer, plan.cpu_indptrs, AttentionOptions(**opts))
    assert (out - reference).abs().max().item() <= TOL


def test_one_schedule_serves_every_layer_and_reads_each_layers_pages():
    case = Scenario([(5, 1), (20, 1)], 4, 2, 0)
    plan = case.step(decode=True)
    schedule = decode_schedule(plan.cpu_indptrs, 4)
    q = torch.cat(case.queries([1, 1], 4))
    layer = case.cache.layer(0)
    first = schedule.attend(q, layer, AttentionOptions())
    doubled = schedule.attend(q, layer * 2, AttentionOptions())  # another layer's pages
    assert not torch.allclose(first, doubled)
    expected = paged_attention(q, layer * 2, plan.cpu_indptrs)
    assert (doubled - expected).abs().max().item() <= TOL


def test_low_precision_returns_q_dtype_and_agrees():
    case = Scenario([(9, 1), (3, 1)], 4, 2, 1, dtype=torch.bfloat16)
    plan = case.step(decode=True)
    q = torch.cat(case.queries([1, 1], 4)).bfloat16()
    layer = case.cache.layer(0)
    out = decode_schedule(plan.cpu_indptrs, 4).attend(q, layer, AttentionOptions())
    assert out.dtype == torch.bfloat16
    expected = paged_attention(q, layer, plan.cpu_indptrs)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [[(5, 2), (3, 1)], [(0, 1), (3, 1)], [(4, 0), (3, 1)]])
def test_other_steps_go_to_the_reference(rows):
    """A prefill chunk, a row without keys before the step... none is a decode step."""
    case = Scenario(rows, 4, 2, 0)
    plan = case.step()
    has_keys_and_one_query = all(n == 1 for _, n in rows) and all(h + n for h, n in rows)
    assert (decode_schedule(plan.cpu_indptrs, 4) is not None) == has_keys_and_one_query


def test_softcap_sinks_and_pair_layers_are_not_served():
    case = Scenario([(5, 1)], 4, 2, 0)
    plan = case.step(decode=True)
    schedule = decode_schedule(plan.cpu_indptrs, 4)
    layer = case.cache.layer(0)
    assert schedule.serves(layer, AttentionOptions())
    assert not schedule.serves(layer, AttentionOptions(softcap=5.0))
    assert not schedule.serves(layer, AttentionOptions(sinks=torch.zeros(4)))
    assert not schedule.serves((layer[:, 0], layer[:, 1]), AttentionOptions())
    assert not schedule.serves(layer.transpose(3, 4), AttentionOptions())
