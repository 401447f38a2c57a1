"""A GGUF file's quantized tensors as packed weights, bit for bit.

Q4_0 and Q4_1 blocks (a float16 scale ``d``, Q4_1 also a float16 min ``m``,
and 32 four-bit values) are int4 groups of 32 as they stand: scale ``d``,
min ``m`` (Q4_0: ``-8 d``, exact in float16, so ``symmetric``: lanes of no
minimums); Q8_0 blocks (``d`` and 32 int8 values) are int8 groups of 32,
and so are Q5_0's (``d``, 32 five-bit ``q``: int8 ``q - 16`` of scale
``d``, as gguf-py computes them). The K-quants' super-blocks of 256 take
float32 scales: Q4_K (float16 ``d`` and ``dmin``, 6-bit ``sc`` and ``m`` per
sub-block of 32, 4-bit values) is int4 groups of 32 of scale ``d * sc`` and
min ``-dmin * m``; Q5_K (Q4_K's with a fifth bit a value) int8 values 0..31
of the same scales and minimums; Q6_K (int8 ``scale`` per sub-block of 16, float16 ``d``,
6-bit values ``q``) is int8 ``q - 32`` of scale ``d * scale`` per 16
columns; each product exact in float32, so ``Packed.dequantize`` is gguf-py's
float32 dequantization. The K-quants' packed weights also keep their
factors (``SuperBlocks``), which their lanes hold in place of the float32
scales. Every other type is not packed here
(``quantize_model`` serves its float32 dequantization as bfloat16 panels
where it can); ``mstar.models.gguf`` reads the file and maps its tensors,
rows in the Hugging Face model's order, to the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from mstar.cpu.quant.packed import GROUP, Packed, SuperBlocks, pack_int4

# bytes of one block of 32 weights
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}
# bytes of one super-block of 256 weights
SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
PACKED_TYPES = (*BLOCK_BYTES, *SUPER_BLOCK_BYTES)  # the types ``decode_blocks`` takes


@dataclass(frozen=True)
class Deferred:
    """A linear layer's GGUF tensor not read yet: ``read()`` reads and packs
    it (``decode_blocks``), so a load holds one layer's read form at a time
    beside what the packed layers keep, not every layer's at once."""

    shape: tuple[int, int]  # the weight's [N, K]
    type_name: str
    read: Callable[[], Packed]

    @property
    def wide(self) -> bool:
        """Whether its packed scales are float32 (the K-quants')."""
        return self.type_name in SUPER_BLOCK_BYTES


def read_packed(weights: Packed | Deferred) -> Packed:
    """``weights`` packed, read first where deferred."""
    return weights.read() if isinstance(weights, Deferred) else weights


def decode_blocks(type_name: str, data: np.ndarray) -> Packed:
    """The rows of raw blocks ``data`` (uint8 ``[N, blocks * bytes]``) of a
    tensor of one of ``PACKED_TYPES``, packed; ``ValueError`` for another type."""
    if type_name not in PACKED_TYPES:
        raise ValueError(f"expected a GGUF type of {', '.join(PACKED_TYPES)}, got {type_name}")
    rows = data.shape[0]
    size = BLOCK_BYTES.get(type_name) or SUPER_BLOCK_BYTES[type_name]
    # every form below is made anew from ``blocks``: a copy only where ``data`` is read-only
    blocks = torch.from_numpy(np.require(data, requirements=["C", "W"])).view(rows, -1, size)
    if type_name == "Q4_K":
        return _q4_k(blocks)
    if type_name == "Q5_K":
        return _q5_k(blocks)
    if type_name == "Q6_K":
        return _q6_k(blocks)
    scales = _halves(blocks, 0)
    if type_name == "Q8_0":
        qweight = blocks[:, :, 2:].contiguous().view(torch.int8).view(rows, -1)
        return Packed("int8", qweight, scales.contiguous())
    if type_name == "Q5_0":
        return Packed("int8", _q5_0_values(blocks).view(rows, -1), scales.contiguous())
    if type_name == "Q4_1":
        mins = _halves(blocks, 2)
        qs = blocks[:, :, 4:]
    else:
        mins = scales * -8
        qs = blocks[:, :, 2:]
    # every min -8 d in float32, bit for bit (Q4_0's unless -8 d overflows float16)
    symmetric = torch.equal(mins.float().view(torch.int32), (scales.float() * -8).view(torch.int32))
    qweight = qs.reshape(rows, -1).contiguous()
    return Packed("int4", qweight, scales.contiguous(), mins.contiguous(), symmetric=symmetric)


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Each block's float16 at byte ``at``: ``[rows, blocks]``."""
    return blocks[:, :, at : at + 2].contiguous().view(torch.float16).view(blocks.shape[:2])


