"""Linear layers that read one input, run as one.

``RowConcat`` concatenates the layers' weight rows (q/k/v, gate/up) into one
matrix, so a step runs one GEMM where the model runs several; the output is
the layers' outputs side by side, each row's dot products the same as its
own layer's. The model's layers keep working: their weights become views of
the concatenated ones (no second copy), and ``current()`` says whether they
still are (a ``model.to(...)`` or ``half()`` afterwards gives them new
storage, and the concatenation must then be rebuilt).

Plain ``nn.Linear`` layers concatenate their ``weight`` (and ``bias``);
packed ones (``PackedLinear``, int4 or int8 GGUF blocks) their ``qweight``,
``scales`` and ``mins`` rows, which is exact: each packed row is its own
weights and scales (and their bfloat16 panels, 32 rows each, when they
have them; bf16 layers' ``qweight`` is their panels; their lanes, 16 rows
a block, when they have them, or those alone where they hold no row-major
copy). Packed layers holding lanes alone may differ in format (a Q4_K_M
file's q/k Q4_K as int4, v Q6_K as int8): each run of layers of one format
is joined so, the runs side by side (``SideBySide``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F

from mstar.cpu.quant.linear import PackedLinear
from mstar.cpu.quant.packed import LANES, PANEL, Packed

__all__ = ["RowConcat", "SideBySide", "StorageCheck", "concat_refusal", "linear"]

_PACKED_TENSORS = ("qweight", "scales", "mins", "panels", "lanes")


def concat_refusal(layers: Sequence[torch.nn.Module]) -> str | None:
    """Why ``layers`` cannot run as one ``RowConcat`` (None: they can)."""
    kinds = {type(m) for m in layers}
    if len(kinds) != 1 or kinds.pop() not in (torch.nn.Linear, PackedLinear):
        return f"has linear layers of types {sorted(type(m).__name__ for m in layers)}"
    if any(m._forward_hooks or m._forward_pre_hooks for m in layers):
        return "has hooks on its linear layers"
    if len({m.in_features for m in layers}) != 1:
        return "has linear layers of different input widths"
    if len({m.bias is None for m in layers}) != 1:
        return "has linear layers with and without bias"
    tensors = [t for m in layers for t in _tensors(m)]
    if any(type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter for t in tensors):
        return "has linear weights of a tensor subclass (a sharded or quantized tensor)"
    packed = isinstance(layers[0], PackedLinear)
    formats = {_format(m) for m in layers} if packed else set()
    side_by_side = len(formats) > 1 and all(m.qweight is None for m in layers)  # lanes alone
    main = _main(layers)
    if any(
        t.device != main[0].device or (t.dtype != main[0].dtype and not side_by_side) for t in main
    ):
        return "has linear layers of different dtypes or devices"
    if len(formats) > 1 and not side_by_side:
        return "has packed layers of different formats, arithmetic or lanes"
    return None


class SideBySide:
    """Packed layers of different formats, each holding lanes alone, as one
    linear layer: ``x [T, in] -> [T, sum(out)]``, each part's output beside
    the one before (``parts``: ``PackedLinear``s)."""

    def __init__(self, parts: Sequence[PackedLinear]) -> None:
        self.parts = tuple(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(m.out_features for m in parts)

    @property
    def int16_activations(self) -> bool:
        """Whether its parts' few rows are rounded to int16 (lanes: always)."""
        return all(m.int16_activations for m in self.parts)

    @property
    def int8_rows(self) -> int:
        """Fewest rows its parts that take them round to int8 (0: none does)."""
        return max(m.int8_rows for m in self.parts)

    @property
    def bias(self) -> torch.Tensor | None:
        """The parts' biases joined (None where none has one)."""
        if all(m.bias is None for m in self.parts):
            return None
        return torch.cat(
            [torch.zeros(m.out_features) if m.bias is None else m.bias for m in self.parts]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.forward(x) for m in self.parts], dim=-1)


class RowConcat:
    """``layers`` (``concat_refusal`` None) as one linear layer of their
    rows in order: ``x [T, in] -> [T, sum(out)]``. Rebinds the layers'
    weights as views of the concatenation."""

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        reason = concat_refusal(layers)
        if reason is not None:
            raise ValueError(f"expected linear layers that concatenate, got one that {reason}")
        self.layers = tuple(layers)
        self.runs = _runs(self.layers)  # runs of one format, each joined
        with torch.no_grad():
            joined = [_joined(run) for run in self.runs]
            self.module = joined[0] if len(joined) == 1 else SideBySide(joined)
            names = _PACKED_TENSORS if isinstance(joined[0], PackedLinear) else ("weight",)
            names += ("bias",) if layers[0].bias is not None else ()
            for run, module in zip(self.runs, joined, strict=True):
                _rebind(run, module, names)
        # each layer's main weight where its module holds it: ``current`` runs every step
        self.check = StorageCheck([_main_slot(m) for m in self.layers])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.module, x)

    def current(self) -> bool:
        """Whether the layers' weights are still views of the concatenation."""
        return self.check()


