"""paged_attention against a dense per-row oracle over the full K/V history."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from oracles import Scenario, dense_attention

from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import AttentionSchedule, paged_attention
from mstar.engine.resources.kv.plan import PagedIndptrs, build_paged_indptrs, context_only_views

HEAD_DIM = 8
TOL = 1e-5


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= TOL, f"max abs error {err}"


heads = st.sampled_from([(4, 2), (4, 1)])
page_sizes = st.sampled_from([1, 3, 16])


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=4),
    page_size=page_sizes,
    heads=heads,
    causal=st.booleans(),
    window_left=st.sampled_from([-1, 0, 2, 7]),
    sm_scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
@example(  # always: a chunk, a decode row, a fresh prompt and a row with no queries
    rows=[(7, 5), (10, 1), (0, 3), (4, 0)],
    page_size=3,
    heads=(4, 2),
    causal=True,
    window_left=-1,
    sm_scale=None,
    seed=0,
)
def test_mixed_step_matches_dense(rows, page_size, heads, causal, window_left, sm_scale, seed):
    """Prefill chunks, decode rows and rows with no queries in one plan."""
    num_qo_heads, num_kv_heads = heads
    case = Scenario(rows, page_size, num_kv_heads, seed)
    plan = case.step()
    qs = case.queries([n for _, n in rows], num_qo_heads)
    opts = {"causal": causal, "sm_scale": sm_scale, "window_left": window_left}
    out = paged_attention(
        torch.cat(qs), case.cache.layer(0), plan.cpu_indptrs, AttentionOptions(**opts)
    )
    expected = [dense_attention(q, *case.kv[name], **opts) for q, name in zip(qs, case.names)]
    _assert_close(out, torch.cat(expected))


@settings(max_examples=20, deadline=None)
@given(
    history=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    page_size=page_sizes,
    heads=heads,
    seed=st.integers(0, 2**16),
)
def test_decode_plan_matches_dense(history, page_size, heads, seed):
    """A decode-only plan, written through decode_pages (its views raise)."""
    num_qo_heads, num_kv_heads = heads
    case = Scenario([(h, 1) for h in history], page_size, num_kv_heads, seed)
    plan = case.step(decode=True)
    qs = case.queries([1] * len(history), num_qo_heads)
    out = paged_attention(torch.cat(qs), case.cache.layer(0), plan.cpu_indptrs)
    expected = [dense_attention(q, *case.kv[name]) for q, name in zip(qs, case.names)]
    _assert_close(out, torch.cat(expected))


@settings(max_examples=20, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), min_size=1, max_size=4),
    page_size=page_sizes,
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_context_only_sees_exactly_the_stored_tokens(rows, page_size, data, seed):
    """The step's own tokens are in the cache, yet context-only queries see
    only what was stored before it."""
    case = Scenario(rows, page_size, 2, seed)
    views = case.step().views
    spans = [data.draw(st.integers(0, h)) for h, _ in rows]
    indptrs = build_paged_indptrs(context_only_views(views, spans, page_size), page_size)
    qs = case.queries(spans, 4)
    out = paged_attention(
        torch.cat(qs), case.cache.layer(0), indptrs, AttentionOptions(causal=False)
    )
    expected = [
        dense_attention(q, *case.kv[name][:, :h], causal=False)
        for q, name, (h, _) in zip(qs, case.names, rows)
    ]
    _assert_close(out, torch.cat(expected))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), min_size=1, max_size=6),
    page_size=page_sizes,
    heads=heads,
    window_left=st.sampled_from([-1, 3]),
    softcap=st.sampled_from([None, 0.5, 5.0]),
    sinks=st.booleans(),
    chunk_size=st.sampled_from([None, 1, 4, 7]),
    seed=st.integers(0, 2**16),
)
@example(  # always all three at once, on chunks that cross a chunk boundary
    rows=[(5, 6), (9, 1), (0, 9), (3, 0)],
    page_size=3,
    heads=(4, 2),
    window_left=-1,
    softcap=0.5,
    sinks=True,
    chunk_size=4,
    seed=1,
)
def test_softcap_sinks_and_chunks_match_dense(
    rows, page_size, heads, window_left, softcap, sinks, chunk_size, seed
):
    """Logit soft-capping (Gemma 2), attention sinks (GPT-OSS's s_aux) and
    chunked attention (Llama 4), alone and together, with a window."""
    num_qo_heads, num_kv_heads = heads
    case = Scenario(rows, page_size, num_kv_heads, seed)
    plan = case.step()
    qs = case.queries([n for _, n in rows], num_qo_heads)
    # Large scores, so the cap and the sinks change the result.
    qs = [3 * q for q in qs]
    sink = torch.randn(num_qo_heads, generator=case.gen) * 2 if sinks else None
    opts = {"window_left": window_left, "softcap": softcap, "sinks": sink, "chunk_size": chunk_size}
    out = paged_attention(
        torch.cat(qs), case.cache.layer(0), plan.cpu_indptrs, AttentionOptions(**opts)
    )
    expected = [dense_attention(q, *case.kv[name], **opts) for q, name in zip(qs, case.names)]
    _assert_close(out, torch.cat(expected))


def test_each_option_changes_the_result():
    """The options are not no-ops on the step the suite checks (so a kernel
    that ignored one could not pass)."""
    case = Scenario([(5, 6), (9, 1), (0, 9)], 3, 2, seed=1)
    plan = case.step()
    q = 3 * torch.cat(case.queries([6, 1, 9], 4))
    plain = paged_attention(q, case.cache.layer(0), plan.cpu_indptrs)
    for opts in ({"softcap": 0.5}, {"sinks": torch.ones(4)}, {"chunk_size": 4}):
        assert not torch.allclose(
            paged_attention(q, case.cache.layer(0), plan.cpu_indptrs, AttentionOptions(**opts)),
            plain,
        ), opts


def test_many_rows_of_mixed_lengths_match_dense():
    """Decode rows beside prefill chunks of very different lengths (so rows
    are batched in several groups), windowed and chunked."""
    rows = [(60, 1), (3, 1), (0, 1), (30, 40), (0, 33), (10, 2), (7, 3), (90, 5), (1, 1)]
    case = Scenario(rows, 4, 2, seed=5)
    plan = case.step()
    qs = case.queries([n for _, n in rows], 6)
    for opts in ({}, {"window_left": 9}, {"chunk_size": 16, "softcap": 2.0}):
        out = paged_attention(
            torch.cat(qs), case.cache.layer(0), plan.cpu_indptrs, AttentionOptions(**opts)
        )
        expected = [dense_attention(q, *case.kv[n], **opts) for q, n in zip(qs, case.names)]
        _assert_close(out, torch.cat(expected))


def test_one_schedule_serves_every_layer_of_a_step():
    """A schedule built once gives what a call without one gives, for
    layers with different options (a window, a chunk) and values."""
    rows = [(20, 1), (3, 1), (10, 6), (0, 4)]
    case = Scenario(rows, 4, 2, seed=6)
    plan = case.step()
    schedule = AttentionSchedule(plan.cpu_indptrs, 4)
    layer = case.cache.layer(0)
    for opts in ({}, {"window_left": 2}, {"chunk_size": 8}, {}):
        q = torch.cat(case.queries([n for _, n in rows], 4))
        got = paged_attention(
            q, layer, plan.cpu_indptrs, AttentionOptions(**opts), schedule=schedule
        )
        assert torch.equal(
            got, paged_attention(q, layer, plan.cpu_indptrs, AttentionOptions(**opts))
        )
    other = case.streams.plan([("r0", 1)])
    with pytest.raises(ValueError, match="expected a schedule built from these indptrs"):
        paged_attention(q[:1], layer, other.cpu_indptrs, schedule=schedule)
    with pytest.raises(ValueError, match="expected a schedule for cpu, got one for meta"):
        schedule = AttentionSchedule(plan.cpu_indptrs, 4, "meta")
        paged_attention(q, layer, plan.cpu_indptrs, schedule=schedule)


def test_every_layer_of_a_step_reads_its_own_pages():
    """Layers sharing a schedule (and its gather buffers) in turn each see
    their own keys: a buffer left from the layer before is never read."""
    rows = [(20, 1), (3, 1), (10, 6), (0, 4)]
    case = Scenario(rows, 4, 2, seed=7)
    plan = case.step()
    schedule = AttentionSchedule(plan.cpu_indptrs, 4)
    layers = [case.cache.layer(0), torch.randn_like(case.cache.layer(0))]
    q = torch.cat(case.queries([n for _, n in rows], 4))
    for layer in [*layers, *layers]:
        got = paged_attention(q, layer, plan.cpu_indptrs, schedule=schedule)
        assert torch.equal(got, paged_attention(q, layer, plan.cpu_indptrs))


def test_strided_layer_and_pair_layout_match_contiguous():
    """The same pages as a contiguous layer, a strided view of a wider one,
    and a (k, v) pair give the same result, with and without the sdpa path."""
    rows = [(9, 1), (2, 1), (0, 5)]
    case = Scenario(rows, 4, 2, seed=8)
    plan = case.step()
    layer = case.cache.layer(0)
    wide = torch.zeros(*layer.shape[:-1], 2 * HEAD_DIM)
    wide[..., :HEAD_DIM] = layer
    strided = wide[..., :HEAD_DIM]
    assert not strided.is_contiguous()
    pair = (layer[:, 0].clone(), layer[:, 1].clone())
    q = torch.cat(case.queries([n for _, n in rows], 4))
    for opts in ({}, {"softcap": 2.0}):
        want = paged_attention(q, layer, plan.cpu_indptrs, AttentionOptions(**opts))
        for other in (strided, pair):
            assert torch.equal(
                paged_attention(q, other, plan.cpu_indptrs, AttentionOptions(**opts)), want
            )


def test_batch_rows_stay_in_plan_order():
    """Rows batched together keep their plan order, so a batch of rows
    with one query each reads q as one run (no gather, no scatter); padded
    batches do not."""
    rows = [(0, 115), (300, 1), (290, 1), (310, 1)]
    case = Scenario(rows, 16, 1, seed=0)
    schedule = AttentionSchedule(case.step().cpu_indptrs, 16)
    by_shape = {tuple(b.tokens.shape): b for b in schedule.batches}
    assert set(by_shape) == {(3, 1), (1, 115)}
    assert by_shape[3, 1].tokens.flatten().tolist() == [115, 116, 117]
    assert by_shape[3, 1].span == slice(115, 118)
    assert by_shape[1, 115].span == slice(0, 115)
    padded = AttentionSchedule(Scenario([(9, 3), (9, 2)], 4, 1, seed=0).step().cpu_indptrs, 4)
    assert [b.span for b in padded.batches] == [None]


def test_decode_rows_are_not_padded_to_a_chunk():
    """15 decode rows of similar lengths beside a 115-token chunk: two
    batches, the decode rows' one query each; rows without queries or keys
    in none."""
    rows = [(290 + 2 * i, 1) for i in range(15)] + [(0, 115), (40, 0)]
    case = Scenario(rows, 16, 1, seed=0)
    plan = case.step()
    shapes = sorted(tuple(b.tokens.shape) for b in AttentionSchedule(plan.cpu_indptrs, 16).batches)
    assert shapes == [(1, 115), (15, 1)]


def test_decode_rows_of_far_apart_lengths_are_batched_apart():
    """A batch pads its rows to its longest: decode rows of 600 keys are not
    padded to 2000 keys, nor a row of 40 keys to 600; rows of 600 and 602
    keys share a batch."""
    rows = [(600, 1), (40, 1), (602, 1), (2000, 1)]
    schedule = AttentionSchedule(Scenario(rows, 16, 1, seed=0).step().cpu_indptrs, 16)
    batched = sorted(b.tokens.flatten().tolist() for b in schedule.batches)
    assert batched == [[0, 2], [1], [3]]


def test_value_width_may_differ_from_key_width():
    """A (k, v) pair layer with a narrower V (MLA models such as DeepSeek-V3)."""
    gen = torch.Generator().manual_seed(0)
    page_size, num_pages = 4, 5
    k_pages = torch.randn(num_pages, page_size, 2, 12, generator=gen)
    v_pages = torch.randn(num_pages, page_size, 2, 5, generator=gen)
    # Row 0: pages 3, 1 (7 keys), 3 queries; row 1: page 4 (2 keys), 1 query.
    indptrs = _indptrs([0, 3, 4], [0, 2, 3], [3, 1, 4], [3, 2])
    q = torch.randn(4, 4, 12, generator=gen)
    out = paged_attention(q, (k_pages, v_pages), indptrs, AttentionOptions(sinks=torch.zeros(4)))
    assert out.shape == (4, 4, 5)
    rows = [(q[:3], [3, 1], 7), (q[3:], [4], 2)]
    expected = [
        dense_attention(
            rq, k_pages[p].flatten(0, 1)[:n], v_pages[p].flatten(0, 1)[:n], sinks=torch.zeros(4)
        )
        for rq, p, n in rows
    ]
    _assert_close(out, torch.cat(expected))


def _indptrs(qo, kv, indices, last) -> PagedIndptrs:
    return PagedIndptrs(*(torch.tensor(a, dtype=torch.int32) for a in (qo, kv, indices, last)))


@pytest.mark.parametrize("causal", [True, False])
def test_rows_without_keys_give_zeros(causal):
    """A 0-page row's queries, and causal queries before the row's first key,
    give zeros; the other rows are unaffected."""
    page_size = 4
    layer = torch.randn(3, 2, page_size, 1, HEAD_DIM)
    # Row 0: no pages, 2 queries. Row 1: 3 keys on page 2, 5 queries.
    indptrs = _indptrs([0, 2, 7], [0, 0, 1], [2], [page_size, 3])
    q = torch.randn(7, 2, HEAD_DIM)
    out = paged_attention(q, layer, indptrs, AttentionOptions(causal=causal))
    assert torch.equal(out[:2], torch.zeros(2, 2, HEAD_DIM))
    k, v = layer[2, 0, :3], layer[2, 1, :3]
    _assert_close(out[2:], dense_attention(q[2:], k, v, causal=causal))
    if causal:  # positions -2 and -1 precede every key
        assert torch.equal(out[2:4], torch.zeros(2, 2, HEAD_DIM))


def test_blind_queries_give_zeros_whatever_the_backend(monkeypatch):
    """Queries that see no key are zeroed by paged_attention itself, not
    left to the sdpa backend (CUDA's may give NaN there): the schedule names
    them, and a backend writing NaN for them changes nothing."""
    import torch.nn.functional as F

    from mstar.engine.resources.attn import paged

    real = F.scaled_dot_product_attention

    def nan_when_blind(q, k, v, attn_mask=None, **kwargs):
        out = real(q, k, v, attn_mask=attn_mask, **kwargs)
        if attn_mask is None:
            return out
        return out.masked_fill(~attn_mask.any(dim=-1, keepdim=True), float("nan"))

    layer = torch.randn(3, 2, 4, 1, HEAD_DIM)
    indptrs = _indptrs([0, 2, 7], [0, 0, 1], [2], [4, 3])  # row 1: 3 keys, 5 queries
    q = torch.randn(7, 2, HEAD_DIM)
    want = paged_attention(q, layer, indptrs)
    schedule = AttentionSchedule(indptrs, 4)
    ((_, blind),) = schedule.masks(True, -1, None)
    assert blind.tolist() == [[True, True, False, False, False]]
    monkeypatch.setattr(paged.F, "scaled_dot_product_attention", nan_when_blind)
    got = paged_attention(q, layer, indptrs, schedule=schedule)
    assert torch.equal(got, want) and torch.equal(got[2:4], torch.zeros(2, 2, HEAD_DIM))


def test_rows_without_queries_are_never_read():
    """A row with no queries is skipped whole: even an out-of-range page of
    its own is not gathered."""
    layer = torch.randn(2, 2, 4, 1, HEAD_DIM)
    indptrs = _indptrs([0, 0, 2], [0, 1, 2], [10**6, 1], [4, 4])
    q = torch.randn(2, 2, HEAD_DIM)
    out = paged_attention(q, layer, indptrs)
    _assert_close(out, dense_attention(q, layer[1, 0], layer[1, 1]))


def test_low_precision_returns_q_dtype():
    """bfloat16 in, bfloat16 out, within bfloat16 rounding of the oracle."""
    layer = torch.randn(1, 2, 4, 1, HEAD_DIM).bfloat16()
    q = torch.randn(3, 2, HEAD_DIM).bfloat16()
    out = paged_attention(q, layer, _indptrs([0, 3], [0, 1], [0], [4]))
    assert out.dtype == torch.bfloat16
    expected = dense_attention(q.float(), layer[0, 0].float(), layer[0, 1].float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_paged_attention_reads_a_half_cache_as_float32(half):
    """float32 queries over a half-precision layer: the same output, bit for
    bit, as over that layer made float32 (the upcast is exact)."""
    torch.manual_seed(0)
    layer = torch.randn(3, 2, 4, 2, 8).to(half)
    indptrs = _indptrs([0, 1, 4], [0, 2, 3], [0, 2, 1], [3, 4])
    q = torch.randn(4, 4, 8)
    got = paged_attention(q, layer, indptrs)
    assert got.dtype == torch.float32
    assert torch.equal(got, paged_attention(q, layer.float(), indptrs))
    with pytest.raises(ValueError, match=r"expected q of dtype torch\.float32"):
        paged_attention(q.to(half), layer.float(), indptrs)  # half queries, float32 cache
    with pytest.raises(ValueError, match=re.escape(f"expected q of dtype {half}")):
        paged_attention(q.double(), layer, indptrs)


def _bad(**overrides):
    args = {
        "q": torch.randn(3, 4, HEAD_DIM),
        "kv_layer": torch.randn(2, 2, 4, 2, HEAD_DIM),
        "indptrs": _indptrs([0, 3], [0, 1], [0], [4]),
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_bad(q=torch.randn(3, 4 * HEAD_DIM)), "expected q of shape"),
        (_bad(q=torch.randn(3, 4, HEAD_DIM + 1)), "expected q head_dim 8"),
        (_bad(q=torch.randn(3, 3, HEAD_DIM)), "multiple of num_kv_heads 2, got 3"),
        (_bad(q=torch.randn(3, 4, HEAD_DIM, dtype=torch.float64)), "dtype torch.float32"),
        (_bad(q=torch.randn(3, 4, HEAD_DIM, device="meta")), "on cpu"),
        (_bad(q=torch.randn(2, 4, HEAD_DIM)), "expected 3 query tokens"),
        (_bad(kv_layer=torch.randn(2, 3, 4, 2, HEAD_DIM)), "expected kv_layer of shape"),
        (_bad(kv_layer=torch.randn(2, 4, 2, HEAD_DIM)), "expected kv_layer of shape"),
        (_bad(indptrs=_indptrs([0, 3], [0, 1, 1], [0], [4, 4])), "of equal length"),
        (
            _bad(options=AttentionOptions(sinks=torch.zeros(3))),
            r"expected sinks of shape \(4,\), got \(3,\)",
        ),
        (_bad(options=AttentionOptions(softcap=0.0)), "expected softcap > 0 or None, got 0.0"),
        (_bad(options=AttentionOptions(chunk_size=0)), "expected chunk_size >= 1 or None, got 0"),
        (
            _bad(kv_layer=(torch.randn(2, 4, 2, HEAD_DIM), torch.randn(2, 3, 2, HEAD_DIM))),
            "expected k and v pages alike but for their width",
        ),
    ],
)
def test_bad_input_raises(args, message):
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)
