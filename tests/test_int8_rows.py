"""Activations rounded to int8 on the lanes (``lanes_i8``, lanes_i8.h): the
products of each layout the kernel takes (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, and
int4 of float32 scales) against the same rounding done here in float64,
close enough to tell int8 from int16 or bfloat16 rounding; and which rows
of which layers take them (``PackedLinear.int8_rows``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf_files import random_blocks

from mstar.cpu.quant.gguf import decode_blocks
from mstar.cpu.quant.kernels import kernel_or_why
from mstar.cpu.quant.linear import AMX_PANEL_ROWS, BF16_ROWS, PackedLinear
from mstar.cpu.quant.packed import Packed, bf16_panels

pytest.importorskip("gguf")

LAYOUTS = ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K float32"]


@pytest.fixture(scope="module", autouse=True)
def _lanes_here():
    if (why := kernel_or_why()) is not None:
        pytest.skip(f"kernels: {why}")
    if not torch.ops.mstar_quant.int8_lane_rows():
        pytest.skip("the kernels' build has no int8 rows (no AVX512-VNNI)")


def _packed(layout: str, rows: int = 64, width: int = 768, seed: int = 0) -> Packed:
    """Weights of ``layout`` from random GGUF blocks (``Q4_K float32``: Q4_K's
    lanes of float32 scales, not of its factors)."""
    type_name = layout.split()[0]
    blocks = random_blocks(type_name, rows, width, np.random.default_rng(seed), std=0.02)
    packed = decode_blocks(type_name, blocks)
    return replace(packed, factors=None) if layout.endswith("float32") else packed


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] rounded to int8 per group of 32 as the kernel rounds it
    (``127 / max |x|`` a division, as the kernel's: torch's ``127.0 / t`` is
    a reciprocal times 127), as the values they stand for, float64."""
    groups = x.view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    live = amax > 1e-30
    inverse = torch.where(live, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(groups * inverse).clamp(-128, 127)  # to nearest, ties to even
    scale = torch.where(live, amax / 127.0, torch.zeros_like(amax))
    return (q.double() * scale.double()).view(x.shape)


def _expected(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """What ``lanes_i8`` computes, in float64: the weights (minimums too)
    times the rounded activations."""
    return _rounded(x) @ packed.dequantize().double().T


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [2, 5, 8, 9, 33])
def test_int8_rows_are_the_weights_times_the_rounded_activations(layout, rows):
    """Each layout's product at 2-33 rows (passes of 8 or 4 and their tails)
    is its weights times the activations rounded to int8 per group of 32,
    up to float32 sums; a group of zeros stays zero, one with an outlier
    rounds its small values to few steps. The bound tells the int8 rounding
    from the int16 lanes' (``lanes_i16``)."""
    packed = _packed(layout)
    lanes = packed.lanes()
    assert torch.ops.mstar_quant.lanes_i8_takes(lanes)
    x = torch.randn(rows, packed.shape[1], generator=torch.Generator().manual_seed(rows))
    x[0, 32:64] = 0
    x[-1, 64:96] /= 50  # small values beside an outlier
    x[-1, 70] = 3.0
    y = torch.ops.mstar_quant.lanes_i8(x, lanes).double()
    expected = _expected(x, packed)
    scale = expected.abs().max()
    assert (y - expected).abs().max() < 2e-6 * scale
    if rows <= torch.ops.mstar_quant.lanes_rows():  # what the int16 rounding would have given
        other = torch.ops.mstar_quant.lanes_i16(x, lanes).double()
        assert (other - expected).abs().max() > 1e-4 * scale


def test_int8_rows_refuse_int8_pairs_and_take_any_leading_shape():
    """Q8_0's lanes (signed pairs) are not taken: a clear error; a 3-d input
    gives a 3-d output of the same rows."""
    q8 = _packed("Q8_0").lanes()
    assert not torch.ops.mstar_quant.lanes_i8_takes(q8)
    with pytest.raises(RuntimeError, match="expected int4 or Q6_K lanes"):
        torch.ops.mstar_quant.lanes_i8(torch.randn(4, 768), q8)
    lanes = _packed("Q4_K").lanes()
    x = torch.randn(2, 3, 768)
    flat = torch.ops.mstar_quant.lanes_i8(x.view(6, 768), lanes)
    assert torch.equal(torch.ops.mstar_quant.lanes_i8(x, lanes), flat.view(2, 3, 64))


def test_layers_on_lanes_alone_take_two_rows_or_more_on_int8():
    """A layer whose lanes take every row count (``lane_panels``: no panels
    held) of a taken layout multiplies 2+ rows on int8 activations, one
    row on int16's (on a CPU with AMX's tiles, ``AMX_PANEL_ROWS`` rows or
    more on bfloat16 panels from the lanes); one holding bfloat16 panels, or
    Q8_0's lanes, keeps int16 up to the lanes' rows and bfloat16 from
    ``BF16_ROWS``."""
    ops = torch.ops.mstar_quant
    packed = _packed("Q4_K")
    lanes = packed.lanes()
    alone = PackedLinear.on_lanes("int4", lanes, lane_panels=True)
    held = PackedLinear(packed, None, bf16_panels(packed), True, lanes)
    amx = AMX_PANEL_ROWS if ops.amx_rows() else 0
    assert (alone.int8_rows, held.int8_rows) == (ops.int8_lane_rows(), 0)
    assert (alone.amx_rows, held.amx_rows) == (amx, 0)
    assert alone.arithmetic == "bfloat16+" * bool(amx) + "int16+int8"
    assert held.arithmetic == "bfloat16+int16"
    g = torch.Generator().manual_seed(1)
    one, four, many, tiles = (
        torch.randn(n, 768, generator=g) for n in (1, 4, BF16_ROWS, AMX_PANEL_ROWS)
    )
    assert torch.equal(alone(one), ops.lanes_i16(one, lanes))
    assert torch.equal(alone(four), ops.lanes_i8(four, lanes))
    assert torch.equal(alone(many), ops.lanes_i8(many, lanes))
    on_tiles = ops.lanes_bf16 if amx else ops.lanes_i8
    assert torch.equal(alone(tiles), on_tiles(tiles, lanes))
    assert torch.equal(held(four), ops.lanes_i16(four, lanes))
    assert torch.equal(held(many), ops.bf16_linear(many, held.panels))
    q8 = _packed("Q8_0")
    pairs = PackedLinear.on_lanes("int8", q8.lanes(), lane_panels=True)
    assert pairs.int8_rows == 0 and pairs.arithmetic == "bfloat16+int16"
    assert torch.equal(pairs(four), ops.lanes_i16(four, pairs.lanes))
    assert torch.equal(pairs(many), ops.lanes_bf16(many, pairs.lanes))


def test_without_int8_rows_refuses_an_under_that_is_not_a_name():
    """``under`` names a submodule: another type is a TypeError before any
    layer drops its rows (a float would otherwise match nothing, silently)."""
    from mstar.cpu.quant import without_int8_rows

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.mstar_quantization = "float32"
    for under in (2.5, ["self_attn"]):
        with pytest.raises(TypeError, match="expected a submodule name or None for under"):
            without_int8_rows(model, under)
    assert model.mstar_quantization == "float32"
    assert not without_int8_rows(model, "self_attn") and not without_int8_rows(model)
