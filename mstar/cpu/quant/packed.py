"""Packed weights: the formats the kernels take (see ``kernels.cpp``).

``int4``: ``qweight`` uint8 ``[N, K/2]`` in GGUF's Q4 block order (in each
group of 32 weights, byte ``j`` holds weight ``j`` in its low nibble and
weight ``j + 16`` in its high one), ``scales`` and ``mins`` float16
``[N, K/32]``: ``w = q * scale + min``; or float32 (GGUF's Q4_K: its
sub-block scales ``d * sc`` and minimums ``-dmin * m``, exact in float32).
``int8``: ``qweight`` int8 ``[N, K]``, ``scales`` float16 ``[N, K/G]``:
``w = q * scale`` (``G = 32`` for GGUF's Q8_0, ``K`` per channel); or
float32 (GGUF's Q6_K: ``G = 16``, ``d * scale`` exact in float32); with
float32 ``mins`` too (GGUF's Q5_K: ``q`` 0..31, Q4_K's scales and minimums
per 32): ``w = q * scale + min``.
bfloat16 panels (``panels``): float weights rounded to bfloat16,
``[N/32, K/2, 32, 2]``: 32 rows a panel, each a run of k pairs, each pair's
32 rows side by side (``panels[p, j, r, i] = w[32p + r, 2j + i]``); held
beside int4/int8 weights for many-row products (``bf16_panels``), or as
the weights themselves: ``bf16``, ``qweight`` the panels, no scales
(``pack_bf16``: a float model's linear layers on CPUs with AVX512-BF16).
lanes (``Packed.lanes``): the same int4 or int8 weights, scales (and
minimums) 16 rows to a vector's lanes, as ``cpp/lanes.h``'s kernels stream
them: with float16 scales int4 uint8 ``[N/16, K/32 * 320]``, int8 int8
``[N/16, K/32 * 544]``; a third axis names the other layouts: int4 whose
every minimum is ``-8 * scale`` (``symmetric``: GGUF's Q4_0) holds no
minimums, uint8 ``[N/16, K/32, 288]`` (0.5625 bytes a weight, not 0.625);
with float32 scales (the K-quants) int4 ``[N/16, K/32, 384]``, int8 (a
scale per 16 columns) ``[N/16, K/32, 640]``; weights holding the K-quants' own factors
(``SuperBlocks``) take them instead of float32 scales, Q4_K (int4) uint8
``[N/16, K/256, 2304]`` (its ``sc`` and ``m`` in 6 bits: 0.5625 bytes a
weight, the file's own, not 0.75), Q6_K (int8) int8 ``[N/16, K/256, 3360]``
(its values in 6 bits: 0.82, the file's own, not 1.25), Q5_K (int8 of
minimums) int8 ``[N/16, K/256, 2816]`` (Q4_K's and a fifth bit a value:
0.6875, the file's own); held beside the packed weights for few rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

GROUP = 32
PANEL = 32  # weight rows per bfloat16 panel
LANES = 16  # weight rows per block of lanes
LANE_BYTES = {"int4": 320, "int8": 544}  # a block's bytes a group of 32 columns (cpp/lanes.h)
LANE_BYTES_F32 = {"int4": 384, "int8": 640}  # the same with float32 scales (and minimums)
LANE_BYTES_SYM = 288  # the same of symmetric int4: float16 scales, no minimums
SUPER = 256  # columns a super-block (GGUF's K-quants)
# a super-block's head in a block of lanes: int4 (Q4_K) the 16 rows' d, dmin (float16), their
# six-bit sc and m (``_six_bit_head``); int8 (Q6_K) their d (float16), 16 x scale (int8)
SUPER_HEAD = {"int4": 256, "int8": 288}
# a block's bytes a super-block: the head, then 8 groups' weights, int4 256 bytes of nibbles
# a group, int8 (Q6_K) 384 of six-bit values (int4 2304, int8 3360)
LANE_BYTES_SUPER = {"int4": 256 + 8 * 256, "int8": 288 + 8 * 384}
# Q5_K's (int8 weights of minimums): Q4_K's head, then per group its 256 bytes of low nibbles
# and 64 of fifth bits (2816)
LANE_BYTES_Q5 = SUPER_HEAD["int4"] + 8 * (256 + 64)


@dataclass(frozen=True)
class SuperBlocks:
    """A GGUF K-quant's own factors of weights ``[N, K]``: ``d`` float16
    ``[N, K/256]`` and ``sc`` per sub-block; Q4_K (int4) and Q5_K (int8 of
    minimums): ``sc`` and ``m`` uint8 ``[N, K/32]``, ``dmin`` float16: group
    ``g``'s scale ``d * sc``,
    minimum ``-(dmin * m)``; Q6_K (int8): ``sc`` int8 ``[N, K/16]``, a scale
    ``d * sc`` per 16 columns, no ``dmin``, ``m``. Each product exact in
    float32 (of its super-block's ``d``, ``dmin``)."""

    d: torch.Tensor
    dmin: torch.Tensor | None
    sc: torch.Tensor
    m: torch.Tensor | None

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float32 scales and minimums (None without ``dmin``), a column of
        each per sub-block."""
        rows, count = self.d.shape
        scales = self.d.float()[..., None] * self.sc.view(rows, count, -1).float()
        if self.dmin is None:
            return scales.view(rows, -1), None
        mins = -(self.dmin.float()[..., None] * self.m.view(rows, count, -1).float())
        return scales.view(rows, -1), mins.view(rows, -1)

    def held(self) -> list[torch.Tensor]:
        """The factors it has, in the lanes' order: ``d`` (``dmin``), ``sc`` (``m``)."""
        return [t for t in (self.d, self.dmin, self.sc, self.m) if t is not None]

    def rows(self, order: torch.Tensor) -> SuperBlocks:
        """The same factors with their rows in ``order``."""
        t = (self.d, self.dmin, self.sc, self.m)
        return SuperBlocks(*(None if f is None else f[order].contiguous() for f in t))


@dataclass(frozen=True)
class Packed:
    """One weight matrix ``[N, K]`` in a packed format (``kind``: int4, int8,
    or bf16: ``qweight`` its panels, ``scales`` None); weights of float32
    scales may also hold the factors they are made of (``factors``: Q4_K's,
    Q5_K's, Q6_K's, which its lanes then hold in their place); ``symmetric``: int4
    of float16 scales whose every minimum is exactly ``-8 * scale`` in
    float32 (GGUF's Q4_0: its lanes hold no minimums), which its maker
    vouches for; ``ValueError`` for other weights."""

    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None = None
    factors: SuperBlocks | None = None
    symmetric: bool = False

    def __post_init__(self) -> None:
        dtype = None if self.scales is None else self.scales.dtype
        if self.symmetric and (self.kind != "int4" or dtype != torch.float16):
            raise ValueError(
                f"expected symmetric weights int4 of float16 scales, got {self.kind} of {dtype}"
            )

    @property
    def wide(self) -> bool:
        """Whether its scales are float32 (GGUF's K-quants), not float16."""
        return self.scales is not None and self.scales.dtype == torch.float32

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind == "bf16":
            return self.qweight.shape[0] * PANEL, self.qweight.shape[1] * 2
        rows, width = self.qweight.shape
        return rows, width * 2 if self.kind == "int4" else width

    def rows(self, order: torch.Tensor) -> Packed:
        """The same weights with their rows in ``order`` (itself where that is
        their order: no copy)."""
        if torch.equal(order, torch.arange(len(order), device=order.device)):
            return self
        mins = None if self.mins is None else self.mins[order].contiguous()
        factors = None if self.factors is None else self.factors.rows(order)
        return Packed(
            self.kind,
            self.qweight[order].contiguous(),
            self.scales[order].contiguous(),
            mins,
            factors,
            self.symmetric,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, each ``q * scale (+ min)`` as GGUF's own
        dequantization computes it (bf16: the panels' values)."""
        if self.kind == "bf16":
            return self.qweight.permute(0, 2, 1, 3).reshape(self.shape).float()
        width = self.shape[1]
        scales = self.scales.float().repeat_interleave(width // self.scales.shape[1], dim=1)
        if self.kind == "int8" and self.mins is None:
            return self.qweight.float() * scales
        mins = self.mins.float().repeat_interleave(GROUP, dim=1)
        return self.values().float() * scales + mins

    def lanes(self) -> torch.Tensor:
        """The weights laid out for ``cpp/lanes.h`` (``lanes_shape``): per
        block of 16 rows and group of 32 columns, int4 (uint8): four 64-byte
        octets (octet ``o``'s 4-byte lane ``r``: row ``r``'s weights
        ``8o..8o+3`` in the low nibbles, ``8o+4..8o+7`` in the high ones),
        the 16 rows' scales, then their minimums (``symmetric``: none, the
        lanes ``[N/16, K/32, 288]``); int8: 16 pairs of
        columns, 32 bytes each (row ``r``'s pair at bytes ``2r, 2r+1``), then
        the rows' scales, one per 32 columns (float16) or, float32, the 16
        rows' scales of columns 0-15, then of columns 16-31. Scales keep
        their dtype. With ``factors``, per block and super-block of 256
        columns: a head of the 16 rows' ``d``, then ``dmin`` (float16), then
        their six-bit ``sc`` and ``m`` (``_six_bit_head``), then the 8
        groups' octets; int8: the rows' ``d``, then per
        16 columns their ``sc`` (int8), then the 8 groups' six-bit values
        (``_six_bit_groups``); int8 of minimums (Q5_K): ``_five_bit_lanes``.
        ``ValueError`` for bf16, rows not a multiple of 16, float32 int8
        scales not a whole number per 16 columns, int8 values of factors
        outside Q6_K's -32..31, int4 factors' ``sc`` or ``m`` above 63, or
        int8 of minimums not Q5_K's."""
        rows, width = self.shape
        if self.kind == "bf16" or rows % LANES:
            raise ValueError(
                f"expected int4 or int8 weights of rows divisible by {LANES} for lanes, got"
                f" {self.kind} of {rows} rows"
            )
        blocks, groups = rows // LANES, width // GROUP
        wide = self.wide
        if self.kind == "int4":
            # [block, row, group, octet, half, j]: weight 8 octet + 4 half + j
            q = self.values().view(blocks, LANES, groups, 4, 2, 4)
            octets = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
            per_group = [octets.reshape(blocks, groups, -1)]
            if self.factors is not None:
                return self._super_lanes(per_group[0])
            scales = [self.scales] if self.symmetric else [self.scales, self.mins]
        elif self.mins is not None:
            return self._five_bit_lanes()
        elif self.factors is not None:  # Q6_K's six-bit values
            return self._super_lanes(_six_bit_groups(self.qweight))
        else:  # [block, row, group, pair, 2] -> [block, group, pair, row, 2]
            pairs = self.qweight.view(blocks, LANES, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
            per_group = [pairs.reshape(blocks, groups, -1).view(torch.uint8)]
            per = 2 * groups if wide else groups  # float32: a scale per 16 columns
            if per % self.scales.shape[1]:
                raise ValueError(
                    f"expected int8 scales a whole number per {GROUP // (per // groups)} columns"
                    f" for lanes, got {self.scales.shape[1]} for {width}"
                )
            scales = [self.scales.repeat_interleave(per // self.scales.shape[1], dim=1)]
        for t in scales:  # [block, row, group(, half)] -> [block, group(, half), row]
            t = t.reshape(blocks, LANES, groups, -1).permute(0, 2, 3, 1).contiguous()
            per_group.append(t.view(blocks, groups, -1).view(torch.uint8))
        held = torch.cat(per_group, dim=2).view(self.qweight.dtype)
        return held if wide or self.symmetric else held.view(blocks, -1)

    def _super_lanes(self, weights: torch.Tensor) -> torch.Tensor:
        """The lanes of ``factors`` (``lanes``) around the groups' ``weights``
        (uint8 ``[N/16, K/32, 256 or 384]``: octets or six-bit values)."""
        blocks, groups = weights.shape[:2]
        count = groups * GROUP // SUPER

        def lanes_of(t: torch.Tensor) -> torch.Tensor:
            # [block, row, super-block(, sub-block)] -> [block, super-block(, sub-block), row]
            t = t.reshape(blocks, LANES, count, -1).permute(0, 2, 3, 1).contiguous()
            return t.view(blocks, count, -1).view(torch.uint8)

        factors = self.factors
        if factors.dmin is None:  # Q6_K: d, then its int8 scales
            head = [lanes_of(factors.d), lanes_of(factors.sc)]
        else:
            head = [lanes_of(factors.d), lanes_of(factors.dmin), *_six_bit_head(factors, lanes_of)]
        lanes = torch.cat([*head, weights.reshape(blocks, count, -1)], dim=2)
        return lanes.view(self.qweight.dtype)

    def _five_bit_lanes(self) -> torch.Tensor:
        """Q5_K's lanes (int8 ``[N/16, K/256, 2816]``): Q4_K's of its values'
        low nibbles (the head, then per group the octets), each group's octets
        followed by its 64 bytes of fifth bits (``_fifth_bits``); ``ValueError``
        without its factors or for values outside 0..31."""
        values = self.qweight
        low, high = _value_range(values)
        if self.factors is None or low < 0 or high > 31:
            raise ValueError(
                "expected Q5_K's factors and values 0..31 for lanes of int8 weights of minimums,"
                f" got factors={self.factors is not None}, values {low}..{high}"
            )
        nibbles = pack_int4(values & 0x0F, self.scales, self.mins, torch.float32)
        held = replace(nibbles, factors=self.factors).lanes()  # [N/16, K/256, 2304]
        blocks, count = held.shape[:2]
        octets = held[..., SUPER_HEAD["int4"] :].reshape(blocks, count, 8, -1)
        bits = _fifth_bits(values).view(blocks, count, 8, -1)
        groups = torch.cat([octets, bits], dim=3).view(blocks, count, -1)
        return torch.cat([held[..., : SUPER_HEAD["int4"]], groups], dim=2).view(torch.int8)

    @classmethod
    def from_lanes(cls, kind: str, lanes: torch.Tensor) -> Packed:
        """The int4 or int8 weights ``lanes`` hold (``Packed.lanes``), packed
        row-major again: the same integers, scales and minimums, of the
        lanes' scale dtype (int8: float16, a scale per 32 columns; float32,
        per 16; symmetric int4: ``symmetric``, its minimums ``-8 * scale``);
        of a K-quant's factors, those and the float32 scales they make."""
        dtype = torch.uint8 if kind == "int4" else torch.int8
        if kind == "int8" and lanes.dim() == 3 and lanes.shape[2] == LANE_BYTES_Q5:
            return cls._from_five_bit_lanes(lanes)
        if (
            lanes.dim() == 3
            and lanes.dtype == dtype
            and lanes.shape[2] == LANE_BYTES_SUPER.get(kind)
        ):
            return cls._from_super_lanes(kind, lanes)
        symmetric = kind == "int4" and lanes.dim() == 3 and lanes.shape[2] == LANE_BYTES_SYM
        wide = lanes.dim() == 3 and not symmetric
        sizes = LANE_BYTES_F32 if wide else LANE_BYTES
        per_group = LANE_BYTES_SYM if symmetric else sizes.get(kind)
        if (
            per_group is None
            or lanes.dtype != dtype
            or lanes.dim() not in (2, 3)
            or (lanes.shape[2] != per_group if wide else lanes.shape[-1] % per_group)
        ):
            raise ValueError(f"expected {kind} lanes, got {lanes.dtype} {list(lanes.shape)}")
        blocks, groups = lanes.shape[0], lanes.numel() // lanes.shape[0] // per_group
        held = lanes.view(torch.uint8).view(blocks, groups, per_group)
        rows = blocks * LANES
        floats = torch.float32 if wide else torch.float16
        size = LANES * floats.itemsize  # a block's bytes of one scale (or minimum) a row

        def scales(at: int, count: int = 1) -> torch.Tensor:  # ``count`` a group, at byte ``at``
            t = held[..., at : at + count * size].contiguous().view(floats)
            return t.view(blocks, groups, count, LANES).permute(0, 3, 1, 2).reshape(rows, -1)

        if kind == "int8":
            return cls("int8", _pairs(held[..., :512]), scales(512, 2 if wide else 1).contiguous())
        q, scale = _nibbles(held[..., :256]), scales(256)
        if symmetric:
            return replace(pack_int4(q, scale, scale * -8), symmetric=True)
        return pack_int4(q, scale, scales(256 + size), floats)

    @classmethod
    def _from_super_lanes(cls, kind: str, lanes: torch.Tensor) -> Packed:
        """``from_lanes`` of lanes of a K-quant's factors ``[N/16, K/256, 2304 or 3360]``."""
        blocks, count = lanes.shape[:2]
        held = lanes.view(torch.uint8)
        rows, per = blocks * LANES, SUPER // GROUP

        def head(at: int, size: int, dtype: torch.dtype) -> torch.Tensor:  # [rows, S * size]
            t = held[..., at : at + size * LANES * dtype.itemsize].contiguous().view(dtype)
            return t.view(blocks, count, size, LANES).permute(0, 3, 1, 2).reshape(rows, -1)

        d = head(0, 1, torch.float16).contiguous()
        weights = held[..., SUPER_HEAD[kind] :].reshape(blocks, count * per, -1)
        if kind == "int8":
            factors = SuperBlocks(d, None, head(2 * LANES, 2 * per, torch.int8).contiguous(), None)
            packed = cls("int8", _six_bit_values(weights), factors.scales()[0])
        else:
            dmin = head(2 * LANES, 1, torch.float16).contiguous()
            low = head(4 * LANES, per, torch.uint8)  # [rows, S * 8]
            top = head(4 * LANES + per * LANES, 1, torch.int32).view(rows, count, 1)
            top = ((top >> _six_bit_shifts(held.device)) & 0x0F).to(torch.uint8).view(rows, -1)
            sc = ((low & 0x0F) | ((top & 0x03) << 4)).contiguous()
            m = ((low >> 4) | ((top >> 2) << 4)).contiguous()
            factors = SuperBlocks(d, dmin, sc, m)
            packed = pack_int4(_nibbles(weights), *factors.scales(), torch.float32)
        return replace(packed, factors=factors)

    @classmethod
    def _from_five_bit_lanes(cls, lanes: torch.Tensor) -> Packed:
        """``from_lanes`` of Q5_K's lanes ``[N/16, K/256, 2816]``: Q4_K's of its
        low nibbles, each value's fifth bit added."""
        blocks, count = lanes.shape[:2]
        held = lanes.view(torch.uint8)
        head = SUPER_HEAD["int4"]
        groups = held[..., head:].reshape(blocks, count, 8, -1)
        nibbles = torch.cat([held[..., :head], groups[..., :256].reshape(blocks, count, -1)], dim=2)
        low = cls._from_super_lanes("int4", nibbles)
        high = _fifth_bit_values(groups[..., 256:].reshape(blocks, count * 8, -1))
        q = (low.values() | (high << 4)).view(torch.int8)
        return replace(low, kind="int8", qweight=q)

    def values(self) -> torch.Tensor:
        """The integers ``q``, ``[N, K]`` (int4: uint8 0..15; int8: int8)."""
        if self.kind == "bf16":
            raise ValueError("expected integer weights (int4 or int8), got bfloat16 panels")
        if self.kind == "int8":
            return self.qweight
        rows, width = self.shape
        groups = self.qweight.view(rows, -1, GROUP // 2)
        return torch.cat([groups & 0x0F, groups >> 4], dim=2).view(rows, width)


def _nibbles(octets: torch.Tensor) -> torch.Tensor:
    """The integers ``[N, K]`` of int4 lanes' octets (uint8 ``[N/16, K/32, 256]``)."""
    blocks, groups = octets.shape[:2]
    octets = octets.reshape(blocks, groups, 4, LANES, 4)  # [block, group, o, r, j]
    halves = torch.stack((octets & 0x0F, octets >> 4), dim=4)  # [.., r, half, j]: 8o + 4h + j
    return halves.permute(0, 3, 1, 2, 4, 5).reshape(blocks * LANES, -1)


def _pairs(pairs: torch.Tensor) -> torch.Tensor:
    """The integers ``[N, K]`` (int8) of int8 lanes' pairs (uint8 ``[N/16, K/32, 512]``)."""
    blocks, groups = pairs.shape[:2]
    pairs = pairs.reshape(blocks, groups, GROUP // 2, LANES, 2)  # [block, group, p, r, i]
    return pairs.permute(0, 3, 1, 2, 4).reshape(blocks * LANES, -1).view(torch.int8).contiguous()


def _value_range(values: torch.Tensor) -> tuple[int, int]:
    """The least and greatest of ``values`` (``(0, 0)`` for none)."""
    return tuple(int(v) for v in values.aminmax()) if values.numel() else (0, 0)


def _fifth_bit_shifts(device: torch.device) -> torch.Tensor:
    """The bit of a Q5_K lanes' byte of fifth bits holding octet ``o``'s half
    ``h``: ``o + 4 h``, ``[4, 2, 1]`` (uint8)."""
    o, h = torch.arange(4, device=device).view(4, 1, 1), torch.arange(2, device=device).view(2, 1)
    return (o + 4 * h).to(torch.uint8)


def _fifth_bits(values: torch.Tensor) -> torch.Tensor:
    """Q5_K's values' fifth bits ``[N, K]`` (0..31) as its lanes' (uint8
    ``[N/16, K/32, 64]``, ``cpp/lanes.h``): byte ``4r + j`` of a group holds
    row ``r``'s bit 4 of column ``8o + j`` at bit ``o``, of column ``8o + 4 +
    j`` at bit ``4 + o`` (``o`` < 4: the octet whose nibbles they join)."""
    rows, width = values.shape
    high = (values.view(torch.uint8) >> 4).view(rows // LANES, LANES, width // GROUP, 4, 2, 4)
    # [block, row, group, j]: its 8 bits
    bits = (high << _fifth_bit_shifts(values.device)).sum(dim=(3, 4), dtype=torch.uint8)
    return bits.permute(0, 2, 1, 3).reshape(rows // LANES, width // GROUP, -1)


def _fifth_bit_values(bits: torch.Tensor) -> torch.Tensor:
    """The fifth bits ``[N, K]`` (uint8 0 or 1) of Q5_K lanes' ``bits`` (uint8
    ``[N/16, K/32, 64]``, ``_fifth_bits``)."""
    blocks, groups = bits.shape[:2]
    held = bits.reshape(blocks, groups, LANES, 1, 1, 4)
    # [block, group, row, o, h, j]: column 8o + 4h + j
    high = (held >> _fifth_bit_shifts(bits.device)) & 1
    return high.permute(0, 2, 1, 3, 4, 5).reshape(blocks * LANES, -1)


def _six_bit_head(
    factors: SuperBlocks, lanes_of: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """Q4_K's (Q5_K's) six-bit ``sc`` and ``m`` as its lanes' head holds them
    after ``d`` and ``dmin`` (``cpp/lanes.h``), through ``lanes_of`` (a
    factor ``[N, S(, 8)]`` to the head's uint8 ``[N/16, S, 16 per row]``):
    per group ``j`` of 8 a byte a row, ``sc``'s low 4 bits and ``m``'s above
    them; then an int32 a row, group ``j``'s ``sc`` top 2 bits at bit ``4j``
    and ``m``'s at ``4j + 2``. ``ValueError`` for a factor above 63."""
    sc, m = factors.sc, factors.m
    high = max(_value_range(sc)[1], _value_range(m)[1])
    if high > 63:
        raise ValueError(f"expected Q4_K's six-bit sc and m (0..63) for its lanes, got {high}")
    rows, per = sc.shape[0], SUPER // GROUP
    low = (sc & 0x0F) | ((m & 0x0F) << 4)
    tops = ((sc >> 4) | ((m >> 4) << 2)).view(rows, -1, per).to(torch.int32)
    top = (tops << _six_bit_shifts(sc.device)).sum(dim=2, dtype=torch.int32)  # disjoint: their OR
    return [lanes_of(low), lanes_of(top)]


def _six_bit_shifts(device: torch.device) -> torch.Tensor:
    """The bit of a Q4_K lanes' int32 of top bits holding group ``j``'s
    (``_six_bit_head``): ``4j``, ``[8]`` (int32)."""
    return torch.arange(0, 4 * (SUPER // GROUP), 4, dtype=torch.int32, device=device)


def _six_bit_groups(values: torch.Tensor) -> torch.Tensor:
    """Q6_K's values ``[N, K]`` (int8, -32..31) as its lanes' groups (uint8
    ``[N/16, K/32, 384]``, ``cpp/lanes.h``): per half of 16 columns three
    64-byte vectors, vector ``i``'s byte ``4r + j`` holding row ``r``'s
    ``q = value + 32`` (0..63) of the half's column ``4i + j`` in its low 6
    bits and bits ``2i, 2i+1`` of that of column ``12 + j`` in its top 2;
    ``ValueError`` for values outside -32..31."""
    rows, width = values.shape
    low, high = _value_range(values)
    if low < -32 or high > 31:
        raise ValueError(f"expected Q6_K values -32..31 for its lanes, got {low}..{high}")
    q = (values + 32).view(torch.uint8).view(rows // LANES, LANES, width // GROUP, 2, 4, 4)
    q = q.permute(0, 2, 3, 4, 1, 5)  # [block, group, half, i, row, j]: column 16 half + 4i + j
    shifts = torch.tensor([0, 2, 4], dtype=torch.uint8).view(3, 1, 1)
    held = q[:, :, :, :3] | (((q[:, :, :, 3:] >> shifts) & 3) << 6)
    return held.reshape(rows // LANES, width // GROUP, -1)


def _six_bit_values(groups: torch.Tensor) -> torch.Tensor:
    """The values ``[N, K]`` (int8) of Q6_K lanes' groups (uint8 ``[N/16,
    K/32, 384]``, ``_six_bit_groups``)."""
    blocks, count = groups.shape[:2]
    held = groups.reshape(blocks, count, 2, 3, LANES, 4)  # [block, group, half, i, row, j]
    top = sum((held[:, :, :, i] >> 6) << 2 * i for i in range(3))
    q = torch.cat([held & 0x3F, top[:, :, :, None]], dim=3)
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(blocks * LANES, -1)
    return q.view(torch.int8) - 32


def lanes_shape(packed: Packed) -> tuple[int, ...]:
    """The shape of ``packed.lanes()``: with float16 scales ``[N/16, K/32 *
    320]`` for int4, ``[N/16, K/32 * 544]`` for int8; symmetric int4 ``[N/16,
    K/32, 288]``; with float32 scales ``[N/16, K/32, 384]`` and ``[N/16,
    K/32, 640]``; with the K-quants' factors ``[N/16, K/256, 2304]`` (int4),
    ``[N/16, K/256, 3360]`` (int8) and ``[N/16, K/256, 2816]`` (int8 of
    minimums: Q5_K)."""
    rows, width = packed.shape
    if packed.symmetric:
        return rows // LANES, width // GROUP, LANE_BYTES_SYM
    if packed.factors is not None:
        five = packed.kind == "int8" and packed.mins is not None  # Q5_K
        size = LANE_BYTES_Q5 if five else LANE_BYTES_SUPER[packed.kind]
        return rows // LANES, width // SUPER, size
    if packed.wide:
        return rows // LANES, width // GROUP, LANE_BYTES_F32[packed.kind]
    return rows // LANES, width // GROUP * LANE_BYTES[packed.kind]


def pack_int4(
    q: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    dtype: torch.dtype = torch.float16,
) -> Packed:
    """``q`` (integers 0..15, ``[N, K]``) with a scale and a min per group of
    32, packed; the scales and minimums as ``dtype`` (float16 or float32)."""
    rows, width = q.shape
    groups = q.to(torch.uint8).view(rows, -1, 2, GROUP // 2)
    qweight = (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(rows, width // 2)
    return Packed(
        "int4", qweight.contiguous(), scales.to(dtype).contiguous(), mins.to(dtype).contiguous()
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
