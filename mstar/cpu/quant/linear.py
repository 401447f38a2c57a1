"""``PackedLinear``: a linear layer on packed weights (``packed.Packed``),
float32 activations in and out, through the kernels of ``kernels.cpp``
(bf16: every row count on the panels, rounded to bfloat16);
with bfloat16 panels of the same weights (``packed.bf16_panels``), inputs
of ``BF16_ROWS`` rows or more multiply in bfloat16 instead; with
``int16_activations``, up to ``int16_rows(bits)`` rows (the kernels'
``torch.ops.mstar_quant.int16_rows``: int4 8 with AVX512-VNNI, 4 on AVX2;
int8 1) are rounded to int16 per group of 32 and multiplied in integers;
weights also held as ``lanes`` (``Packed.lanes``, where the kernels'
``lanes_rows()``: 1-8 with AVX512-VNNI, int8 too) multiply those rows there;
with ``lane_panels``, inputs of ``BF16_ROWS`` rows or more multiply in
bfloat16 on panels dequantized from the lanes as the product reaches them
(``lanes_bf16``: the products of held panels bit for bit, none held), or,
on lanes of int4, Q5_K or Q6_K, inputs of ``int8_rows`` (2) rows or more on
activations rounded to int8 per group of 32 (``lanes_i8``), up to ``amx_rows``
(``AMX_PANEL_ROWS`` where the CPU has AMX's tiles: from there the panels from the
lanes, on the tiles)."""

from __future__ import annotations

import torch

from mstar.cpu.quant.packed import LANES, PANEL, Packed, lanes_shape

