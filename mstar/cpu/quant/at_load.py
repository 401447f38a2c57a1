"""Float weights quantized at load, with torch's own quantization
primitives (``torch.ao`` observers for the parameters,
``quantized_decomposed.quantize_per_channel`` for the values):

- ``int8``: per output channel, symmetric (``w = q * scale``, q in -128..127);
- ``int4``: groups of 32 along the input, affine (``w = q * scale + min``,
  q in 0..15, ``min = -zero_point * scale``).

Scales (and mins) are rounded to float16, the kernels' format, before the
values are quantized against them.
"""

from __future__ import annotations

import torch
import torch.ao.quantization.fx._decomposed  # registers quantized_decomposed
from torch.ao.quantization.observer import PerChannelMinMaxObserver

from mstar.cpu.quant.packed import GROUP, Packed, pack_int4


def quantize_int8(weight: torch.Tensor) -> Packed:
    """``weight [N, K]`` as int8 with a scale per row."""
    w = weight.detach().float()
    observer = PerChannelMinMaxObserver(
        ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric
    )
    observer(w)
    scale, zero = observer.calculate_qparams()
    scale = scale.half()
    q = torch.ops.quantized_decomposed.quantize_per_channel(
        w, scale.float(), zero, 0, -128, 127, torch.int8
    )
    return Packed("int8", q.contiguous(), scale[:, None].contiguous())


def quantize_int4(weight: torch.Tensor) -> Packed:
    """``weight [N, K]`` (``K % 32 == 0``) as int4 groups of 32 with a scale and a min each."""
    rows, width = weight.shape
    groups = weight.detach().float().reshape(-1, GROUP)
    observer = PerChannelMinMaxObserver(
        ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine, quant_min=0, quant_max=15
    )
    observer(groups)
    scale, zero = observer.calculate_qparams()
    scale = scale.half()
    q = torch.ops.quantized_decomposed.quantize_per_channel(
        groups, scale.float(), zero, 0, 0, 15, torch.uint8
    )
    mins = (-zero * scale.float()).view(rows, -1)
    return pack_int4(q.view(rows, width), scale.view(rows, -1), mins)
