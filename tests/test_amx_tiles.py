"""bfloat16 panels on AMX's tiles (amx_tiles.h), on a CPU that has them:
``AMX_ROWS`` (16) rows or more of ``bf16_linear`` and ``lanes_bf16`` run
there, each row's sums made of its own activations alone (the rows past M
zeros, the last pass's rows copied out), the products of the
bfloat16-rounded activations and weights summed in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks

from mstar.cpu.quant.gguf import decode_blocks
from mstar.cpu.quant.kernels import bf16_or_why, kernel_or_why
from mstar.cpu.quant.packed import bf16_panels

pytest.importorskip("gguf")

ROWS = [16, 17, 31, 32, 33, 47, 64, 100]  # the first on the tiles, passes of 32 and their tails


@pytest.fixture(scope="module", autouse=True)
def _tiles_here():
    if (why := kernel_or_why() or bf16_or_why()) is not None:
        pytest.skip(f"kernels: {why}")
    if not torch.ops.mstar_quant.amx_rows():
        pytest.skip("the kernels' build has no AMX tiles (this CPU lacks AMX-BF16)")


def test_the_tiles_start_at_sixteen_rows():
    assert torch.ops.mstar_quant.amx_rows() == 16


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_panels_on_the_tiles_are_the_bfloat16_products_row_by_row(type_name):
    """``lanes_bf16`` and ``bf16_linear`` on the panels it stands for, at
    row counts on the tiles: equal to each other, near float64's products
    of the rounded values, and each row the same as it is among other rows
    (a tail of a pass against the same row in a whole pass)."""
    ops = torch.ops.mstar_quant
    blocks = random_blocks(type_name, 96, 512, np.random.default_rng(3), std=0.02)
    packed = decode_blocks(type_name, blocks)
    lanes, panels = packed.lanes(), bf16_panels(packed)
    weight = packed.dequantize().bfloat16().double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(max(ROWS), 512, generator=g)
    whole = ops.lanes_bf16(x, lanes)
    for rows in ROWS:
        y = ops.lanes_bf16(x[:rows], lanes)
        assert torch.equal(y, ops.bf16_linear(x[:rows], panels))
        assert torch.equal(y, whole[:rows])  # the same sums, whatever the rows beside
        expected = F.linear(x[:rows].bfloat16().double(), weight)
        torch.testing.assert_close(
            y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
        )
    # a row moved to another place in another count: the same bits
    shuffled = torch.cat([x[40:47], x[:40]])
    assert torch.equal(ops.lanes_bf16(shuffled, lanes)[7:], whole[:40])
