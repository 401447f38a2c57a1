"""The fused step's parts against their references: the rotary tables
(``mstar.models.llama.rotary``) against HF's, and the layer ops' SiLU and
attention (``mstar.cpu.layer_ops``) against torch and paged attention."""

from __future__ import annotations

import pytest
import torch
from oracles import Streams
from test_fused import SIZES

transformers = pytest.importorskip("transformers")

from mstar.cpu.layer_ops import layer_ops_or_why  # noqa: E402
from mstar.engine.resources.kv.cache import KVCache  # noqa: E402


def test_step_rotary_tables_are_hf_s_bit_for_bit():
    """``StepRotary``'s tables are HF's ``cos`` and ``sin`` with the first
    half of ``sin`` negated, bit for bit; the ``signs`` passed back in serve
    the next step, and ones of another width or dtype are made anew."""
    from mstar.models.llama.rotary import StepRotary

    config = transformers.LlamaConfig(**SIZES)
    rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 4095, 123456])
    cos, sin = rotary_emb(torch.empty(0), positions[None])
    half = cos.shape[-1] // 2
    expected = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
    first = StepRotary(rotary_emb, positions, torch.float32)
    assert torch.equal(first.cos_rows.view(torch.int32), cos[0].view(torch.int32))
    assert torch.equal(first.sin_rows.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(first.sin[:, 0], first.sin_rows) and first.cos.shape == (5, 1, 2 * half)
    again = StepRotary(rotary_emb, positions[:2], torch.float32, first.signs)
    assert again.signs is first.signs
    assert torch.equal(again.sin_rows.view(torch.int32), expected[:2].view(torch.int32))
    for signs in (first.signs[:-2], first.signs.double()):
        assert torch.equal(
            StepRotary(rotary_emb, positions, torch.float32, signs).signs, first.signs
        )


def test_rotary_table_rows_are_the_module_s_bit_for_bit():
    """``RotaryTable``'s gathered rows are ``StepRotary``'s at the same
    positions bit for bit (default and llama3 rope), grown past the largest
    position asked, made anew when ``inv_freq`` changes in place, None past
    ``TABLE_BYTES``; dynamic rope types are not served."""
    from mstar.models.llama import rotary as rotary_module
    from mstar.models.llama.rotary import RotaryTable, StepRotary

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}  # fmt: skip
    for scaling in (None, llama3):
        config = transformers.LlamaConfig(**SIZES, rope_scaling=scaling)
        rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        assert RotaryTable.serves(rotary_emb)
        table = RotaryTable(rotary_emb, n=8)
        for positions in ([0], [5, 6, 7], [3, 900, 4095, 7]):
            got = table(torch.tensor(positions))
            want = StepRotary(rotary_emb, torch.tensor(positions), torch.float32)
            assert torch.equal(got.cos_rows.view(torch.int32), want.cos_rows.view(torch.int32))
            assert torch.equal(got.sin_rows.view(torch.int32), want.sin_rows.view(torch.int32))
        assert len(table.cos) == 2 * 4095 + 2
    rotary_emb.inv_freq.mul_(0.5)  # in place: the tables follow
    got, want = table(torch.tensor([77])), StepRotary(rotary_emb, torch.tensor([77]), torch.float32)
    assert torch.equal(got.sin_rows, want.sin_rows)
    most = rotary_module.TABLE_BYTES // (8 * table.cos.shape[-1])
    assert table(torch.tensor([most])) is None and table(torch.tensor([most - 1])) is not None
    dynamic = transformers.LlamaConfig(
        **SIZES, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    )
    emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(dynamic)
    assert not RotaryTable.serves(emb)


