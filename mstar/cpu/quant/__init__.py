"""Quantized weights: ``quantization`` = ``auto``, ``none``, ``gguf``, ``int8`` or ``int4``.

- ``gguf``: a GGUF file's own quantized tensors, served as they stand where
  a kernel takes them exactly (Q4_0/Q4_1 -> int4 groups of 32, Q8_0 -> int8
  groups of 32: ``mstar.cpu.quant.gguf``); Q4_K -> int4, Q5_K and Q6_K -> int8 of
  float32 scales, which only the lanes take (few rows, on activations
  rounded to int16 whatever the arithmetic, with bfloat16 panels of the
  same weights for more: CPUs with AVX512-BF16 and -VNNI, rows a multiple
  of 32), else dequantized as the other types are, the description saying
  why; the linear layers of other
  types (Q5_1, F16, ...) as bfloat16 panels of their float32
  dequantization where the CPU has AVX512-BF16 (as ``bf16`` below), else
  float32; the description counts them per type, and says why float32.
- ``int8`` / ``int4``: the float weights quantized at load (int8 per output
  channel, int4 groups of 32: ``mstar.cpu.quant.at_load``).
- ``bf16`` (CPUs with AVX512-BF16): the float weights rounded to bfloat16
  and held as panels (``packed.pack_bf16``), which every row count
  multiplies in bfloat16 on float32 activations, the model float32 around
  them.
- ``none``: float weights (a GGUF dequantized to float32), in the model's dtype.
- ``auto``: ``gguf`` for a GGUF file where the kernels serve it (the CPU,
  one process, float32 or bfloat16 arithmetic); ``bf16`` for float weights
  in bfloat16 arithmetic where it applies (a one-row decode step of
  SmolLM2 4.7x a bfloat16 model's, whose products stream its weights at a
  quarter of the bandwidth: docs/quantization.md); else ``none``.

Every linear layer (the head too; a GGUF's embedding stays in its blocks,
``embedding.QuantizedEmbedding``, a float one keeps its float weights)
becomes a ``PackedLinear``: float32 activations through the AVX2 kernels of
``kernels.cpp``. Where they cannot run (no AVX2, no compiler), the layers
stay ``nn.Linear`` holding the dequantized weights: the same values, not
smaller, and the description says why.

Arithmetic: ``dtype`` float32 (the model's activations, exact against the
dequantized weights), or bfloat16: the model stays float32 and what rounds
is the packed layers' products. Where the CPU has AVX512-BF16, inputs of
``linear.BF16_ROWS`` rows or more (prefill, batched decode) multiply in
bfloat16 on panels of the weights dequantized from their lanes (below) as
the product reaches them (``lane_panels``: ~2.5x float32 at 32 rows, no
panels held, where held ones cost two bytes a weight); elsewhere those rows
stay float32. Lanes without panels of int4, Q5_K or Q6_K take 2+ rows on
activations rounded to int8 per group of 32 instead (``PackedLinear.int8_rows``,
``cpp/lanes_i8.h``, as llama.cpp multiplies its blocks: the file's weights
exactly, 1.3-1.4x the panels' speed at 512 rows, ~1.6x the int16 lanes' at 8). Few rows
(decode) stream the packed weights on their activations rounded to int16
per group of 32 (``PackedLinear.int16_rows`` of them: int4 1-8 with AVX512-VNNI's
16-bit dot products, which every CPU with AVX512-BF16 has, at one row
~1.1-1.3x the float32 kernel from memory, ~1.5x in cache; 1-4 with AVX2's,
1.0-1.4x on Zen 1; int8 one, AVX2's; ~20x closer to float32 than the panels).
With AVX512-VNNI the int4 and int8 layers also hold their weights as lanes
(``Packed.lanes``: 16 rows to a vector, scales and minimums beside them, the
packed weights' bytes again; Q4_0's without its minimums, 0.5625 bytes a
weight; the K-quants' own factors in place of their float32 scales: Q4_K
0.5625 bytes a weight, Q5_K 0.6875, Q6_K 0.82, the file's), which those rows multiply with VNNI's dot
products: int4 about half the instructions, int8 about a fifth, so the
step's stream runs at the memory's rate; int8 at 1-8 rows there, not one
(``cpp/lanes.h``). Then each kind of the packed tensors (lanes, panels,
...) is moved into one allocation on transparent huge pages, in model order
(``arena.gather``): the step's stream one run, a TLB entry every 2 MiB.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from mstar.cpu.quant.arena import gather, trim_heap
from mstar.cpu.quant.at_load import quantize_int4, quantize_int8
from mstar.cpu.quant.gguf import Deferred, read_packed
from mstar.cpu.quant.kernels import bf16_or_why, kernel_or_why
from mstar.cpu.quant.linear import BF16_ROWS, PackedLinear
from mstar.cpu.quant.packed import GROUP, LANES, PANEL, Packed, bf16_panels, pack_bf16

__all__ = [
    "QUANTIZATIONS",
    "QuantChoice",
    "quantize_model",
    "resolve_quantization",
    "without_int8_rows",
]

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4", "bf16")
# most bytes of bfloat16 panels a model's many-row products hold (SmolLM2's 0.27 GB: 1.1-1.6x
# faster at 9-32 rows than dequantizing them from the lanes as they run); a bigger model's
# are dequantized so, holding none (a 1B's would be 2.1 GB)
HELD_PANELS_BYTES = 512 << 20


@dataclass(frozen=True)
class QuantChoice:
    """A resolved quantization, why it was chosen, and the arithmetic of
    its many-row products (``float32``, or ``bfloat16`` on bfloat16 panels)."""

    mode: str
    reason: str
    arithmetic: str = "float32"

    @property
    def head(self) -> str:
        """What a description of a model loaded so starts with (``mode (reason): ``)."""
        return f"{self.mode} ({self.reason}): "


def resolve_quantization(
    value: object,
    *,
    gguf: bool,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tensor_parallel_size: int = 1,
) -> QuantChoice:
    """``value`` as the quantization to load with (``gguf``: the model is a
    GGUF file); ``ValueError`` naming it when it is not one of
    ``QUANTIZATIONS`` or cannot apply here."""
    if not isinstance(value, str) or value not in QUANTIZATIONS:
        raise ValueError(f"expected quantization one of {', '.join(QUANTIZATIONS)}, got {value!r}")
    if value == "none":
        return QuantChoice("none", "as asked")
    blocker = _blocker(torch.device(device), dtype, tensor_parallel_size)
    arithmetic = str(dtype).removeprefix("torch.")
    if value == "auto":
        if not gguf:
            return _float_weights(blocker, dtype)
        if blocker:
            return QuantChoice("none", f"auto: {blocker}")
        return QuantChoice("gguf", "auto: the file's own format", arithmetic)
    if blocker:
        raise ValueError(f"quantization={value!r} cannot apply: {blocker}")
    if value == "gguf" and not gguf:
        raise ValueError("quantization='gguf' needs a GGUF file, got a model folder")
    if value == "bf16":
        if (why := kernel_or_why() or bf16_or_why()) is not None:
            raise ValueError(f"quantization='bf16' cannot apply: {why}")
        return QuantChoice("bf16", "as asked", "bfloat16")  # whatever the dtype: the panels'
    return QuantChoice(value, "as asked", arithmetic)


def _float_weights(blocker: str | None, dtype: torch.dtype) -> QuantChoice:
    """``auto`` for float weights: bfloat16 panels (``bf16``) where the
    arithmetic is bfloat16 and the CPU's kernels multiply them, else none."""
    if dtype != torch.bfloat16:
        return QuantChoice("none", "auto: not a GGUF file")
    why = blocker or kernel_or_why() or bf16_or_why()
    if why is not None:
        return QuantChoice("none", f"auto: not a GGUF file, no bfloat16 panels: {why}")
    reason = "auto: bfloat16 arithmetic on float weights, the CPU has AVX512-BF16"
    return QuantChoice("bf16", reason, "bfloat16")