def _q5_0_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks ``[rows, B, 22]`` (``d``, 4 bytes of high bits, weight
    ``j``'s bit ``j``, 16 nibble bytes: weight ``j`` low, ``j + 16`` high)
    as int8 ``q - 16``, ``[rows, B, 32]``."""
    bits = blocks[:, :, 2:6].contiguous().view(torch.int32)  # [rows, B, 1], little-endian
    shifts = torch.arange(32, dtype=torch.int32)
    high = ((bits >> shifts) & 1).to(torch.uint8)
    nibbles = blocks[:, :, 6:]
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)
    return (low | (high << 4)).view(torch.int8) - 16


def _q4_k(blocks: torch.Tensor) -> Packed:
    """Q4_K super-blocks ``[rows, S, 144]``: ``d``, ``dmin``, 12 bytes of
    six-bit ``sc`` and ``m`` (8 each), and 128 bytes of nibbles, 32 bytes
    a pair of sub-blocks (the first's values low, the second's high)."""
    rows, count = blocks.shape[:2]
    low, high, rest = blocks[:, :, 4:16].view(rows, count, 3, 4).unbind(2)
    sc = torch.cat([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], dim=2)
    m = torch.cat([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], dim=2)
    factors = SuperBlocks(
        _halves(blocks, 0).contiguous(),
        _halves(blocks, 2).contiguous(),
        sc.view(rows, -1),
        m.view(rows, -1),
    )
    pairs = blocks[:, :, 16:].reshape(rows, count, 4, 1, GROUP)
    q = torch.cat([pairs & 0x0F, pairs >> 4], dim=3)  # [rows, S, pair, sub-block, 32]
    return replace(pack_int4(q.view(rows, -1), *factors.scales(), torch.float32), factors=factors)


def _q5_k(blocks: torch.Tensor) -> Packed:
    """Q5_K super-blocks ``[rows, S, 176]``: Q4_K's (``_q4_k``) with 32 bytes
    of high bits after its 12 of ``sc`` and ``m`` (byte ``l``'s bit ``s``:
    weight ``32 s + l``'s), each value ``low | high << 4``: int8 0..31 of
    Q4_K's scales, minimums and factors."""
    rows, count = blocks.shape[:2]
    low = _q4_k(torch.cat([blocks[:, :, :16], blocks[:, :, 48:]], dim=2))
    shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
    high = (blocks[:, :, None, 16:48] >> shifts) & 1  # [rows, S, sub-block, 32]
    q = low.values().view(rows, count, 8, GROUP) | (high << 4)
    return replace(low, kind="int8", qweight=q.view(torch.int8).view(rows, -1))


def _q6_k(blocks: torch.Tensor) -> Packed:
    """Q6_K super-blocks ``[rows, S, 210]``: 128 bytes of low nibbles (byte
    ``64 h + l``: weight ``128 h + l`` low, ``128 h + 64 + l`` high), 64 of
    high bit pairs (byte ``32 h + l``, pair ``s``: weight ``128 h + 32 s +
    l``), 16 int8 scales, ``d``."""
    rows, count = blocks.shape[:2]
    ql = blocks[:, :, :128].reshape(rows, count, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).view(rows, count, 256)
    qh = blocks[:, :, 128:192].reshape(rows, count, 2, 1, 32)
    high = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=3)
    q = (low | (high.view(rows, count, 256) << 4)).view(torch.int8) - 32
    scale = blocks[:, :, 192:208].contiguous().view(torch.int8).view(rows, -1)
    factors = SuperBlocks(_halves(blocks, 208).contiguous(), None, scale, None)
    return Packed("int8", q.view(rows, -1).contiguous(), factors.scales()[0], factors=factors)
