"""Packed weights: the formats the kernels take (see ``kernels.cpp``).

``int4``: ``qweight`` uint8 ``[N, K/2]`` in GGUF's Q4 block order (in each
group of 32 weights, byte ``j`` holds weight ``j`` in its low nibble and
weight ``j + 16`` in its high one), ``scales`` and ``mins`` float16
``[N, K/32]``: ``w = q * scale + min``.
``int8``: ``qweight`` int8 ``[N, K]``, ``scales`` float16 ``[N, K/G]``:
``w = q * scale`` (``G = 32`` for GGUF's Q8_0, ``K`` per channel).
bfloat16 panels (``panels``): float weights rounded to bfloat16,
``[N/32, K/2, 32, 2]``: 32 rows a panel, each a run of k pairs, each pair's
32 rows side by side (``panels[p, j, r, i] = w[32p + r, 2j + i]``); held
beside int4/int8 weights for many-row products (``bf16_panels``), or as
the weights themselves: ``bf16``, ``qweight`` the panels, no scales
(``pack_bf16``: a float model's linear layers on CPUs with AVX512-BF16).
lanes (``Packed.lanes``): the same int4 or int8 weights, scales (and
minimums) 16 rows to a vector's lanes, as ``cpp/lanes.h``'s kernels stream
them (int4: uint8 ``[N/16, K/32 * 320]``; int8: int8 ``[N/16, K/32 * 544]``);
held beside the packed weights for few rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
PANEL = 32  # weight rows per bfloat16 panel
LANES = 16  # weight rows per block of lanes
LANE_BYTES = {"int4": 320, "int8": 544}  # a block's bytes a group of 32 columns (cpp/lanes.h)


@dataclass(frozen=True)
class Packed:
    """One weight matrix ``[N, K]`` in a packed format (``kind``: int4, int8,
    or bf16: ``qweight`` its panels, ``scales`` None)."""

    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind == "bf16":
            return self.qweight.shape[0] * PANEL, self.qweight.shape[1] * 2
        rows, width = self.qweight.shape
        return rows, width * 2 if self.kind == "int4" else width

    def rows(self, order: torch.Tensor) -> Packed:
        """The same weights with their rows in ``order``."""
        mins = None if self.mins is None else self.mins[order].contiguous()
        return Packed(
            self.kind, self.qweight[order].contiguous(), self.scales[order].contiguous(), mins
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, each ``q * scale (+ min)`` as GGUF's own
        dequantization computes it (bf16: the panels' values)."""
        if self.kind == "bf16":
            return self.qweight.permute(0, 2, 1, 3).reshape(self.shape).float()
        width = self.shape[1]
        scales = self.scales.float().repeat_interleave(width // self.scales.shape[1], dim=1)
        if self.kind == "int8":
            return self.qweight.float() * scales
        mins = self.mins.float().repeat_interleave(GROUP, dim=1)
        return self.values().float() * scales + mins

    def lanes(self) -> torch.Tensor:
        """The weights laid out for ``cpp/lanes.h`` (``lanes_shape``): per
        block of 16 rows and group of 32 columns, int4 (uint8): four 64-byte
        octets (octet ``o``'s 4-byte lane ``r``: row ``r``'s weights
        ``8o..8o+3`` in the low nibbles, ``8o+4..8o+7`` in the high ones),
        the 16 rows' float16 scales, then their minimums; int8: 16 pairs of
        columns, 32 bytes each (row ``r``'s pair at bytes ``2r, 2r+1``), then
        the rows' float16 scales, one per 32 columns. ``ValueError`` for bf16
        or rows not a multiple of 16."""
        rows, width = self.shape
        if self.kind == "bf16" or rows % LANES:
            raise ValueError(
                f"expected int4 or int8 weights of rows divisible by {LANES} for lanes, got"
                f" {self.kind} of {rows} rows"
            )
        blocks, groups = rows // LANES, width // GROUP
        if self.kind == "int4":
            # [block, row, group, octet, half, j]: weight 8 octet + 4 half + j
            q = self.values().view(blocks, LANES, groups, 4, 2, 4)
            octets = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
            per_group = [octets.reshape(blocks, groups, -1)]
            scales = [self.scales, self.mins]
        else:  # [block, row, group, pair, 2] -> [block, group, pair, row, 2]
            pairs = self.qweight.view(blocks, LANES, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
            per_group = [pairs.reshape(blocks, groups, -1).view(torch.uint8)]
            scales = [self.scales.repeat_interleave(groups // self.scales.shape[1], dim=1)]
        for t in scales:
            per_group.append(
                t.view(blocks, LANES, groups).transpose(1, 2).contiguous().view(torch.uint8)
            )
        return torch.cat(per_group, dim=2).view(blocks, -1).view(self.qweight.dtype)

    @classmethod
    def from_lanes(cls, kind: str, lanes: torch.Tensor) -> Packed:
        """The int4 or int8 weights ``lanes`` hold (``Packed.lanes``), packed
        row-major again: the same integers, scales and minimums (int8: a
        scale per 32 columns)."""
        dtype = torch.uint8 if kind == "int4" else torch.int8
        if (
            kind not in LANE_BYTES
            or lanes.dtype != dtype
            or lanes.dim() != 2
            or lanes.shape[1] % LANE_BYTES[kind]
        ):
            raise ValueError(f"expected {kind} lanes, got {lanes.dtype} {list(lanes.shape)}")
        per_group = LANE_BYTES[kind]
        blocks, groups = lanes.shape[0], lanes.shape[1] // per_group
        held = lanes.view(torch.uint8).view(blocks, groups, per_group)
        rows = blocks * LANES

        def per_row(t: torch.Tensor) -> torch.Tensor:  # [block, group, 16 x] -> [N, groups, x]
            return (
                t.reshape(blocks, groups, LANES, -1).permute(0, 2, 1, 3).reshape(rows, groups, -1)
            )

        def floats(at: int) -> torch.Tensor:  # the rows' float16 at byte ``at`` of each group
            return per_row(held[..., at : at + 2 * LANES].contiguous().view(torch.float16))[..., 0]

        if kind == "int8":
            pairs = held[..., :512].reshape(blocks, groups, GROUP // 2, LANES, 2)  # [.., p, r, i]
            q = per_row(pairs.transpose(2, 3).reshape(blocks, groups, -1)).view(torch.int8)
            return cls("int8", q.reshape(rows, -1).contiguous(), floats(512).contiguous())
        octets = held[..., :256].reshape(blocks, groups, 4, LANES, 4)  # [block, group, o, r, j]
        halves = torch.stack(
            (octets & 0x0F, octets >> 4), dim=4
        )  # [..., r, half, j]: 8o + 4 half + j
        q = per_row(halves.permute(0, 1, 3, 2, 4, 5).reshape(blocks, groups, LANES * GROUP))
        return pack_int4(q.reshape(rows, -1), floats(256), floats(288))

    def values(self) -> torch.Tensor:
        """The integers ``q``, ``[N, K]`` (int4: uint8 0..15; int8: int8)."""
        if self.kind == "bf16":
            raise ValueError("expected integer weights (int4 or int8), got bfloat16 panels")
        if self.kind == "int8":
            return self.qweight
        rows, width = self.shape
        groups = self.qweight.view(rows, -1, GROUP // 2)
        return torch.cat([groups & 0x0F, groups >> 4], dim=2).view(rows, width)


def lanes_shape(packed: Packed) -> tuple[int, int]:
    """The shape of ``packed.lanes()``: ``[N/16, K/32 * 320]`` for int4,
    ``[N/16, K/32 * 544]`` for int8."""
    rows, width = packed.shape
    return rows // LANES, width // GROUP * LANE_BYTES[packed.kind]


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Packed:
    """``q`` (integers 0..15, ``[N, K]``) with a scale and a min per group of 32, packed."""
    rows, width = q.shape
    groups = q.to(torch.uint8).view(rows, -1, 2, GROUP // 2)
    qweight = (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(rows, width // 2)
    return Packed(
        "int4", qweight.contiguous(), scales.half().contiguous(), mins.half().contiguous()
    )


def panels(weight: torch.Tensor) -> torch.Tensor:
    """Float weights ``[N, K]`` rounded to bfloat16 (to nearest, ties to
    even) and laid out as panels (see the module); ``ValueError`` unless
    ``N`` is a multiple of ``PANEL``."""
    rows, width = weight.shape
    if rows % PANEL:
        raise ValueError(f"expected rows divisible by {PANEL} for bfloat16 panels, got {rows}")
    weights = weight.detach().bfloat16().view(rows // PANEL, PANEL, width // 2, 2)
    return weights.permute(0, 2, 1, 3).contiguous()


def bf16_panels(packed: Packed) -> torch.Tensor:
    """``packed``'s weights dequantized, as panels (``panels``)."""
    return panels(packed.dequantize())


def pack_bf16(weight: torch.Tensor) -> Packed:
    """Float weights ``[N, K]`` as bfloat16 panels (``panels``), packed."""
    return Packed("bf16", panels(weight), None)