def _blocker(device: torch.device, dtype: torch.dtype, tensor_parallel_size: int) -> str | None:
    if device.type != "cpu":
        return f"the quantized kernels run on the CPU, not {device.type}"
    if tensor_parallel_size != 1:
        return "tensor parallelism shards float weights"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the quantized kernels take float32 activations, not {str(dtype).removeprefix('torch.')}"
    return None


def quantize_model(
    model: Any,
    choice: QuantChoice,
    gguf: dict[str, tuple[Packed | Deferred | None, str]] | None = None,
) -> str:
    """Switch ``model``'s linear layers to ``choice``'s packed weights (a GGUF's
    own: ``gguf``, each weight's packed form or None and its GGUF type, as
    ``mstar.models.gguf.load_gguf`` reads them; a layer whose packed weights
    it holds may keep a meta weight until swapped; the entries layers take
    are removed from it, so each read form is freed as its layer is packed:
    lanes and row-major forms never all at once); returns the description
    for the start-up line, also kept as ``model.mstar_quantization``.
    ``ValueError`` before any change when a layer's shape does not fit the
    packing."""
    if choice.mode == "none":
        model.mstar_quantization = f"none ({choice.reason})"
        return model.mstar_quantization
    layers = _linear_layers(model)
    if choice.mode == "bf16":
        model.mstar_quantization = _as_panels(model, choice, layers)
        gather(model)
        return model.mstar_quantization
    dequantized: dict[str, str] = {}
    if choice.mode == "gguf":
        if gguf is None:
            raise ValueError("expected the GGUF file's weights for quantization='gguf', got none")
        packed, dequantized, unpacked = _gguf_layers(model, layers, gguf)
    else:
        _check_shapes(layers, choice.mode)
        quantize = quantize_int4 if choice.mode == "int4" else quantize_int8
        packed = {name: (quantize(mod.weight), "float") for name, mod in layers.items()}
        unpacked = {}
    why = kernel_or_why()
    rounded = why is None and choice.arithmetic == "bfloat16"
    panels = rounded and bf16_or_why() is None
    off_lanes = {} if why else _off_lanes(model, layers, packed, dequantized)
    hold = _panel_bytes(packed) <= HELD_PANELS_BYTES
    kinds: dict[str, tuple[str, str]] = {}  # each packed layer's kind and source type
    for name in list(packed):  # each read form dropped once its layer holds what it keeps
        weights, type_name = packed.pop(name)
        weights = read_packed(weights)  # a deferred layer read now, one at a time
        wide = weights.wide  # lanes and panels alone, whatever the dtype
        _swap(model, name, weights, why is None, panels or wide, rounded or wide, hold)
        kinds[name] = (weights.kind, type_name)
        del weights
        trim_heap()  # the read form's heap pages back to the OS, not left for the next layer's
    panelled, kept = _dequantized_as_panels(model, layers, dequantized)
    gather(model)  # each kind of the packed tensors in one allocation, in the step's order
    summary = _summary(choice, kinds, unpacked, panelled, kept, off_lanes)
    if why is not None:
        summary += f"; run as float32 (dequantized): {why}"
    elif int16 := {n: k for n, k in kinds.items() if model.get_submodule(n).int16_activations}:
        summary += f"; {_rounded_summary(model, int16)}"
    model.mstar_quantization = summary
    return summary


