"""Linear layers joined for the fused Llama step (``mstar.models.llama.fused_linear``):
q/k/v and gate/up as one product whose layers' weights become views of the
joined ones (packed, panels, lanes, bf16), and the storage checks that see
a layer's weights replaced."""

from __future__ import annotations

import pytest
import torch

from mstar.cpu.quant.at_load import quantize_int4
from mstar.cpu.quant.kernels import bf16_or_why, kernel_or_why
from mstar.cpu.quant.linear import BF16_ROWS, PackedLinear
from mstar.cpu.quant.packed import bf16_panels, pack_bf16
from mstar.models.llama.fused_linear import RowConcat, StorageCheck, concat_refusal


def test_storage_check_joins_checks_and_sees_new_or_absent_tensors():
    """A ``StorageCheck`` (and one joined of several) holds while its slots
    keep their storage, and fails once one gets new storage or none."""
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    checks = [StorageCheck([(m._parameters, "weight")]) for m in layers]
    joined = StorageCheck.joined(checks)
    assert joined() and all(check() for check in checks)
    with torch.no_grad():
        layers[0].weight.mul_(2)  # in place: the same storage
    assert joined()
    layers[1].weight.data = layers[1].weight.data.clone()
    assert not joined() and not checks[1]() and checks[0]() and checks[2]()
    layers[1].weight = None
    assert not checks[1]() and not StorageCheck.joined(checks[1:])()
    with pytest.raises(ValueError, match="a tensor in every slot"):
        StorageCheck([(layers[1]._parameters, "weight")])


def test_row_concat_shares_the_layers_weights():
    """q/k/v as one packed GEMM: the same outputs as the three layers, whose
    weights are now views of the concatenation (no second copy)."""
    if kernel_or_why() is not None:
        pytest.skip(f"packed kernels: {kernel_or_why()}")
    torch.manual_seed(1)
    layers = [PackedLinear(quantize_int4(torch.randn(n, 64))) for n in (64, 32, 32)]
    x = torch.randn(5, 64)
    alone = torch.cat([m(x) for m in layers], dim=1)
    joined = RowConcat(layers)
    assert torch.allclose(joined(x), alone, atol=1e-5)
    assert torch.allclose(torch.cat([m(x) for m in layers], dim=1), alone, atol=0)
    assert layers[1].qweight.data_ptr() == joined.module.qweight[64:].data_ptr()
    assert joined.current()
    layers[2].scales = layers[2].scales.clone()
    layers[2].qweight = layers[2].qweight.clone()
    assert not joined.current()


def test_row_concat_joins_bfloat16_panels_as_views():
    """Packed layers with bfloat16 panels join theirs too: many rows give
    the layers' own outputs, each layer's panels a view of the joined ones;
    layers with and without panels do not join."""
    if (why := kernel_or_why() or bf16_or_why()) is not None:
        pytest.skip(why)
    torch.manual_seed(2)
    packed = [quantize_int4(torch.randn(n, 64)) for n in (64, 32, 96)]
    layers = [PackedLinear(p, None, bf16_panels(p)) for p in packed]
    x = torch.randn(7, 64)
    alone = torch.cat([m(x) for m in layers], dim=1)
    joined = RowConcat(layers)
    assert torch.equal(joined(x), alone)
    assert layers[2].panels.data_ptr() == joined.module.panels[3:].data_ptr()
    assert torch.equal(layers[2].panels, bf16_panels(packed[2]))
    assert "different formats, arithmetic" in concat_refusal([layers[0], PackedLinear(packed[1])])


def test_row_concat_joins_int4_lanes_as_views():
    """int4 layers with lanes (16 rows an entry) join along them: few rows
    give the layers' own outputs, each layer's lanes a view of the joined
    ones, which are the lanes of the joined weights; layers with and
    without lanes do not join; layers that hold lanes and panels alone (no
    row-major copy) join and are checked by their lanes."""
    if (why := kernel_or_why()) is not None or not torch.ops.mstar_quant.lanes_rows():
        pytest.skip(why or "the kernels' build has no int4 lanes (no AVX512-VNNI)")
    torch.manual_seed(4)
    packed = [quantize_int4(torch.randn(n, 64)) for n in (64, 32, 48)]
    layers = [PackedLinear(p, None, None, True, p.lanes()) for p in packed]
    x = torch.randn(2, 64)
    alone = torch.cat([m(x) for m in layers], dim=1)
    joined = RowConcat(layers)
    assert torch.equal(joined(x), alone)
    assert layers[2].lanes.data_ptr() == joined.module.lanes[6:].data_ptr()
    assert torch.equal(joined.module.lanes, joined.module.packed().lanes())
    plain = PackedLinear(packed[1], None, None, True)
    assert "arithmetic or lanes" in concat_refusal([layers[0], plain])
    if bf16_or_why() is not None:
        return
    # with panels too, the layers hold no row-major copy: they join, and are checked, by their lanes
    alone = [PackedLinear(p, None, bf16_panels(p), True, p.lanes()) for p in packed[:2]]
    assert all(m.qweight is None for m in alone)
    x = torch.randn(3, 64)
    want = torch.cat([m(x) for m in alone], dim=1)
    joined = RowConcat(alone)
    assert joined.module.qweight is None and torch.equal(joined(x), want)
    assert torch.equal(joined.module.packed().qweight, torch.cat([p.qweight for p in packed[:2]]))
    assert alone[1].lanes.data_ptr() == joined.module.lanes[4:].data_ptr() and joined.current()
    alone[1].lanes = alone[1].lanes.clone()
    assert not joined.current()


def test_row_concat_joins_bf16_layers_panels_as_views():
    """bf16 layers (their qweight the panels, 32 rows an entry) join along
    their panels: the layers' own outputs at any row count, each layer's
    panels a view of the joined ones, checked as the packed ones are."""
    if (why := kernel_or_why() or bf16_or_why()) is not None:
        pytest.skip(why)
    torch.manual_seed(3)
    layers = [PackedLinear(pack_bf16(torch.randn(n, 64))) for n in (64, 32, 96)]
    joined = RowConcat(layers)
    for rows in (1, BF16_ROWS):
        x = torch.randn(rows, 64)
        assert torch.equal(joined(x), torch.cat([m(x) for m in layers], dim=1))
    assert layers[2].qweight.data_ptr() == joined.module.qweight[3:].data_ptr()
    assert layers[2].qweight.shape == (3, 32, 32, 2) and joined.current()
    layers[1].qweight = layers[1].qweight.clone()
    assert not joined.current()
