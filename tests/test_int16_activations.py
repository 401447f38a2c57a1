"""int4 weights on activations rounded to int16 (``int4_linear_i16``,
``PackedLinear(int16_activations=True)``, the bfloat16 arithmetic's few-row
path): the kernel against a float64 model of its rounding, its distance
from float32, where it applies and how it is named."""

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
def vnni():
    if (why := kernel_or_why() or bf16_or_why()) is not None:
        pytest.skip(why)


def rounded_reference(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """What ``int4_linear_i16`` computes, in float64: each group of 32 of
    ``x`` rounded to int16 at scale ``max |x| / 32767`` (ties to even; a
    group under 1e-30 left at zero), times the integers and scales; plus
    the minimums times the groups' float sums."""
    rows, width = x.shape
    groups = x.reshape(rows, width // 32, 32)
    top = groups.abs().amax(-1, keepdim=True)
    kept = top > 1e-30
    inverse = torch.where(kept, LIMIT / top, torch.zeros_like(top))
    scale = torch.where(kept, top / LIMIT, torch.zeros_like(top))
    q = torch.round(groups * inverse).double() * scale.double()
    weights = packed.values().double() * packed.scales.double().repeat_interleave(32, dim=1)
    return q.reshape(rows, width) @ weights.T + groups.double().sum(-1) @ packed.mins.double().T


def random_int4(rows: int, width: int, seed: int) -> Packed:
    return quantize_int4(torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("shape", [(52, 576), (36, 1536), (4, 32), (20, 96), (8, 160), (460, 576)])
def test_kernel_is_its_rounding_of_the_activations(vnni, shape):
    """1-8 rows, every count of groups in a last chunk of 4 (576: 2, 1536: 0,
    32: 1, 96: 3, 160: 1), enough weights to share among threads (460 x 576),
    non-contiguous activations, a group of zeros and one of denormals."""
    packed = random_int4(*shape, seed=shape[0])
    g = torch.Generator().manual_seed(5)
    for rows in range(1, BF16_ROWS):
        x = torch.randn(rows, 2 * shape[1], generator=g)[:, ::2]
        if rows == 3 and shape[1] >= 64:
            x[0, :32] = 0.0
            x[1, 32:64] = 1e-38
        y = torch.ops.mstar_quant.int4_linear_i16(x, packed.qweight, packed.scales, packed.mins)
        expected = rounded_reference(x, packed)
        assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
        torch.testing.assert_close(
            y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()),
            msg=lambda text, rows=rows: f"{rows} rows: {text}",
        )  # fmt: skip


def test_kernel_is_within_1e4_of_float32_and_exact_past_8_rows(vnni):
    """Against the float32 kernel: within 1e-4 of the largest output (int8
    activations, llama.cpp's, are ~1e-2 off on these), and from 9 rows on
    the float32 kernel itself, bit for bit."""
    packed = random_int4(96, 1536, seed=1)
    args = (packed.qweight, packed.scales, packed.mins)
    g = torch.Generator().manual_seed(6)
    for rows in (1, 4, 8):
        x = torch.randn(rows, 1536, generator=g)
        exact = torch.ops.mstar_quant.int4_linear(x, *args)
        error = (torch.ops.mstar_quant.int4_linear_i16(x, *args) - exact).abs().max()
        assert 0 < error < 1e-4 * exact.abs().max()
    x = torch.randn(9, 1536, generator=g)
    assert torch.equal(
        torch.ops.mstar_quant.int4_linear_i16(x, *args), torch.ops.mstar_quant.int4_linear(x, *args)
    )


def test_packed_linear_takes_int16_activations_below_bf16_rows(vnni):
    packed = random_int4(64, 576, seed=2)
    bias = torch.randn(64)
    layer = PackedLinear(packed, bias, bf16_panels(packed), int16_activations=True)
    assert layer.arithmetic == "bfloat16+int16"
    assert PackedLinear(packed, None, None, True).arithmetic == "int16"
    panels_only = PackedLinear(packed, bias, bf16_panels(packed))
    g = torch.Generator().manual_seed(8)
    for rows in (1, BF16_ROWS - 1, BF16_ROWS):
        x = torch.randn(rows, 576, generator=g)
        want = (
            torch.ops.mstar_quant.int4_linear_i16(x, packed.qweight, packed.scales, packed.mins)
            + bias
            if rows < BF16_ROWS
            else panels_only(x)
        )
        assert torch.equal(layer(x), want)


def test_int16_activations_need_int4_weights():
    with pytest.raises(ValueError, match="expected int4 weights for int16 activations, got int8"):
        PackedLinear(quantize_int8(torch.randn(32, 64)), int16_activations=True)


def test_bfloat16_arithmetic_gives_int4_layers_int16_activations_and_says_so(vnni):
    """Every int4 layer of a model quantized in bfloat16 arithmetic takes
    int16 activations, an int8 one does not, the description names them,
    and the model's logits stay within the bfloat16 mode's reach of float32."""
    model = build_model(0)[1].eval()
    twin = build_model(0)[1].eval()
    description = quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.int16_activations for m in packed)
    assert description.endswith(f"fewer on int16 activations (the {len(packed)} int4 layers)")
    quantize_model(twin, QuantChoice("int4", "as asked", "float32"))
    assert not any(m.int16_activations for m in twin.modules() if isinstance(m, PackedLinear))
    ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, exact = model(ids).logits, twin(ids).logits
    assert 0 < (ours - exact).abs().max() < 1e-3 * exact.abs().max()
    int8 = build_model(0)[1].eval()
    assert "int16" not in quantize_model(int8, QuantChoice("int8", "as asked", "bfloat16"))
    assert not any(m.int16_activations for m in int8.modules() if isinstance(m, PackedLinear))


def test_int16_activations_are_fixed_at_construction(vnni):
    layer = PackedLinear(random_int4(32, 64, seed=3), int16_activations=True)
    with pytest.raises(AttributeError):
        layer.int16_activations = False