def without_int8_rows(model: Any, under: str | None = None) -> bool:
    """``model``'s packed layers (those under a submodule named ``under``,
    e.g. ``self_attn``; None: all) multiply 2+ rows as without int8 rows
    from now on (``PackedLinear.drop_int8_rows``), its description saying
    so; whether any had them. A fused step built before must be built anew."""
    if under is not None and not isinstance(under, str):
        raise TypeError(f"expected a submodule name or None for under, got {under!r}")
    dropped = [
        m.drop_int8_rows()
        for name, m in model.named_modules()
        if isinstance(m, PackedLinear) and (under is None or under in name.split("."))
    ]
    if any(dropped):
        where = "" if under is None else f" in {under}"
        model.mstar_quantization += (
            f"; int8 rows dropped{where}: 2+ rows on int16 activations up to the lanes' rows,"
            " then bfloat16 panels from the lanes"
        )
    return any(dropped)


def _linear_layers(model: Any) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _as_panels(model: Any, choice: QuantChoice, layers: dict[str, torch.nn.Linear]) -> str:
    """The layers whose shape the panels take (rows a multiple of ``PANEL``,
    width of ``GROUP``) as bf16 (``pack_bf16``); the summary."""
    fits = [n for n, m in layers.items() if not (m.out_features % PANEL or m.in_features % GROUP)]
    for name in fits:
        _swap(
            model, name, pack_bf16(layers[name].weight), use_kernel=True, panels=False, int16=False
        )
    summary = f"bf16 ({choice.reason}): {len(fits)} layer{'s' * (len(fits) != 1)} as bfloat16"
    summary += " panels, every row count multiplied in bfloat16 on float32 activations"
    if kept := [n for n in layers if n not in fits]:
        summary += (
            f"; float32 for {', '.join(kept)} (rows not a multiple of {PANEL} or width of {GROUP})"
        )
    return summary


def _check_shapes(layers: dict[str, torch.nn.Linear], mode: str) -> None:
    for name, mod in layers.items():
        if mod.in_features % GROUP or mod.out_features % 4:
            raise ValueError(
                f"quantization={mode!r} needs every linear layer's input width divisible by"
                f" {GROUP} and output width by 4, got {name} of {mod.in_features} -> {mod.out_features}"
            )