class StorageCheck:
    """Whether the tensors held at ``slots`` (a module's ``_parameters`` or
    ``_buffers``, and a name) still have the storage they had when it was
    built (none is None): one pass over the slots at C speed, not
    ``nn.Module.__getattr__`` (~4x the time) nor a Python loop. ``joined``
    checks several as one."""

    def __init__(
        self,
        slots: Sequence[tuple[dict[str, torch.Tensor | None], str]],
        storage: Sequence[int] | None = None,
    ) -> None:
        self._held = tuple(held for held, _ in slots)
        self._names = tuple(name for _, name in slots)
        pointers = self._pointers() if storage is None else list(storage)
        if pointers is None or len(pointers) != len(self._held):
            raise ValueError("expected a tensor in every slot and a pointer for each")
        self._storage = pointers

    @classmethod
    def joined(cls, checks: Sequence[StorageCheck]) -> StorageCheck:
        """One check of every slot of ``checks`` against the storage each recorded."""
        slots = [slot for c in checks for slot in zip(c._held, c._names)]
        return cls(slots, [p for c in checks for p in c._storage])

    def __call__(self) -> bool:
        return self._pointers() == self._storage

    def _pointers(self) -> list[int] | None:
        """The slots' tensors' ``data_ptr()`` as they are now (None: a slot holds none)."""
        try:
            return list(map(torch.Tensor.data_ptr, map(dict.get, self._held, self._names)))
        except TypeError:  # ``data_ptr`` of None
            return None


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Linear`` or ``PackedLinear`` without the
    module call's overhead (its weights read as they are now)."""
    if type(module) is torch.nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module.forward(x)


def _rebind(
    layers: Sequence[torch.nn.Module], module: torch.nn.Module, names: Sequence[str]
) -> None:
    """Each of ``layers``' tensors ``names`` becomes a row view of ``module``'s
    (their join, in order)."""
    bf16 = getattr(module, "kind", None) == "bf16"  # its qweight is its panels
    panelled = {"panels", "qweight"} if bf16 else {"panels"}
    per_entry = {name: PANEL for name in panelled} | {"lanes": LANES}  # rows an entry of dim 0
    start = 0
    for layer in layers:
        width = layer.out_features
        for name in names:
            joined = getattr(module, name)
            if joined is None:
                continue
            per = per_entry.get(name, 1)
            view = joined[start // per : (start + width) // per]
            if isinstance(getattr(layer, name), torch.nn.Parameter):
                setattr(layer, name, torch.nn.Parameter(view, requires_grad=False))
            else:
                setattr(layer, name, view)
        start += width


def _runs(layers: Sequence[torch.nn.Module]) -> list[tuple[torch.nn.Module, ...]]:
    """``layers`` cut into runs of one format (``_format``; float layers: one run)."""
    runs: list[list[torch.nn.Module]] = []
    for layer in layers:
        same = runs and (
            not isinstance(layer, PackedLinear) or _format(layer) == _format(runs[-1][0])
        )
        if same:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return [tuple(run) for run in runs]


def _format(layer: PackedLinear) -> tuple:
    """What packed layers joined must share: kind, scales a row, arithmetic,
    and the lanes' layout (None: no lanes; their shape past the rows' axis
    but for the width: float16 scales with or without minimums, float32
    scales, or a K-quant's factors)."""
    lanes = None if layer.lanes is None else tuple(layer.lanes.shape[2:])
    return layer.kind, _groups(layer), layer.arithmetic, lanes


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    names = _PACKED_TENSORS if isinstance(module, PackedLinear) else ("weight",)
    tensors = [getattr(module, n) for n in names if getattr(module, n) is not None]
    return tensors + ([module.bias] if module.bias is not None else [])


def _groups(layer: PackedLinear) -> int | None:
    """Scales a row of ``layer``'s weights has (None: bf16 panels have none)."""
    return None if layer.scales is None else layer.scales.shape[1]


def _main(layers: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """Each layer's main weight tensor (``weight``, or packed ``qweight``, or
    its lanes where it holds them alone)."""
    return [held[name] for held, name in map(_main_slot, layers)]


def _main_slot(layer: torch.nn.Module) -> tuple[dict[str, torch.Tensor], str]:
    """Where ``layer`` holds its main weight: ``(layer._buffers, "qweight")``
    (``"lanes"`` where it holds them alone) or ``(layer._parameters, "weight")``."""
    if isinstance(layer, PackedLinear):
        return layer._buffers, "qweight" if layer.qweight is not None else "lanes"
    return layer._parameters, "weight"


def _joined(layers: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One layer of ``layers``' rows in order (packed tensors lying one after
    another in one allocation, as ``quant.arena.gather`` leaves them, joined
    as a view of it; else copies)."""
    bias = _bias(layers)
    if isinstance(layers[0], PackedLinear):
        parts = [None if getattr(layers[0], n) is None else _rows([getattr(m, n) for m in layers])
                 for n in _PACKED_TENSORS]  # fmt: skip
        first = layers[0]
        if parts[0] is None:  # the layers hold no row-major copy: none is rebuilt
            return PackedLinear.on_lanes(
                first.kind, parts[4], bias, parts[3], first.lane_panels, bool(first.int8_rows)
            )
        packed = Packed(first.kind, *parts[:3], symmetric=all(m.symmetric for m in layers))
        return PackedLinear(
            packed,
            bias,
            parts[3],
            first.int16_activations,
            parts[4],
            first.lane_panels,
            bool(first.int8_rows),
        )
    weight = torch.cat([m.weight for m in layers])
    joined = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    joined.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        joined.bias = torch.nn.Parameter(bias, requires_grad=False)
    return joined


def _rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)``: a view where each contiguous tensor starts in
    the same storage where the one before ends (the same dtype and row
    shape), else a copy."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    adjacent = all(
        t.is_contiguous()
        and t.dtype == first.dtype
        and t.shape[1:] == first.shape[1:]
        and t.untyped_storage().data_ptr() == storage
        for t in tensors
    ) and all(
        b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in pairwise(tensors)
    )
    if not adjacent:
        return torch.cat(list(tensors))
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def _bias(layers: Sequence[torch.nn.Module]) -> torch.Tensor | None:
    if layers[0].bias is None:
        return None
    return torch.cat([m.bias.detach() for m in layers])