def test_layer_ops_silu_mul_matches_torch_over_the_float_range():
    """silu(g) * u with the vectorized exponential: within a few float32 ulps of
    float64 over [-100, 100] (every lane position and the scalar tail: 1539
    columns), a NaN staying NaN."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    g = torch.cat([torch.linspace(-100, 100, 1539), torch.randn(1539) * 4]).view(2, 1539)
    u = torch.randn(2, 1539)
    got = torch.ops.mstar_layer.silu_mul(torch.cat([g, u], dim=1))
    want = torch.nn.functional.silu(g.double()) * u.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-30)
    g[1, 5] = float("nan")
    assert torch.ops.mstar_layer.silu_mul(torch.cat([g, u], dim=1))[1, 5].isnan()


@pytest.mark.parametrize(
    "rows, heads, kv_heads, dim, atol",
    [
        (((7, 1), (3, 1)), 4, 2, 8, 1e-6),  # decode: one query a row
        (((5, 1), (9, 1), (2, 1)), 2, 1, 12, 1e-6),  # a head width of no whole 8 floats
        # 2^17+ multiply-adds in all: the rows spread over threads (``threaded``);
        # hundreds of keys summed in another order
        ((*((n, 1) for n in (300, 1, 257, 64, 190, 299, 128)), (5, 1)), 8, 2, 64, 1e-5),
        (((1500, 1), (1201, 1)), 8, 2, 64, 1e-5),  # fewer rows than threads: KV heads apart
        (((100, 1),), 9, 3, 64, 1e-5),  # one decode row, SmolLM2's heads
        (((700, 1),), 9, 3, 64, 1e-5),  # ... its keys in parts over the threads, merged
        (((900, 3),), 8, 2, 64, 1e-5),  # a chunk's three queries, each its own keys in parts
        (((9, 1),), 64, 8, 128, 1e-5),  # too few pages to part; eight heads a KV head
        (((30, 1), (0, 3)), 10, 2, 16, 1e-5),  # five heads a KV head, 16 floats each
        # a KV head each; four rows, the next row's pages asked for during each
        (((200, 1), (37, 1), (3, 1), (150, 1)), 4, 4, 64, 1e-5),
        # prefill: fresh prompts and chunks after a history, each query causal in its row,
        # beside decode rows; a row of one query among them
        (((0, 5), (7, 1), (0, 1), (13, 9), (4, 64)), 4, 2, 8, 1e-6),
        (((0, 37), (40, 21), (300, 3), (0, 64), (2, 1)), 9, 3, 64, 1e-5),
        # heads of whole 16 floats past 64 (AVX-512: a 64-float block, then 16 at a time)
        (((6, 1), (0, 7), (3, 2)), 4, 2, 80, 1e-5),
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_attention_matches_paged_attention(rows, heads, kv_heads, dim, atol, kv_dtype):
    """The layer ops' attention, from the q/k/v GEMM's output: rotary
    applied, keys and values written where ``KVCache.write`` puts them,
    each row's queries causal over its pages as ``paged_attention``'s; over
    a bfloat16 cache too (the new keys and values rounded into it alike,
    every key read back as float32)."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    from mstar.models.llama.attention import StepAttention
    from mstar.models.llama.rotary import StepRotary

    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        hidden_size=heads * dim, num_attention_heads=heads, head_dim=dim
    )
    width = (heads + 2 * kv_heads) * dim
    tokens = sum(new for _, new in rows)
    positions = torch.cat([torch.arange(old, old + new) for old, new in rows])
    rotary = StepRotary(
        transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config),
        positions,
        torch.float32,
    )
    pages = sum(-(-(old + new) // 4) for old, new in rows) + 4
    streams = Streams(pages, 4, seed=5)
    caches = [KVCache(num_layers=1, num_pages=pages, page_size=4, num_kv_heads=kv_heads,
                      head_dim=dim, dtype=kv_dtype) for _ in range(2)]  # fmt: skip
    names = [f"r{i}" for i in range(len(rows))]
    history = [(name, old) for name, (old, _) in zip(names, rows) if old]
    plan = streams.plan(history)
    written = sum(old for _, old in history)
    k, v = torch.randn(written, kv_heads, dim), torch.randn(written, kv_heads, dim)
    for cache in caches:
        cache.write(0, plan, k, v)
    if all(new == 1 for _, new in rows):
        plan = streams.decode_plan(names)
    else:
        plan = streams.plan([(name, new) for name, (_, new) in zip(names, rows)])
    qkv = torch.randn(tokens, width)
    fast = StepAttention(plan, caches[0], 0.3, torch.device("cpu"), kernels=True)
    slow = StepAttention(plan, caches[1], 0.3, torch.device("cpu"), kernels=False)
    assert fast.rows is not None and slow.rows is None
    got = fast.fused(0, qkv, rotary, heads=heads)
    q_and_k = heads + kv_heads
    qk = rotary(qkv[:, : q_and_k * dim].view(tokens, q_and_k, dim))
    want = slow(
        0, qk[:, :heads], qk[:, heads:], qkv[:, q_and_k * dim :].view(tokens, kv_heads, dim)
    )
    written = caches[0].layer(0), caches[1].layer(0)
    if kv_dtype == torch.bfloat16:  # the same rounding (to nearest even) of the same keys
        rotated_apart = (written[0].float() - written[1].float()).abs().max()
        assert rotated_apart <= 2**-7 * written[1].float().abs().max()
    else:
        assert torch.allclose(*written, atol=1e-6)
    assert torch.allclose(got, want.reshape(tokens, -1), atol=atol)


def test_long_prefill_rows_attend_through_sdpa():
    """A row of more than ``KERNEL_PAIRS`` causal (query, key) pairs (a
    fresh prompt of 512 tokens) sends the step to SDPA over gathered pages,
    the op's rows unset; 511 tokens, or one query over more keys, do not."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    from mstar.models.llama.attention import StepAttention

    streams = Streams(64 + 2, 16, seed=1)
    cache = KVCache(num_layers=1, num_pages=66, page_size=16, num_kv_heads=1, head_dim=8)
    for spans, served in (([("a", 511)], True), ([("b", 512)], False), ([("a", 1)], True)):
        step = StepAttention(streams.plan(spans), cache, 1.0, torch.device("cpu"), kernels=True)
        assert (step.rows is not None) == served and (step.schedule is None) == served