def _gguf_layers(
    model: Any,
    layers: dict[str, torch.nn.Linear],
    weights: dict[str, tuple[Packed | Deferred | None, str]],
) -> tuple[dict[str, tuple[Packed | Deferred, str]], dict[str, str], dict[str, str]]:
    """The layers the GGUF's packed weights serve (``{name: (packed, gguf type)}``),
    those of a type no integer kernel takes exactly (``{name: gguf type}``:
    Q4_K, Q6_K, F16, ...), and the others with why (kept float32)."""
    tied = getattr(model.get_input_embeddings(), "weight", None)  # None: kept quantized
    packed, dequantized, unpacked = {}, {}, {}
    for name, mod in layers.items():
        key = f"{name}.weight"
        if key not in weights and tied is not None and mod.weight is tied:
            key = next(k for k, p in model.named_parameters() if p is tied)
        weight, type_name = weights.get(key, (None, "not in the file"))
        if weight is None and key in weights:
            dequantized[name] = type_name
            continue
        fits = (
            weight is not None
            and weight.shape == tuple(mod.weight.shape)
            and weight.shape[0] % 4 == 0
        )
        # a meta weight: read packed from the file, nothing else to agree with
        if fits and (
            mod.weight.is_meta
            or torch.equal(read_packed(weight).dequantize(), mod.weight.detach().float())
        ):
            packed[name] = weights.pop(key)  # the caller's reference goes with the layer's
            continue
        if mod.weight.is_meta and weight is not None:
            mod.weight = torch.nn.Parameter(read_packed(weight).dequantize(), requires_grad=False)
        unpacked[name] = type_name
    return packed, dequantized, unpacked


def _off_lanes(
    model: Any,
    layers: dict[str, torch.nn.Linear],
    packed: dict[str, tuple[Packed, str]],
    dequantized: dict[str, str],
) -> dict[str, tuple[str, str]]:
    """The packed weights of float32 scales (GGUF's K-quants), which only
    the lanes' kernels take (few rows, on activations rounded to int16) with
    bfloat16 panels beside them (more rows), moved from ``packed`` to
    ``dequantized`` where those cannot serve them (the kernels run):
    ``{name: (type, why)}``."""
    no_panels = bf16_or_why()
    moved = {}
    for name, (weights, type_name) in list(packed.items()):
        if not weights.wide:
            continue
        if no_panels is not None:
            why = no_panels
        elif weights.shape[0] % PANEL:
            why = f"rows not a multiple of {PANEL}"
        else:
            continue
        del packed[name]
        mod = layers[name]
        if mod.weight.is_meta:
            mod.weight = torch.nn.Parameter(read_packed(weights).dequantize(), requires_grad=False)
        dequantized[name] = type_name
        moved[name] = (type_name, why)
    return moved


def _dequantized_as_panels(
    model: Any, layers: dict[str, torch.nn.Linear], dequantized: dict[str, str]
) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """The layers of GGUF types no integer kernel takes (``dequantized``:
    ``{name: type}``, their weights the file's float32 dequantization) as
    bfloat16 panels of those weights where the kernels multiply them
    (``{name: type}``); the rest keep float32 (``{name: (type, why)}``)."""
    why = (kernel_or_why() or bf16_or_why()) if dequantized else None
    panelled, kept = {}, {}
    for name, type_name in dequantized.items():
        mod = layers[name]
        misfit = mod.out_features % PANEL or mod.in_features % GROUP
        reason = why or (f"rows not a multiple of {PANEL} or width of {GROUP}" if misfit else None)
        if reason is not None:
            kept[name] = (type_name, reason)
            continue
        _swap(model, name, pack_bf16(mod.weight), use_kernel=True, panels=False, int16=False)
        panelled[name] = type_name
    return panelled, kept


def _panel_bytes(packed: dict[str, tuple[Packed | Deferred, str]]) -> int:
    """The bytes bfloat16 panels of every layer of ``packed`` would take."""
    return sum(2 * w.shape[0] * w.shape[1] for w, _ in packed.values() if w.shape[0] % PANEL == 0)


def _swap(
    model: Any,
    name: str,
    weights: Packed,
    use_kernel: bool,
    panels: bool,
    int16: bool,
    hold: bool = False,
) -> None:
    """The layer ``name`` on ``weights`` (``use_kernel``: as a ``PackedLinear``,
    with lanes where ``int16``; many rows on bfloat16 panels where ``panels``:
    held where ``hold``, else dequantized from the lanes as they run)."""
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, attr)
    if use_kernel:
        laned = int16 and weights.shape[0] % LANES == 0
        lanes = weights.lanes() if laned and torch.ops.mstar_quant.lanes_rows() else None
        from_lanes = panels and lanes is not None and weights.shape[0] % PANEL == 0
        held = bf16_panels(weights) if from_lanes and hold else None
        layer = PackedLinear(weights, old.bias, held, int16, lanes, from_lanes and held is None)
        setattr(owner, attr, layer)
    else:  # a parameter of its own: a tied embedding keeps its weights
        old.weight = torch.nn.Parameter(weights.dequantize(), requires_grad=False)


