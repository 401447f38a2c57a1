"""The small ops of a fused decoder layer (``layer_ops.cpp``): RMSNorm (with
the residual add before it), rotary in place, SiLU times up, and a decode
step's rotary + KV write + attention over each row's pages, each one call
where aten takes several (a decode step makes thousands of such calls, and
each aten call costs microseconds).

Built with the system's C++ compiler at first use (~20 s), cached under the
cache folder (``cache_root() / "layer_ops"``, by a hash of the source), registered as
``torch.ops.mstar_layer.*`` (``mstar.engine.cpp_build``).
``layer_ops_or_why()`` says whether they run here (an AVX2 CPU and a
compiler); otherwise the fused layer computes the same with aten ops.
"""

from __future__ import annotations

import functools
from pathlib import Path

from mstar.engine.cpp_build import build_or_why

__all__ = ["layer_ops_or_why"]

SOURCE = Path(__file__).with_name("layer_ops.cpp")


@functools.cache
def layer_ops_or_why() -> str | None:
    """None when the ops are loaded (built first if need be), else why not."""
    return build_or_why("mstar_layer_ops", SOURCE.read_text(), "layer_ops", "the layer ops")
