"""int4 weights on activations rounded to int16 (``int4_linear_i16``,
``PackedLinear(int16_activations=True)``, the bfloat16 arithmetic's few-row
path: AVX512-VNNI's kernel or AVX2's, whichever this CPU builds): the kernel
against a float64 model of its rounding, its distance from float32, where
it applies and how it is named."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks

from mstar.cpu.quant import QuantChoice, quantize_model
from mstar.cpu.quant.at_load import quantize_int4, quantize_int8
from mstar.cpu.quant.gguf import decode_blocks
from mstar.cpu.quant.kernels import bf16_or_why, kernel_or_why
from mstar.cpu.quant.linear import AMX_PANEL_ROWS, BF16_ROWS, PackedLinear
from mstar.cpu.quant.packed import Packed, bf16_panels, lanes_shape, pack_bf16
from mstar.models.seeded import build_model

LIMIT = 32767.0


@pytest.fixture(scope="module")
def rows():
    """How many rows the int4 kernel rounds (8 with AVX512-VNNI, 4 on AVX2)."""
    if (why := kernel_or_why()) is not None:
        pytest.skip(why)
    return torch.ops.mstar_quant.int16_rows(4)


def rounded_reference(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """What ``int4_linear_i16`` / ``int8_linear_i16`` compute, in float64:
    each group of 32 of ``x`` rounded to int16 at scale ``max |x| / 32767``
    (ties to even; a group under 1e-30 left at zero), times the integers
    and scales; plus (int4) the minimums times the groups' float sums."""
    rows, width = x.shape
    groups = x.reshape(rows, width // 32, 32)
    top = groups.abs().amax(-1, keepdim=True)
    kept = top > 1e-30
    inverse = torch.where(kept, LIMIT / top, torch.zeros_like(top))
    scale = torch.where(kept, top / LIMIT, torch.zeros_like(top))
    q = torch.round(groups * inverse).double() * scale.double()
    per = width // packed.scales.shape[1]
    weights = packed.values().double() * packed.scales.double().repeat_interleave(per, dim=1)
    y = q.reshape(rows, width) @ weights.T
    return y if packed.mins is None else y + groups.double().sum(-1) @ packed.mins.double().T


def activations(rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    """``rows`` random activation rows, non-contiguous; one row of 64 or more
    gets a group of zeros and one of denormals."""
    x = torch.randn(rows, 2 * width, generator=g)[:, ::2]
    if rows == 1 and width >= 64:
        x[0, :32] = 0.0
        x[0, 32:64] = 1e-38
    return x


def random_int4(rows: int, width: int, seed: int) -> Packed:
    return quantize_int4(torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("shape", [(52, 576), (36, 1536), (4, 32), (20, 96), (8, 160), (460, 576)])
def test_kernel_is_its_rounding_of_the_activations(rows, shape):
    """Every row count it rounds, every count of groups in a last chunk of 4
    (VNNI's; AVX2's of 2: odd and even) (576: 2, 1536: 0, 32: 1, 96: 3, 160:
    1), enough weights to share among threads (460 x 576), non-contiguous
    activations, a group of zeros and one of denormals."""
    packed = random_int4(*shape, seed=shape[0])
    g = torch.Generator().manual_seed(5)
    for count in range(1, rows + 1):
        x = activations(count, shape[1], g)
        y = torch.ops.mstar_quant.int4_linear_i16(x, packed.qweight, packed.scales, packed.mins)
        expected = rounded_reference(x, packed)
        assert y.shape == (count, shape[0]) and y.dtype == torch.float32
        torch.testing.assert_close(
            y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()),
            msg=lambda text, count=count: f"{count} rows: {text}",
        )  # fmt: skip


def test_kernel_is_within_1e4_of_float32_and_exact_past_its_rows(rows):
    """Against the float32 kernel: within 1e-4 of the largest output (int8
    activations, llama.cpp's, are ~1e-2 off on these), and past the rows it
    rounds (up to the panels' 9) the float32 kernel itself, bit for bit."""
    packed = random_int4(96, 1536, seed=1)
    args = (packed.qweight, packed.scales, packed.mins)
    g = torch.Generator().manual_seed(6)
    for count in sorted({1, (rows + 1) // 2, rows}):
        x = torch.randn(count, 1536, generator=g)
        exact = torch.ops.mstar_quant.int4_linear(x, *args)
        error = (torch.ops.mstar_quant.int4_linear_i16(x, *args) - exact).abs().max()
        assert 0 < error < 1e-4 * exact.abs().max()
    for count in range(rows + 1, BF16_ROWS + 1):
        x = torch.randn(count, 1536, generator=g)
        assert torch.equal(
            torch.ops.mstar_quant.int4_linear_i16(x, *args),
            torch.ops.mstar_quant.int4_linear(x, *args),
        )


def test_packed_linear_takes_int16_activations_below_bf16_rows(rows):
    """Up to the rows the kernel rounds, int16; past them float32, or from
    ``BF16_ROWS`` on the bfloat16 panels where the CPU has them."""
    packed = random_int4(64, 576, seed=2)
    args = (packed.qweight, packed.scales, packed.mins)
    bias = torch.randn(64)
    layer = PackedLinear(packed, bias, None, int16_activations=True)
    assert layer.arithmetic == "int16"
    g = torch.Generator().manual_seed(8)
    for count in (1, rows, rows + 1, BF16_ROWS):
        x = torch.randn(count, 576, generator=g)
        op = (
            torch.ops.mstar_quant.int4_linear_i16
            if count <= rows
            else torch.ops.mstar_quant.int4_linear
        )
        assert torch.equal(layer(x), op(x, *args) + bias)
    if bf16_or_why() is not None:
        return
    both = PackedLinear(packed, bias, bf16_panels(packed), int16_activations=True)
    assert both.arithmetic == "bfloat16+int16"
    panels_only = PackedLinear(packed, bias, bf16_panels(packed))
    for count in (1, BF16_ROWS - 1, BF16_ROWS):
        x = torch.randn(count, 576, generator=g)
        want = (
            torch.ops.mstar_quant.int4_linear_i16(x, *args) + bias
            if count < BF16_ROWS
            else panels_only(x)
        )
        assert torch.equal(both(x), want)


@pytest.mark.parametrize("group", [32, 64, None], ids=["Q8_0", "groups of 64", "per channel"])
def test_int8_kernel_rounds_one_row_and_multiplies_more_in_float32(rows, group):
    """int8 weights (GGUF's Q8_0 groups of 32, wider groups, a scale per
    row): one row is its rounding (a group of zeros among them), within
    1e-4 of float32; two rows are the float32 kernel, bit for bit."""
    per_row = quantize_int8(torch.randn(100, 192, generator=torch.Generator().manual_seed(9)))
    scales = per_row.scales.repeat(1, 192 // group) if group else per_row.scales
    scales = scales * torch.rand(scales.shape, generator=torch.Generator().manual_seed(1)) + 1e-3
    packed = Packed("int8", per_row.qweight, scales.half().contiguous())
    args = (packed.qweight, packed.scales)
    assert torch.ops.mstar_quant.int16_rows(8) == 1
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 384, generator=g)[:, ::2]
    x[0, 64:96] = 0.0
    y = torch.ops.mstar_quant.int8_linear_i16(x, *args)
    expected = rounded_reference(x, packed)
    torch.testing.assert_close(
        y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
    )
    exact = torch.ops.mstar_quant.int8_linear(x, *args)
    assert 0 < (y - exact).abs().max() < 1e-4 * exact.abs().max()
    x = torch.randn(2, 192, generator=g)
    assert torch.equal(
        torch.ops.mstar_quant.int8_linear_i16(x, *args), torch.ops.mstar_quant.int8_linear(x, *args)
    )
    layer = PackedLinear(packed, None, None, int16_activations=True)
    assert layer.arithmetic == "int16" and torch.equal(
        layer(x[:1]), torch.ops.mstar_quant.int8_linear_i16(x[:1], *args)
    )


def test_bfloat16_arithmetic_gives_packed_layers_int16_activations_and_says_so(rows):
    """Every packed layer of a model quantized in bfloat16 arithmetic takes
    int16 activations (int4 and int8), the description names them,
    and the model's logits stay within the bfloat16 mode's reach of float32."""
    model = build_model(0)[1].eval()
    twin = build_model(0)[1].eval()
    description = quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.int16_activations for m in packed)
    few = "1 row" if rows == 1 else f"1-{rows} rows"
    laned = sum(m.lanes is not None for m in packed)
    assert laned == (len(packed) if torch.ops.mstar_quant.lanes_rows() else 0)
    on = f" ({laned} of them on lanes, 16 rows a vector)" if laned else ""
    assert f"; int16 activations at {few} (the {len(packed)} int4 layers){on}, " in description
    many = "9+ rows multiply in bfloat16" if bf16_or_why() is None else "more rows float32 (the CPU"
    assert description.endswith(many) or f", {many}" in description
    quantize_model(twin, QuantChoice("int4", "as asked", "float32"))
    assert not any(m.int16_activations for m in twin.modules() if isinstance(m, PackedLinear))
    ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, exact = model(ids).logits, twin(ids).logits
    assert 0 < (ours - exact).abs().max() < 1e-3 * exact.abs().max()
    int8 = build_model(0)[1].eval()
    described = quantize_model(int8, QuantChoice("int8", "as asked", "bfloat16"))
    most = torch.ops.mstar_quant.lanes_rows()  # int8 on lanes: their rows, else one
    few = f"1-{most} rows" if most > 1 else "1 row"
    assert f"; int16 activations at {few} (the {len(packed)} int8 layers){on}, " in described
    assert all(m.int16_activations for m in int8.modules() if isinstance(m, PackedLinear))


def test_int16_activations_are_fixed_at_construction(rows):
    layer = PackedLinear(random_int4(32, 64, seed=3), int16_activations=True)
    with pytest.raises(AttributeError):
        layer.int16_activations = False


@pytest.fixture(scope="module")
def lanes(rows):
    """Whether this build multiplies lanes (AVX512-VNNI)."""
    if not torch.ops.mstar_quant.lanes_rows():
        pytest.skip("the kernels' build has no lanes (no AVX512-VNNI)")


def test_lanes_hold_each_weight_scale_and_minimum_at_its_place():
    """``Packed.lanes``: per block of 16 rows and group of 32, octet ``o``'s
    lane ``r`` holds row ``r``'s weights ``8o..8o+3`` (low nibbles) and
    ``8o+4..8o+7`` (high), then the rows' scales, then their minimums; int8:
    pair ``p``'s 32 bytes hold row ``r``'s columns ``2p, 2p+1`` at ``2r,
    2r+1``, then a scale per row and 32 columns; rows divisible by 16;
    ``Packed.from_lanes`` gives the weights back."""
    packed = random_int4(48, 96, seed=4)
    q = packed.values()
    held = packed.lanes().view(3, 3, 320)
    for row, column in ((0, 0), (17, 37), (47, 95), (30, 68)):
        block, r, group, k = row // 16, row % 16, column // 32, column % 32
        octet, half, j = k // 8, k % 8 // 4, k % 4
        byte = int(held[block, group, 64 * octet + 4 * r + j])
        assert (byte >> 4 * half) & 0x0F == q[row, column]
        assert held[block, group, 256:288].view(torch.float16)[r] == packed.scales[row, group]
        assert held[block, group, 288:].view(torch.float16)[r] == packed.mins[row, group]
    per_channel = quantize_int8(torch.randn(32, 64, generator=torch.Generator().manual_seed(4)))
    held = per_channel.lanes().view(2, 2, 544)
    assert held.dtype == torch.int8
    for row, column in ((0, 0), (17, 37), (31, 63)):
        block, r, group, k = row // 16, row % 16, column // 32, column % 32
        assert held[block, group, 32 * (k // 2) + 2 * r + k % 2] == per_channel.qweight[row, column]
        scale = held[block, group, 512:].view(torch.float16)[r]
        assert scale == per_channel.scales[row, 0]
    back = Packed.from_lanes("int4", packed.lanes())  # and back, bit for bit
    assert all(
        torch.equal(getattr(back, n), getattr(packed, n)) for n in ("qweight", "scales", "mins")
    )
    back = Packed.from_lanes("int8", per_channel.lanes())  # a scale per 32 columns now
    assert torch.equal(back.qweight, per_channel.qweight) and back.scales.shape == (32, 2)
    assert torch.equal(back.dequantize(), per_channel.dequantize())
    with pytest.raises(ValueError, match="expected int8 lanes"):
        Packed.from_lanes("int8", packed.lanes())
    with pytest.raises(ValueError, match="rows divisible by 16"):
        random_int4(40, 96, seed=4).lanes()
    with pytest.raises(ValueError, match="int4 or int8 weights"):
        pack_bf16(torch.randn(32, 32)).lanes()


@pytest.mark.parametrize("shape", [(48, 576), (32, 1536), (16, 32), (64, 96), (464, 576)])
def test_lanes_kernel_is_its_rounding_of_the_activations(lanes, rows, shape):
    """The int4 lanes kernel: every row count it takes, against the float64
    model of the rounding and against ``int4_linear_i16`` (the same
    integers, another order of float32 sums); non-contiguous activations,
    a group of zeros and one of denormals; enough weights to share among
    threads (464 x 576); more rows than it rounds refused."""
    packed = random_int4(*shape, seed=shape[0])
    held = packed.lanes()
    args = (packed.qweight, packed.scales, packed.mins)
    g = torch.Generator().manual_seed(5)
    for count in range(1, rows + 1):
        x = activations(count, shape[1], g)
        y = torch.ops.mstar_quant.lanes_i16(x, held)
        expected = rounded_reference(x, packed)
        assert y.shape == (count, shape[0]) and y.dtype == torch.float32
        top = float(expected.abs().max())
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * top)
        ours = torch.ops.mstar_quant.int4_linear_i16(x, *args)
        torch.testing.assert_close(y, ours, rtol=0, atol=1e-6 * top)
    with pytest.raises(RuntimeError, match=f"at most {rows} activation rows for lanes"):
        torch.ops.mstar_quant.lanes_i16(torch.randn(rows + 1, shape[1]), held)
    with pytest.raises(RuntimeError, match=r"expected contiguous uint8 \(int4\) or int8 lanes"):
        torch.ops.mstar_quant.lanes_i16(torch.randn(1, shape[1]), held[:, :-1])


@pytest.mark.parametrize("group", [32, 64, None], ids=["Q8_0", "groups of 64", "per channel"])
def test_int8_lanes_kernel_is_its_rounding_of_every_row_count(lanes, rows, group):
    """int8 lanes: every row count the lanes take (a group of zeros in the
    first) against the float64 model of the rounding, one row against
    ``int8_linear_i16`` (the same integers); more rows refused."""
    per_row = quantize_int8(torch.randn(112, 192, generator=torch.Generator().manual_seed(9)))
    scales = per_row.scales.repeat(1, 192 // group) if group else per_row.scales
    scales = scales * torch.rand(scales.shape, generator=torch.Generator().manual_seed(1)) + 1e-3
    packed = Packed("int8", per_row.qweight, scales.half().contiguous())
    most = torch.ops.mstar_quant.lanes_rows()
    g = torch.Generator().manual_seed(7)
    for count in range(1, most + 1):
        x = torch.randn(count, 384, generator=g)[:, ::2]
        x[0, 64:96] = 0.0
        y = torch.ops.mstar_quant.lanes_i16(x, packed.lanes())
        expected = rounded_reference(x, packed)
        top = float(expected.abs().max())
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * top)
    ours = torch.ops.mstar_quant.int8_linear_i16(x[:1], packed.qweight, packed.scales)
    torch.testing.assert_close(y[:1], ours, rtol=0, atol=1e-6 * top)
    with pytest.raises(RuntimeError, match=f"at most {most} activation rows for lanes"):
        torch.ops.mstar_quant.lanes_i16(torch.randn(most + 1, 192), packed.lanes())


def k_quant(type_name: str, rows: int, width: int, seed: int, factors: bool = False) -> Packed:
    """Random GGUF blocks of ``type_name`` (Q4_K, Q5_K, Q6_K), packed: float32
    scales (also their own factors where ``factors``: lanes of those)."""
    pytest.importorskip("gguf")
    data = random_blocks(type_name, rows, width, np.random.default_rng(seed))
    packed = decode_blocks(type_name, data)
    return packed if factors else replace(packed, factors=None)


def test_float32_scale_lanes_hold_each_weight_and_scale_at_its_place():
    """With float32 scales the lanes take a third axis, the layout's bytes a
    group: int4 (Q4_K) 384, the nibbles as with float16 scales, then the
    16 rows' float32 scales and minimums; int8 (Q6_K) 640, the pairs as
    with float16 scales, then the rows' scales of columns 0-15, then of
    16-31. ``from_lanes`` gives the weights back bit for bit, float32."""
    q4 = k_quant("Q4_K", 48, 512, seed=1)
    held = q4.lanes()
    assert held.dtype == torch.uint8 and held.shape == (3, 16, 384)
    q = q4.values()
    for row, column in ((0, 0), (17, 37), (47, 511), (30, 300)):
        block, r, group, k = row // 16, row % 16, column // 32, column % 32
        octet, half, j = k // 8, k % 8 // 4, k % 4
        assert (int(held[block, group, 64 * octet + 4 * r + j]) >> 4 * half) & 0x0F == q[
            row, column
        ]
        assert held[block, group, 256:320].view(torch.float32)[r] == q4.scales[row, group]
        assert held[block, group, 320:].view(torch.float32)[r] == q4.mins[row, group]
    q6 = k_quant("Q6_K", 32, 256, seed=2)
    held = q6.lanes()
    assert held.dtype == torch.int8 and held.shape == (2, 8, 640)
    for row, column in ((0, 0), (17, 37), (31, 255), (5, 20)):
        block, r, group, k = row // 16, row % 16, column // 32, column % 32
        assert held[block, group, 32 * (k // 2) + 2 * r + k % 2] == q6.qweight[row, column]
        scales = held[block, group, 512:].view(torch.float32).view(2, 16)
        assert scales[k // 16, r] == q6.scales[row, column // 16]
    for packed in (q4, q6):
        back = Packed.from_lanes(packed.kind, packed.lanes())
        for name in ("qweight", "scales", "mins"):
            theirs, ours = getattr(packed, name), getattr(back, name)
            assert (theirs is None and ours is None) or torch.equal(ours, theirs), name
        assert back.scales.dtype == torch.float32
    with pytest.raises(ValueError, match="expected int4 lanes"):
        Packed.from_lanes("int4", q4.lanes()[:, :, :320])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("shape", [(48, 256), (32, 1536), (464, 768)])
def test_float32_scale_lanes_kernel_is_its_rounding_of_the_activations(
    lanes, rows, type_name, shape
):
    """Q4_K's and Q6_K's lanes at every row count the lanes take: against
    the float64 model of the rounding, and within 1e-4 of ``F.linear`` on
    the dequantized weights (gguf-py's float32 values); non-contiguous
    activations, a group of zeros and one of denormals; enough weights to
    share among threads (464 x 768)."""
    packed = k_quant(type_name, *shape, seed=shape[0])
    held = packed.lanes()
    _lanes_round_as_modelled(packed, held, rows)
    with pytest.raises(RuntimeError, match=r"\[N/16, K/32, 384 or 640\] \(float32\)"):
        torch.ops.mstar_quant.lanes_i16(torch.randn(1, shape[1]), held[:, :, :-1].contiguous())


def _assert_rebuilds(kind: str, held: torch.Tensor, packed: Packed) -> None:
    """``Packed.from_lanes(kind, held)`` is ``packed``: its row-major tensors and its factors."""
    back = Packed.from_lanes(kind, held)
    for name in ("qweight", "scales", "mins"):
        assert torch.equal(getattr(back, name), getattr(packed, name)), name
    for name in ("d", "dmin", "sc", "m"):
        assert torch.equal(getattr(back.factors, name), getattr(packed.factors, name)), name


def _lanes_round_as_modelled(packed: Packed, held: torch.Tensor, rows: int) -> torch.Tensor:
    """``lanes_i16`` on ``held`` (``packed``'s lanes) at 1 to ``rows`` rows:
    against the float64 model of the rounding, and within 1e-4 of
    ``F.linear`` on the dequantized weights, which it returns."""
    weight = packed.dequantize()
    n, k = weight.shape
    g = torch.Generator().manual_seed(5)
    for count in range(1, rows + 1):
        x = activations(count, k, g)
        y = torch.ops.mstar_quant.lanes_i16(x, held)
        assert y.shape == (count, n) and y.dtype == torch.float32
        expected = rounded_reference(x, packed)
        top = float(expected.abs().max())
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * top)
        exact = F.linear(x.double(), weight.double())
        torch.testing.assert_close(y.double(), exact, rtol=0, atol=1e-4 * top)
    return weight


def test_packed_linear_multiplies_few_rows_on_its_lanes(lanes, rows):
    """With lanes, up to the rows the kernel rounds multiply on them, bit
    for bit the lanes op; past them the int4 weights (or the panels) as
    without; int8 layers with lanes round as many rows (one without);
    lanes only with int16 activations, of their shape."""
    packed = random_int4(64, 576, seed=2)
    args = (packed.qweight, packed.scales, packed.mins)
    bias = torch.randn(64)
    layer = PackedLinear(packed, bias, None, True, packed.lanes())
    g = torch.Generator().manual_seed(9)
    for count in (1, rows):
        x = torch.randn(count, 576, generator=g)
        assert torch.equal(layer(x), torch.ops.mstar_quant.lanes_i16(x, layer.lanes) + bias)
        assert layer.read_tensors(count) == [layer.lanes, layer.bias]
    x = torch.randn(rows + 1, 576, generator=g)
    assert torch.equal(layer(x), torch.ops.mstar_quant.int4_linear(x, *args) + bias)
    assert layer.int16_rows == rows
    head = quantize_int8(torch.randn(32, 576, generator=g))
    held = PackedLinear(head, None, None, True, head.lanes())
    assert held.int16_rows == torch.ops.mstar_quant.lanes_rows() > 1
    x = torch.randn(held.int16_rows, 576, generator=g)
    assert torch.equal(held(x), torch.ops.mstar_quant.lanes_i16(x, held.lanes))
    x = torch.randn(held.int16_rows + 1, 576, generator=g)
    assert torch.equal(held(x), torch.ops.mstar_quant.int8_linear(x, head.qweight, head.scales))
    assert PackedLinear(head, None, None, True).int16_rows == 1
    with pytest.raises(ValueError, match="lanes only for int4/int8 weights with int16"):
        PackedLinear(packed, None, None, False, packed.lanes())
    with pytest.raises(ValueError, match="uint8 lanes of shape"):
        PackedLinear(packed, None, None, True, random_int4(32, 576, seed=1).lanes())


def test_bfloat16_arithmetic_holds_lanes_where_the_build_has_them(lanes, monkeypatch):
    """A model quantized int4 or int8 in bfloat16 arithmetic holds lanes in
    every layer and, its panels past ``HELD_PANELS_BYTES``, takes its many
    rows' panels from them: no panels and no row-major copy (rebuilt from the
    lanes, the same weights); its logits are within 1e-4 of the same layers'
    without lanes (the same integers: sums in another order, so an
    activation a layer on may round to the neighbouring int16); its many rows
    on int8 activations within 5% of float32's largest logit. Under the
    bound (a small model) it holds its panels, and no row-major copy."""
    import mstar.cpu.quant as quant

    small = build_model(0)[1].eval()
    held = quantize_model(small, QuantChoice("int4", "as asked", "bfloat16"))
    layers = [m for m in small.modules() if isinstance(m, PackedLinear)]
    assert all(m.panels is not None and not m.lane_panels and m.qweight is None for m in layers)
    assert "from the lanes" not in held
    monkeypatch.setattr(quant, "HELD_PANELS_BYTES", 0)
    model = build_model(0)[1].eval()
    lean = quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    amx = torch.ops.mstar_quant.amx_rows() > 0  # a CPU with AMX: many rows on its tiles
    on_int8 = (
        f"2-{AMX_PANEL_ROWS - 1} rows on int8 activations, {AMX_PANEL_ROWS}+ on AMX's"
        " bfloat16 tiles (panels from the lanes)"
        if amx
        else "2+ rows on int8 activations"
    )
    assert lean.endswith(on_int8) and ("bfloat16" in lean) == amx
    plain = build_model(0)[1].eval()
    for name, m in list(model.named_modules()):
        if isinstance(m, PackedLinear):
            assert m.lanes is not None and m.panels is None
            assert (m.qweight is None) == m.lane_panels
            again = quantize_int4(plain.get_submodule(name).weight)
            assert torch.equal(m.packed().qweight, again.qweight)
            held = bf16_panels(m.packed()) if m.lane_panels else None
            plain.set_submodule(name, PackedLinear(m.packed(), m.bias, held, True))
    ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(ids).logits, plain(ids).logits
    assert 0 < (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    prompt = torch.randint(0, 256, (1, BF16_ROWS + 3), generator=torch.Generator().manual_seed(3))
    exact = build_model(0)[1].eval()  # the same weights dequantized, float32 arithmetic
    for name, m in list(model.named_modules()):
        if isinstance(m, PackedLinear):
            exact.set_submodule(name, m.dequantized())
    with torch.no_grad():  # many rows: int8 activations on the lanes (bfloat16 panels' ~7x off)
        ours, theirs, f32 = (m(prompt).logits for m in (model, plain, exact))
    assert 0 < (theirs - f32).abs().max() < (ours - f32).abs().max() < 5e-2 * f32.abs().max()
    int8 = build_model(0)[1].eval()
    quantize_model(int8, QuantChoice("int8", "as asked", "bfloat16"))
    assert all(m.lanes is not None for m in int8.modules() if isinstance(m, PackedLinear))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_panels_from_float32_scale_lanes_are_the_held_panels_bit_for_bit(lanes, type_name):
    """Q4_K's and Q6_K's lanes (float32 scales) dequantized a panel at a time
    (``lanes_bf16``) are ``bf16_panels`` of their weights: the same products
    bit for bit at every row count; a layer reads its rows back from them."""
    if bf16_or_why() is not None:
        pytest.skip(bf16_or_why())
    packed = k_quant(type_name, 96, 512, seed=6)
    _assert_panels_from_lanes_are_held_panels(packed)
    layer = PackedLinear(packed, None, None, True, packed.lanes(), lane_panels=True)
    assert torch.equal(layer.weight_rows(32, 96), packed.dequantize()[32:96])


def test_k_quant_lanes_hold_their_factors_at_their_place():
    """Q4_K's weights holding its own factors take lanes of them: per block
    of 16 rows and super-block of 256 columns, the rows' float16 ``d``, then
    ``dmin``, then each group's ``sc`` and ``m`` low 4 bits (a byte a row),
    then their top 2 bits (an int32 a row, group ``j``'s at bits ``4j`` and
    ``4j + 2``), then the 8 groups' octets as in every int4 layout: the
    file's 144 bytes a row and super-block; Q6_K's: the rows' ``d``, then
    each 16 columns' int8 ``sc``, then the 8 groups' six-bit values (a byte
    each, but every fourth in the others' top 2 bits); ``from_lanes`` gives back the weights, float32 scales and
    factors bit for bit, and rows reordered take their factors along."""
    q4 = k_quant("Q4_K", 48, 512, seed=1, factors=True)
    held = q4.lanes()
    assert held.dtype == torch.uint8 and held.shape == (3, 2, 2304) == lanes_shape(q4)
    assert held.numel() == 48 * 2 * 144  # the file's bytes
    f, q = q4.factors, q4.values()
    for row, column in ((0, 0), (17, 37), (47, 511), (30, 300)):
        block, r, sb, group, k = row // 16, row % 16, column // 256, column // 32 % 8, column % 32
        head = held[block, sb]
        assert head[:32].view(torch.float16)[r] == f.d[row, sb]
        assert head[32:64].view(torch.float16)[r] == f.dmin[row, sb]
        low, top = int(head[64 + 16 * group + r]), int(head[192:256].view(torch.int32)[r])
        top >>= 4 * group
        assert low & 0x0F | (top & 3) << 4 == f.sc[row, column // 32]
        assert low >> 4 | (top >> 2 & 3) << 4 == f.m[row, column // 32]
        octet, half, j = k // 8, k % 8 // 4, k % 4
        byte = int(head[256 + 256 * group + 64 * octet + 4 * r + j])
        assert (byte >> 4 * half) & 0x0F == q[row, column]
    _assert_rebuilds("int4", held, q4)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    moved = q4.rows(order)
    assert torch.equal(moved.factors.d, f.d[order]) and torch.equal(moved.factors.m, f.m[order])
    again = Packed.from_lanes("int4", moved.lanes()).dequantize()
    assert torch.equal(again, q4.dequantize()[order])
    meta = Packed.from_lanes("int4", held.to("meta"))  # a stand-in of the layout's shapes
    assert lanes_shape(meta) == tuple(held.shape) and meta.factors.sc.shape == (48, 16)
    with pytest.raises(ValueError, match="expected int4 lanes"):
        Packed.from_lanes("int4", held[:, :, :2303])
    wide = f.m.clone()
    wide[7, 3] = 64  # seven bits: the head holds six
    with pytest.raises(ValueError, match=r"six-bit sc and m \(0\.\.63\) for its lanes, got 64"):
        replace(q4, factors=replace(f, m=wide)).lanes()
    q6 = k_quant("Q6_K", 32, 512, seed=2, factors=True)
    held = q6.lanes()
    assert held.dtype == torch.int8 and held.shape == (2, 2, 3360) == lanes_shape(q6)
    f = q6.factors
    for row, column in ((0, 0), (17, 37), (31, 511), (5, 300), (9, 46)):
        block, r, sb, group, k = row // 16, row % 16, column // 256, column // 32 % 8, column % 32
        head = held[block, sb]
        assert head[:32].view(torch.float16)[r] == f.d[row, sb]
        assert head[32 + 16 * (column // 16 % 16) + r] == f.sc[row, column // 16]
        # six bits: half h's vector i, row r's byte j of column 16h + 4i + j (i < 3), or its
        # top 2 bits the bits 2i, 2i+1 of column 16h + 12 + j
        at = 288 + 384 * group + 192 * (k // 16)
        vectors = head.view(torch.uint8)[at : at + 192].view(3, 64)[:, 4 * r + k % 4]
        if k % 16 < 12:
            q = int(vectors[k % 16 // 4]) & 0x3F
        else:
            q = sum((int(vectors[i]) >> 6) << 2 * i for i in range(3))
        assert q - 32 == q6.qweight[row, column]
    back = Packed.from_lanes("int8", held)
    assert torch.equal(back.qweight, q6.qweight) and torch.equal(back.scales, q6.scales)
    assert back.mins is None and back.factors.dmin is None and torch.equal(back.factors.sc, f.sc)
    assert torch.equal(back.factors.d, f.d)
    moved = q6.rows(torch.randperm(32, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(Packed.from_lanes("int8", moved.lanes()).qweight, moved.qweight)
    wrong = q6.qweight.clone()
    wrong[0, 0] = 32
    with pytest.raises(
        ValueError, match=r"expected Q6_K values -32..31 for its lanes, got -\d+..32"
    ):
        replace(q6, qweight=wrong).lanes()


def test_q5_k_lanes_hold_q4_k_lanes_nibbles_and_their_fifth_bits():
    """Q5_K's weights (int8 0..31 of float32 scales and minimums) take lanes
    of their factors: Q4_K's head, then per group the octets of the values'
    low nibbles and 64 bytes of their fifth bits (byte ``4r + j``, bit ``o``:
    column ``8o + j``, bit ``4 + o``: column ``8o + 4 + j``), 0.6875 bytes a
    weight (the file's); ``from_lanes`` gives back the weights and factors bit for bit,
    on meta tensors the shapes; lanes need the factors and values 0..31."""
    q5 = k_quant("Q5_K", 48, 512, seed=1, factors=True)
    assert q5.kind == "int8" and q5.mins is not None
    held = q5.lanes()
    assert held.dtype == torch.int8 and held.shape == (3, 2, 2816) == lanes_shape(q5)
    assert held.numel() == 48 * 2 * 176  # the file's bytes
    f, q, bytes_ = q5.factors, q5.qweight, held.view(torch.uint8)
    for row, column in ((0, 0), (17, 37), (47, 511), (30, 300), (3, 255)):
        block, r, sb, group, k = row // 16, row % 16, column // 256, column // 32 % 8, column % 32
        head = bytes_[block, sb]
        assert head[:32].view(torch.float16)[r] == f.d[row, sb]
        low, top = int(head[64 + 16 * group + r]), int(head[192:256].view(torch.int32)[r])
        top >>= 4 * group
        assert low & 0x0F | (top & 3) << 4 == f.sc[row, column // 32]
        assert low >> 4 | (top >> 2 & 3) << 4 == f.m[row, column // 32]
        octet, half, j = k // 8, k % 8 // 4, k % 4
        at = 256 + 320 * group
        low = (int(head[at + 64 * octet + 4 * r + j]) >> 4 * half) & 0x0F
        fifth = (int(head[at + 256 + 4 * r + j]) >> 4 * half + octet) & 1
        assert low | fifth << 4 == q[row, column]
    _assert_rebuilds("int8", held, q5)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    again = Packed.from_lanes("int8", q5.rows(order).lanes()).dequantize()
    assert torch.equal(again, q5.dequantize()[order])
    meta = Packed.from_lanes("int8", held.to("meta"))
    assert lanes_shape(meta) == tuple(held.shape) and meta.mins.shape == (48, 16)
    with pytest.raises(ValueError, match=r"expected Q5_K's factors and values 0..31 .*=False"):
        replace(q5, factors=None).lanes()
    wrong = q.clone()
    wrong[5, 9] = 32
    with pytest.raises(ValueError, match=r"values 0..32"):
        replace(q5, qweight=wrong).lanes()


@pytest.mark.parametrize("shape", [(48, 256), (96, 1536), (480, 768)])
def test_q5_k_lanes_kernel_is_its_rounding_of_the_activations(lanes, rows, shape):
    """Q5_K's lanes at every row count the lanes take, as Q4_K's and Q6_K's
    float32-scale lanes: against the float64 model of the rounding, and
    within 1e-4 of ``F.linear`` on gguf-py's float32 weights; 32-row panels
    dequantized from them (``lanes_bf16``) are the held panels bit for bit,
    and a layer on them reads its rows back; enough weights to share among
    threads; a lanes tensor one byte short named."""
    packed = k_quant("Q5_K", *shape, seed=shape[0], factors=True)
    held = packed.lanes()
    weight = _lanes_round_as_modelled(packed, held, rows)
    if bf16_or_why() is None and shape[0] % 32 == 0:
        _assert_panels_from_lanes_are_held_panels(packed)
        layer = PackedLinear(packed, None, None, True, held, lane_panels=True)
        assert layer.qweight is None and torch.equal(layer.weight_rows(32, 96), weight[32:96])
    with pytest.raises(RuntimeError, match=r"\[N/16, K/256, 2304 or 3360, int8 2816\]"):
        torch.ops.mstar_quant.lanes_i16(torch.randn(1, shape[1]), held[:, :, :-1].contiguous())


# a K-quant's lanes: bytes a block a super-block of its factors, a group of float32 scales;
# bytes a weight (x1000) of its factors
SUPER_LANES = {"Q4_K": (2304, 384, 562), "Q6_K": (3360, 640, 820)}


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("shape", [(48, 256), (96, 1536), (480, 768)])
def test_k_quant_factor_lanes_are_the_float32_lanes_bit_for_bit(lanes, rows, type_name, shape):
    """Lanes of Q4_K's and Q6_K's own factors (scales and minimums made in
    registers) give what their float32-scale lanes give, bit for bit: at
    every row count the lanes take (``lanes_i16``) and, 32-row panels
    dequantized from them, at more (``lanes_bf16``); enough weights to
    share among threads."""
    packed = k_quant(type_name, *shape, seed=shape[0], factors=True)
    compact, wide = packed.lanes(), replace(packed, factors=None).lanes()
    assert compact.dim() == wide.dim() == 3
    assert (compact.shape[2], wide.shape[2]) == SUPER_LANES[type_name][:2]
    per_weight = compact.numel() * 1000 // (shape[0] * shape[1])
    assert per_weight == SUPER_LANES[type_name][2]
    ops = torch.ops.mstar_quant
    g = torch.Generator().manual_seed(3)
    for count in range(1, rows + 1):
        x = activations(count, shape[1], g)
        assert torch.equal(ops.lanes_i16(x, compact), ops.lanes_i16(x, wide)), count
    if bf16_or_why() is None and shape[0] % 32 == 0:
        for count in (1, 7, BF16_ROWS, 33):
            x = torch.randn(count, shape[1], generator=g)
            assert torch.equal(ops.lanes_bf16(x, compact), ops.lanes_bf16(x, wide)), count
    with pytest.raises(RuntimeError, match=r"2304 or 3360, int8 2816\] \(the K-quants'"):
        ops.lanes_i16(torch.randn(1, shape[1]), compact[:, :, :-1].contiguous())


def q4_0(rows: int, width: int, seed: int) -> Packed:
    """Random GGUF Q4_0 blocks, packed: int4 of minimums ``-8 * scale``."""
    pytest.importorskip("gguf")
    return decode_blocks("Q4_0", random_blocks("Q4_0", rows, width, np.random.default_rng(seed)))


def test_q4_0_lanes_hold_no_minimums_and_give_the_weights_back():
    """Q4_0's weights (every minimum ``-8 * scale``: ``symmetric``) take
    lanes of 288 bytes a block a group, the octets as in every int4 layout,
    then the 16 rows' float16 scales, no minimums: 0.5625 bytes a weight,
    the file's own; ``from_lanes`` gives the weights back bit for bit,
    symmetric, and rows reordered stay so. Q4_1's, and a Q4_0 whose ``-8 *
    scale`` overflows float16, keep their minimums; only int4 of float16
    scales is symmetric."""
    packed = q4_0(48, 512, seed=1)
    held = packed.lanes()
    assert packed.symmetric and held.dtype == torch.uint8
    assert held.shape == (3, 16, 288) == lanes_shape(packed)
    assert held.numel() / packed.values().numel() == 0.5625
    q = packed.values()
    for row, column in ((0, 0), (17, 37), (47, 511), (30, 300)):
        block, r, group, k = row // 16, row % 16, column // 32, column % 32
        octet, half, j = k // 8, k % 8 // 4, k % 4
        byte = int(held[block, group, 64 * octet + 4 * r + j])
        assert (byte >> 4 * half) & 0x0F == q[row, column]
        assert held[block, group, 256:].view(torch.float16)[r] == packed.scales[row, group]
    back = Packed.from_lanes("int4", held)
    assert back.symmetric
    for name in ("qweight", "scales", "mins"):
        assert torch.equal(getattr(back, name), getattr(packed, name)), name
    order = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    moved = packed.rows(order)
    assert moved.symmetric and moved.lanes().shape == held.shape
    again = Packed.from_lanes("int4", moved.lanes()).dequantize()
    assert torch.equal(again, packed.dequantize()[order])
    meta = Packed.from_lanes("int4", held.to("meta"))  # a stand-in of the layout's shapes
    assert meta.symmetric and lanes_shape(meta) == tuple(held.shape)
    with pytest.raises(ValueError, match="expected int4 lanes"):
        Packed.from_lanes("int4", held[:, :, :287])
    with pytest.raises(ValueError, match="expected int8 lanes"):
        Packed.from_lanes("int8", held.view(torch.int8))
    rng = np.random.default_rng(2)
    q4_1 = decode_blocks("Q4_1", random_blocks("Q4_1", 16, 64, rng))
    assert not q4_1.symmetric and q4_1.lanes().shape == (1, 640)
    data = random_blocks("Q4_0", 16, 64, rng)
    data[3, 18:20] = np.array([16384], dtype=np.float16).view(np.uint8)  # -8 x it: -inf in float16
    overflowing = decode_blocks("Q4_0", data)
    assert not overflowing.symmetric and overflowing.lanes().shape == (1, 640)
    with pytest.raises(ValueError, match="expected symmetric weights int4 of float16 scales"):
        replace(quantize_int8(torch.randn(16, 32)), symmetric=True)


@pytest.mark.parametrize("shape", [(48, 256), (96, 1536), (480, 768)])
def test_q4_0_lanes_are_the_lanes_of_its_minimums_bit_for_bit(lanes, rows, shape):
    """Q4_0's lanes without minimums (each made in registers as ``scale *
    -8``) give what lanes holding them give, bit for bit: at every row
    count the lanes take (``lanes_i16``) and, 32-row panels dequantized
    from them, at more (``lanes_bf16``: the held panels' products); enough
    weights to share among threads. A layer keeps them symmetric, and on
    them alone gives its weights back (``weight_rows``)."""
    packed = q4_0(*shape, seed=shape[0])
    compact, full = packed.lanes(), replace(packed, symmetric=False).lanes()
    assert compact.shape[2] == 288 and full.dim() == 2
    ops = torch.ops.mstar_quant
    g = torch.Generator().manual_seed(3)
    for count in range(1, rows + 1):
        x = activations(count, shape[1], g)
        assert torch.equal(ops.lanes_i16(x, compact), ops.lanes_i16(x, full)), count
    with pytest.raises(RuntimeError, match=r"uint8 \[N/16, K/32, 288\] \(symmetric\)"):
        ops.lanes_i16(torch.randn(1, shape[1]), compact[:, :, :-1].contiguous())
    layer = PackedLinear(packed, None, None, True, compact)
    assert torch.equal(layer.packed().lanes(), compact)
    if bf16_or_why() is None and shape[0] % 32 == 0:
        _assert_panels_from_lanes_are_held_panels(packed)
        alone = PackedLinear(packed, None, None, True, compact, lane_panels=True)
        assert alone.qweight is None and alone.packed().symmetric
        assert torch.equal(alone.weight_rows(0, shape[0]), packed.dequantize())


@pytest.mark.parametrize("quantize", [quantize_int4, quantize_int8])
def test_panels_from_the_lanes_are_the_held_panels_bit_for_bit(lanes, quantize):
    """``lanes_bf16`` (each 32-row panel dequantized from the lanes as the
    product reaches it) equals ``bf16_linear`` on ``bf16_panels`` of the same
    weights at every row count, and a layer with ``lane_panels`` takes it
    from ``BF16_ROWS`` rows on (int8 weights; int4 lanes take 2+ rows on int8
    activations instead, ``test_int8_rows.py``), holding neither panels nor a
    row-major copy."""
    if bf16_or_why() is not None:
        pytest.skip(bf16_or_why())
    packed = quantize(torch.randn(96, 320, generator=torch.Generator().manual_seed(4)))
    _assert_panels_from_lanes_are_held_panels(packed)
    layer = PackedLinear(packed, None, None, True, packed.lanes(), lane_panels=True)
    held = PackedLinear(packed, None, bf16_panels(packed), True, packed.lanes())
    int8 = layer.int8_rows > 0
    assert int8 == (quantize is quantize_int4) and layer.panels is None and layer.qweight is None
    amx = torch.ops.mstar_quant.amx_rows() > 0  # a CPU with AMX: 32+ rows on its tiles
    assert layer.arithmetic == ("bfloat16+" * amx + "int16+int8" if int8 else "bfloat16+int16")
    x = torch.randn(2, BF16_ROWS, 320)
    expected = torch.ops.mstar_quant.lanes_i8(x, layer.lanes) if int8 else held(x)
    assert torch.equal(layer(x), expected) and not torch.equal(layer(x), layer.dequantized()(x))
    assert torch.equal(layer.weight_rows(32, 96), packed.dequantize()[32:96])  # from the lanes
    assert torch.equal(held.weight_rows(0, 96), packed.dequantize())  # row-major
    with pytest.raises(ValueError, match=r"multiples of 32, got \[16, 32\)"):
        layer.weight_rows(16, 32)
    with pytest.raises(ValueError, match="lane panels only with lanes"):
        PackedLinear(packed, None, None, True, None, lane_panels=True)
    with pytest.raises(ValueError, match="rows divisible by 32"):
        PackedLinear(
            quantize(torch.randn(48, 64)),
            None,
            None,
            True,
            quantize(torch.randn(48, 64)).lanes(),
            lane_panels=True,
        )


def _assert_panels_from_lanes_are_held_panels(packed: Packed) -> None:
    """``lanes_bf16`` on ``packed``'s lanes equals ``bf16_linear`` on its held
    panels bit for bit at 1, 7, ``BF16_ROWS`` and 33 rows."""
    ops, width = torch.ops.mstar_quant, packed.shape[1]
    for rows in (1, 7, BF16_ROWS, 33):
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(
            ops.lanes_bf16(x, packed.lanes()), ops.bf16_linear(x, bf16_panels(packed))
        )