def _rounded_summary(model: Any, packed: dict[str, tuple[str, str]]) -> str:
    """The summary's clause on bfloat16 arithmetic: the rows on int16
    activations, per kind of layer, and how many layers take them on lanes;
    the rows on int8 activations (``PackedLinear.int8_rows``) and on
    bfloat16 panels (naming the layers ``_swap`` left without), or why
    there are none."""
    every = [model.get_submodule(name) for name in packed]
    int8 = [m for m in every if m.int8_rows]
    if (why := bf16_or_why()) is not None:
        many = f"more rows float32 ({why})"
    else:
        odd = [n for n, m in zip(packed, every) if not m.lane_panels and m.panels is None]
        kept = f" (float32 for {', '.join(odd)}: rows not a multiple of {PANEL})" if odd else ""
        lean = " on panels dequantized from the lanes" * any(
            m.lane_panels and not m.int8_rows for m in every
        )
        rest = " (the rest)" * bool(int8)
        many = f"{BF16_ROWS}+ rows multiply in bfloat16{lean}{rest}{kept}"
    if int8:
        amx = int8[0].amx_rows
        on_int8 = f"{int8[0].int8_rows}{f'-{amx - 1}' if amx else '+'} rows on int8 activations"
        on_int8 += f", {amx}+ on AMX's bfloat16 tiles (panels from the lanes)" * bool(amx)
        n = len(int8)
        rest = f" ({n} layer{'s' * (n > 1)}: int4, Q5_K and Q6_K lanes), {many}"
        many = on_int8 + rest * (n < len(every))
    layers = [m for m in every if m.int16_activations]
    kinds = Counter((m.kind, 1 if m.int8_rows else m.int16_rows) for m in layers)
    by_rows: dict[int, list[str]] = {}
    for (kind, rows), n in sorted(kinds.items()):
        by_rows.setdefault(rows, []).append(f"the {n} {kind} layer{'s' * (n > 1)}")
    few = [
        f"{'1 row' if rows == 1 else f'1-{rows} rows'} ({', '.join(names)})"
        for rows, names in sorted(by_rows.items(), reverse=True)
    ]
    if not few:
        return many
    laned = sum(m.lanes is not None for m in layers)
    on = f" ({laned} of them on lanes, 16 rows a vector)" if laned else ""
    return f"int16 activations at {', '.join(few)}{on}, {many}"


def _summary(
    choice: QuantChoice,
    packed: dict[str, tuple[str, str]],
    unpacked: dict[str, str],
    panelled: dict[str, str] | None = None,
    kept: dict[str, tuple[str, str]] | None = None,
    off_lanes: dict[str, tuple[str, str]] | None = None,
) -> str:
    """The description: layers per packed kind (and GGUF type), per GGUF
    type on bfloat16 panels or kept float32 (with why), why the types of
    float32 scales are not on lanes (``off_lanes``), and the layers no
    packing took, named."""
    counts: Counter[str] = Counter()
    for kind, type_name in packed.values():
        counts[f"{kind} ({type_name})" if choice.mode == "gguf" else kind] += 1
    for type_name in (panelled or {}).values():
        counts[f"bf16 panels ({type_name} dequantized)"] += 1
    parts = [", ".join(_layers(n, label) for label, n in counts.items())] if counts else []
    by_why: dict[str, Counter[str]] = {}
    for type_name, why in (kept or {}).values():
        by_why.setdefault(why, Counter())[type_name] += 1
    for why, types in by_why.items():
        listed = ", ".join(_layers(n, f"float32 ({t} dequantized)") for t, n in types.items())
        parts.append(f"{listed}: {why}")
    off: dict[str, list[str]] = {}
    for type_name, why in (off_lanes or {}).values():
        if type_name not in off.setdefault(why, []):
            off[why].append(type_name)
    for why, types in off.items():
        parts.append(f"{', '.join(types)} dequantized, not on int4/int8 lanes: {why}")
    if unpacked:
        listed = ", ".join(f"{name} ({t})" for name, t in unpacked.items())
        parts.append(f"float32 (dequantized): {listed}")
    return choice.head + "; ".join(parts)


def _layers(n: int, label: str) -> str:
    return f"{n} layer{'s' * (n != 1)} {label}"
