"""A small step's ``FusedLlamaLayer`` stack as one call of the layer ops'
``decode_layers`` (``mstar/cpu/csrc/decode_layers.cpp``).

Per layer it calls the same C++ functions in the same order as
``FusedLlamaLayer`` with the layer ops does (norm, q/k/v, its bias added,
Qwen3's head norms, attention, o, norm, gate/up, SiLU times up, down; each
bias added after its product), so the same results bit for bit, without ~8
Python calls into the dispatcher a layer and the Python between them. It
serves steps the layer ops' attention serves (``StepAttention.rows``:
decode, short prefills) of fewer than ``BF16_ROWS`` tokens (more may
multiply on bfloat16 panels), on layers whose linear layers are all packed
(or packed side by side: up to three lanes, ``SideBySide``, the parts'
biases joined and added after the joined product, as each part adds its own),
with SiLU, every norm of one epsilon, and in each of a layer's four linear
slots (q/k/v, o, gate/up, down) the lanes that take int8 rows
(``PackedLinear.int8_rows``) all rounding 2+ rows to int8 or none; any other
step runs layer by layer.
The weights and biases are read from the layers at every step, as the
layer-by-layer path reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, is_, is_not

import torch

from mstar.cpu.quant.linear import BF16_ROWS, PackedLinear
from mstar.models.llama.attention import StepAttention
from mstar.models.llama.fused_linear import SideBySide
from mstar.models.llama.layer import FusedLlamaLayer
from mstar.models.llama.rotary import StepRotary

__all__ = ["LayerStack"]

_BIAS = attrgetter("bias")


class LayerStack:
    """``layers`` (fused with the layer ops) as one ``decode_layers`` call."""

    def __init__(self, layers: Sequence[FusedLlamaLayer]) -> None:
        self.layers = tuple(layers)
        self.eps = self.layers[0].norm1.variance_epsilon
        self.heads = self.layers[0].heads
        self._none = torch.empty(0, dtype=torch.float16)  # an int8 layer's (absent) minimums
        self._absent = {"-": self._none}  # the slot of a tensor decode_layers takes empty
        # where each weight lives (a module's ``_parameters`` or ``_buffers``, and its
        # name), in ``decode_layers``' order: read every step, as they are then
        slots: list[tuple[dict[str, torch.Tensor | None], str]] = []
        self._linears = tuple(m for layer in self.layers for m in _linears(layer))
        self.int16_activations = any(m.int16_activations for m in self._linears)
        # bit j: the layers' j-th linear (q/k/v, o, gate/up, down) rounds 2+ rows to int8
        by_slot = zip(*map(_linears, self.layers), strict=True)  # one linear of every layer
        self.int8_slots = sum(
            1 << j for j, slot in enumerate(by_slot) if any(m.int8_rows for m in slot)
        )
        for layer in self.layers:
            slots.append((layer.norm1._parameters, "weight"))
            for i, module in enumerate(_linears(layer)):
                if i == 2:
                    slots.append((layer.norm2._parameters, "weight"))
                if isinstance(module, SideBySide):  # its parts' lanes, the rest empty
                    lanes = [(m._buffers, "lanes") for m in module.parts]
                    slots += lanes + [(self._absent, "-")] * (3 - len(lanes))
                elif module.lanes is not None:  # decode_layers takes them alone, scales empty
                    slots += [(module._buffers, "lanes"), (self._absent, "-"), (self._absent, "-")]
                else:
                    slots += [(module._buffers, n) for n in ("qweight", "scales", "mins")]
        self._held = tuple(held for held, _ in slots)
        self._names = tuple(name for _, name in slots)
        # Qwen3's head norms' weights, two a layer, read every step (none: no layer has them)
        norms = [n for layer in self.layers if layer.head_norms for n in layer.head_norms]
        self._norm_held = tuple(norm._parameters for norm in norms)

    @staticmethod
    def refusal(layers: Sequence[FusedLlamaLayer]) -> str | None:
        """Why ``layers`` cannot run as one call (None: they can)."""
        if not layers or not all(layer.kernels and layer.silu for layer in layers):
            return "has no layer ops or an activation other than SiLU"
        first = layers[0]
        if len({layer.head_norms is None for layer in layers}) > 1:
            return "has layers with and without head norms"
        for layer in layers:
            if not all(isinstance(m, PackedLinear | SideBySide) for m in _linears(layer)):
                return "has linear layers that are not packed"
            side_by_side = [m for m in _linears(layer) if isinstance(m, SideBySide)]
            if any(len(m.parts) > 3 for m in side_by_side):
                return "has more than three formats side by side in one linear layer"
            norms = [
                n.variance_epsilon for n in (layer.norm1, layer.norm2, *(layer.head_norms or ()))
            ]
            if set(norms) != {first.norm1.variance_epsilon} or layer.heads != first.heads:
                return "has layers of different norm epsilons or head counts"
        if len({m.int16_activations for layer in layers for m in _linears(layer)}) > 1:
            return "has layers with and without int16 activations"
        for slot in zip(*map(_linears, layers), strict=True):  # one linear of every layer
            if any(m.int8_rows for m in slot) and any(map(_int8_refused, slot)):
                return "has lanes that take int8 rows with and without them in one slot"
        return None

    def __call__(
        self,
        h: torch.Tensor,
        rotary: StepRotary,
        attention: StepAttention,
    ) -> torch.Tensor | None:
        """Every layer over ``h`` ``[T, hidden]`` in place, as ``FusedLlamaLayer``
        calls in turn do (no MLP output pending before the first); returns the
        last layer's MLP output, or None (nothing done) when the step is not
        one this call serves."""
        if attention.rows is None or h.shape[0] >= BF16_ROWS:
            return None
        caches = [attention.cache.layer(layer.index) for layer in self.layers]
        return torch.ops.mstar_layer.decode_layers.default(
            h, self._weights(), self._biases(), self._head_norms(), caches, self.eps,
            rotary.cos_rows, rotary.sin_rows, *attention.rows, self.heads, attention.scaling,
            self.int16_activations, self.int8_slots,
        )  # fmt: skip

    def _weights(self) -> list[torch.Tensor]:
        """The layers' weights as ``decode_layers`` takes them, as they are now."""
        # one pass at C speed (~420 tensors for SmolLM2), not a Python loop
        return self._present(list(map(dict.__getitem__, self._held, self._names)))

    def _biases(self) -> list[torch.Tensor]:
        """The linear layers' biases as they are now, four a layer (none:
        no layer has one)."""
        biases = list(map(_BIAS, self._linears))
        return self._present(biases) if any(map(is_not, biases, repeat(None))) else []

    def _head_norms(self) -> list[torch.Tensor]:
        """The head norms' weights as they are now, two a layer (or none)."""
        return list(map(dict.__getitem__, self._norm_held, repeat("weight")))

    def _present(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """``tensors`` with each None as the empty tensor ``decode_layers`` takes for none."""
        if any(map(is_, tensors, repeat(None))):
            none = self._none
            return [none if t is None else t for t in tensors]
        return tensors


def _linears(layer: FusedLlamaLayer) -> tuple[torch.nn.Module, ...]:
    """The layer's linear modules in the order it calls them."""
    return (layer.qkv.module, layer.o_proj, layer.gate_up.module, layer.down)


def _int8_refused(linear: PackedLinear | SideBySide) -> bool:
    """Whether ``linear`` holds lanes ``decode_layers`` would round to int8
    (``lanes_i8_takes``) that it rounds to int16 itself (no ``int8_rows``)."""
    parts = linear.parts if isinstance(linear, SideBySide) else (linear,)
    takes = torch.ops.mstar_quant.lanes_i8_takes
    return any(m.lanes is not None and not m.int8_rows and takes(m.lanes) for m in parts)
