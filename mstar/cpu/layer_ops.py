"""The small ops of a fused decoder layer (``layer_ops.cpp``): RMSNorm (with
the residual add before it), rotary in place, SiLU times up, and a decode
step's rotary + KV write + attention over each row's pages
(``layer_attention.h``), each one call
where aten takes several (a decode step makes thousands of such calls, and
each aten call costs microseconds).

Built at first use in one extension with the packed-weight kernels
(``mstar.cpu.quant.kernels``: they share its team of threads) and
registered as ``torch.ops.mstar_layer.*``. ``layer_ops_or_why()`` says
whether they run here (an AVX2 CPU and a compiler); otherwise the fused
layer computes the same with aten ops.
"""

from __future__ import annotations

from mstar.cpu.quant.kernels import kernel_or_why

__all__ = ["layer_ops_or_why"]


def layer_ops_or_why() -> str | None:
    """None when the ops are loaded (built first if need be), else why not."""
    return kernel_or_why()