# fewest input rows for the bfloat16 panels; fewer stream the packed weights, faster up to
# 8 rows on AVX512-BF16 (1536x576 from memory: 48 against 67 us at 8 rows, 36 against 54 at 5)
BF16_ROWS = 9
# with AMX's tiles (the kernels' ``amx_rows()``), fewest input rows on panels from the lanes
# in place of int8 activations: a 1B Q4_K_M's gate/up, down and q at 32 rows 1.2-1.3x int8's
# speed, 1.6-1.8x at 64, 2-2.7x at 512; 0.5-1.0x at 16-24 (Xeon with AMX, 2 threads)
AMX_PANEL_ROWS = 32


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` held packed; the same result as
    ``F.linear`` on ``packed.dequantize()`` up to the order of the sums,
    or, with ``panels`` (``bf16_panels(packed)``) at ``BF16_ROWS`` rows or
    more, as on ``x`` and ``W`` rounded to bfloat16 (sums in float32), and
    with ``int16_activations`` up to ``int16_rows(bits)`` rows, as on ``x``
    rounded to int16 per group of 32 (``scale = max |x| / 32767``; int4's
    minimums times the float32 sums of ``x``): ~1e-4 of the float32 result
    on SmolLM2, ~20x closer than the bfloat16 panels; with ``lanes``
    (``packed.lanes()``, with int16 activations) those rows multiply
    on them, the same integers in another order of float32 sums; with
    lanes and panels, which then take every row count, it holds no
    row-major copy (``qweight``, ``scales``, ``mins`` None); ``lane_panels``
    (with lanes, rows a multiple of 32, no ``panels``) is held panels'
    arithmetic without holding them, or, on lanes ``lanes_i8`` takes, at
    ``int8_rows`` rows or more as on ``x`` rounded to int8 per group of 32
    (``scale = max |x| / 127``; minimums times the rounded activations'
    sums: the weights times the rounded activations).
    bf16 weights (the panels themselves) take every row count as the
    panels do."""

    def __init__(
        self,
        packed: Packed,
        bias: torch.Tensor | None = None,
        panels: torch.Tensor | None = None,
        int16_activations: bool = False,
        lanes: torch.Tensor | None = None,
        lane_panels: bool = False,
        int8_rows: bool = True,
    ) -> None:
        super().__init__()
        if packed.kind == "bf16" and (panels is not None or int16_activations):
            raise ValueError(
                "expected bf16 weights (the panels themselves) without panels or int16"
                f" activations, got panels={panels is not None}, int16={int16_activations}"
            )
        if lanes is not None and (packed.kind == "bf16" or not int16_activations):
            raise ValueError(
                f"expected lanes only for int4/int8 weights with int16 activations, got {packed.kind}"
                f" weights, int16={int16_activations}"
            )
        if lane_panels and (lanes is None or panels is not None or packed.shape[0] % PANEL):
            raise ValueError(
                f"expected lane panels only with lanes, no held panels and rows divisible by {PANEL},"
                f" got lanes={lanes is not None}, panels={panels is not None}, {packed.shape[0]} rows"
            )
        self.kind = packed.kind
        self.symmetric = packed.symmetric  # for ``packed()``
        self.lane_panels = lane_panels
        self._int16 = int16_activations
        self.out_features, self.in_features = packed.shape
        want = (self.out_features // PANEL, self.in_features // 2, PANEL, 2)
        if panels is not None and (panels.dtype != torch.bfloat16 or tuple(panels.shape) != want):
            raise ValueError(
                f"expected bfloat16 panels of shape {list(want)} for weights {list(packed.shape)},"
                f" got {str(panels.dtype).removeprefix('torch.')} {list(panels.shape)}"
            )
        self.register_buffer("panels", panels)
        if lanes is not None:
            want = lanes_shape(packed)
            if lanes.dtype != packed.qweight.dtype or tuple(lanes.shape) != want:
                raise ValueError(
                    f"expected {str(packed.qweight.dtype).removeprefix('torch.')} lanes of shape {list(want)} for weights {list(packed.shape)},"
                    f" got {str(lanes.dtype).removeprefix('torch.')} {list(lanes.shape)}"
                )
        self.register_buffer("lanes", lanes)
        self._lane_rows = 0 if lanes is None else torch.ops.mstar_quant.lanes_rows()
        # lanes that take every row count (no panels held) of int4, Q5_K or Q6_K: 2+ rows on
        # activations rounded to int8 (``lanes_i8``), as llama.cpp multiplies its blocks
        takes = int8_rows and lane_panels and torch.ops.mstar_quant.lanes_i8_takes(lanes)
        self._int8_from = torch.ops.mstar_quant.int8_lane_rows() if takes else 0
        # on AMX's tiles, panels from the lanes outrun int8 activations from AMX_PANEL_ROWS rows
        amx = lane_panels and self._int8_from and torch.ops.mstar_quant.amx_rows()
        self._amx_from = AMX_PANEL_ROWS if amx else 0
        # the row-major bytes, where a row count reads them: not where the lanes take every
        # count below the panels' (``packed()`` then rebuilds them from the lanes)
        many = panels is not None or lane_panels
        row_major = not many or self._lane_rows + 1 < BF16_ROWS
        for name in ("qweight", "scales", "mins"):
            self.register_buffer(name, getattr(packed, name) if row_major else None)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def on_lanes(
        cls,
        kind: str,
        lanes: torch.Tensor,
        bias: torch.Tensor | None = None,
        panels: torch.Tensor | None = None,
        lane_panels: bool = False,
        int8_rows: bool = True,
    ) -> PackedLinear:
        """A layer holding ``lanes`` (and ``panels`` or ``lane_panels``, so
        every row count reads them) and no row-major copy: its shape and
        dtypes are read from a meta stand-in, the weights never rebuilt."""
        packed = Packed.from_lanes(kind, lanes.to("meta"))
        return cls(packed, bias, panels, True, lanes, lane_panels, int8_rows)

    @property
    def int16_rows(self) -> int:
        """Most input rows rounded to int16 (0: none): the lanes' rows where
        it holds lanes, else the kernels' ``int16_rows(bits)``."""
        if not self._int16:
            return 0
        if self._lane_rows:
            return self._lane_rows
        return torch.ops.mstar_quant.int16_rows(4 if self.kind == "int4" else 8)

    @property
    def int16_activations(self) -> bool:
        """Whether up to ``int16_rows(bits)`` rows are rounded to int16 (fixed
        at construction: a one-call layer stack reads it once)."""
        return self._int16

    @property
    def int8_rows(self) -> int:
        """Fewest input rows rounded to int8 per group of 32 (``lanes_i8``;
        0: none): with ``lane_panels``, on lanes of int4, Q5_K or Q6_K,
        unless built with ``int8_rows=False`` or ``drop_int8_rows()``."""
        return self._int8_from

    @property
    def amx_rows(self) -> int:
        """Fewest input rows that multiply on bfloat16 panels from the lanes
        (AMX's tiles) in place of int8 activations (0: none)."""
        return self._amx_from if self._int8_from else 0

    def drop_int8_rows(self) -> bool:
        """Multiply 2+ rows as without int8 rows from now on (the int16
        lanes, then bfloat16 panels from the lanes); whether it had them. A
        fused step built before keeps its own joined layers' rows."""
        had, self._int8_from = bool(self._int8_from), 0
        return had

    @property
    def arithmetic(self) -> str:
        """``float32`` (exact against the dequantized weights), else what
        rounds: ``bfloat16`` (many rows on the panels), ``int16`` (few rows'
        activations), ``int8`` (2+ rows' activations, ``int8_rows``), joined
        by ``+``."""
        held = self.panels is not None or self.lane_panels or self.kind == "bf16"
        panels = bool(self.amx_rows) or (held and not self._int8_from)
        rounded = ["bfloat16"] * panels + ["int16"] * self.int16_activations
        return "+".join(rounded + ["int8"] * bool(self._int8_from)) or "float32"

    def _int8(self, rows: int) -> bool:
        """Whether ``rows`` input rows multiply on the lanes rounded to int8."""
        return 0 < self._int8_from <= rows and not 0 < self.amx_rows <= rows

    def _panelled(self, rows: int) -> bool:
        """Whether ``rows`` input rows multiply on bfloat16 panels (held or from the lanes)."""
        return (self.lane_panels or self._buffers["panels"] is not None) and rows >= BF16_ROWS

    def _laned(self, rows: int) -> bool:
        """Whether ``rows`` input rows multiply on the lanes."""
        return rows <= self._lane_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ~150 calls a decode step: the buffers read from ``_buffers`` and the ops called
        # by their overload, not through ``nn.Module.__getattr__`` and overload
        # resolution (~2 us a call between them)
        b, ops = self._buffers, torch.ops.mstar_quant
        rows = x.numel() // self.in_features
        if self.kind == "bf16":
            y = ops.bf16_linear.default(x, b["qweight"])
        elif self._int8(rows):
            y = ops.lanes_i8.default(x, b["lanes"])
        elif self._panelled(rows):
            panels = b["panels"]
            y = (
                ops.bf16_linear.default(x, panels)
                if panels is not None
                else ops.lanes_bf16.default(x, b["lanes"])
            )
        elif self._laned(rows):
            y = ops.lanes_i16.default(x, b["lanes"])
        elif self.kind == "int4":
            op = ops.int4_linear_i16 if self._int16 else ops.int4_linear
            y = op.default(x, b["qweight"], b["scales"], b["mins"])
        else:
            op = ops.int8_linear_i16 if self._int16 else ops.int8_linear
            y = op.default(x, b["qweight"], b["scales"])
        return y if self.bias is None else y + self.bias

    def read_tensors(self, rows: int) -> list[torch.Tensor]:
        """The tensors a call on ``rows`` input rows reads (the panels, the
        lanes, or the row-major weights; the bias)."""
        if self._int8(rows):
            tensors = [self.lanes]
        elif self._panelled(rows):
            tensors = [self.lanes if self.panels is None else self.panels]
        elif self._laned(rows):
            tensors = [self.lanes]
        else:
            tensors = [t for t in (self.qweight, self.scales, self.mins) if t is not None]
        return tensors + ([] if self.bias is None else [self.bias])

    def packed(self) -> Packed:
        """The weights row-major (rebuilt from the lanes where it holds only them)."""
        if self.qweight is None:
            return Packed.from_lanes(self.kind, self.lanes)
        return Packed(self.kind, self.qweight, self.scales, self.mins, symmetric=self.symmetric)

    def weight_rows(self, start: int, stop: int) -> torch.Tensor:
        """The float32 weights of output rows ``[start, stop)``, dequantized
        (bf16: the panels' values); both multiples of ``PANEL`` (or ``stop``
        the layer's rows): a reference reads a big layer a slice at a time."""
        if start % PANEL or (stop % PANEL and stop != self.out_features) or not start < stop:
            raise ValueError(
                f"expected rows [start, stop) on multiples of {PANEL}, got [{start}, {stop})"
            )
        b = self._buffers
        if self.kind == "bf16":
            return Packed(
                "bf16", b["qweight"][start // PANEL : -(-stop // PANEL)], None
            ).dequantize()
        if b["qweight"] is None:
            return Packed.from_lanes(
                self.kind, b["lanes"][start // LANES : stop // LANES]
            ).dequantize()
        mins = None if b["mins"] is None else b["mins"][start:stop]
        return Packed(
            self.kind, b["qweight"][start:stop], b["scales"][start:stop], mins
        ).dequantize()

    def dequantized(self) -> torch.nn.Linear:
        """A float32 ``nn.Linear`` of the same weights, dequantized (the mode
        check's reference)."""
        weight = self.weight_rows(0, self.out_features)
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = torch.nn.Parameter(self.bias.detach().float(), requires_grad=False)
        return linear

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind}, {self.arithmetic}"
