"""int4 weights on activations rounded to int16 (``int4_linear_i16``,
``PackedLinear(int16_activations=True)``, the bfloat16 arithmetic's few-row
path: AVX512-VNNI's kernel or AVX2's, whichever this CPU builds): the kernel
against a float64 model of its rounding, its distance from float32, where
it applies and how it is named."""

from __future__ import annotations

import pytest
import torch

from mstar.demo import build_model
from mstar.engine.quant import QuantChoice, quantize_model
from mstar.engine.quant.at_load import quantize_int4, quantize_int8
from mstar.engine.quant.kernels import bf16_or_why, kernel_or_why
from mstar.engine.quant.linear import BF16_ROWS, PackedLinear
from mstar.engine.quant.packed import Packed, bf16_panels

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
        x = torch.randn(count, 2 * shape[1], generator=g)[:, ::2]
        if count == 1 and shape[1] >= 64:
            x[0, :32] = 0.0
            x[0, 32:64] = 1e-38
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
    assert f"; int16 activations at {few} (the {len(packed)} int4 layers), " in description
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
    assert f"; int16 activations at 1 row (the {len(packed)} int8 layers), " in described
    assert all(m.int16_activations for m in int8.modules() if isinstance(m, PackedLinear))


def test_int16_activations_are_fixed_at_construction(rows):
    layer = PackedLinear(random_int4(32, 64, seed=3), int16_activations=True)
    with pytest.raises(AttributeError):
        layer.int16_activations = False
