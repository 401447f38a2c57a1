"""``PackedLinear``: a linear layer on packed weights (``packed.Packed``),
float32 activations in and out, through the kernels of ``kernels.cpp``."""

from __future__ import annotations

import torch

from mstar.engine.quant.packed import Packed


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` held packed; the same result as
    ``F.linear`` on ``packed.dequantize()`` up to the order of the sums."""

    def __init__(self, packed: Packed, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kind = packed.kind
        self.out_features, self.in_features = packed.shape
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("mins", packed.mins)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "int4":
            y = torch.ops.mstar_quant.int4_linear(x, self.qweight, self.scales, self.mins)
        else:
            y = torch.ops.mstar_quant.int8_linear(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias

    def packed(self) -> Packed:
        return Packed(self.kind, self.qweight, self.scales, self.mins)

    def dequantized(self) -> torch.nn.Linear:
        """A float32 ``nn.Linear`` of the same weights, dequantized (the mode
        check's reference)."""
        weight = self.packed().dequantize()
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = torch.nn.Parameter(self.bias.detach().float(), requires_grad=False)
        return linear

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind}"
