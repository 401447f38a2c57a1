"""The small ops of a fused decoder layer (``layer_ops.cpp``): RMSNorm (with
the residual add before it), rotary in place, and decode attention over a
row's pages, each one call where aten takes several (a decode step makes
thousands of such calls, and each aten call costs microseconds).

Built with the system's C++ compiler at first use (seconds), cached under
the cache folder (``cache_root() / "layer_ops"``), registered as
``torch.ops.mstar_layer.*``. ``layer_ops_or_why()`` says whether they run
here (an AVX2 CPU and a compiler); otherwise the fused layer computes the
same with aten ops (``FusedLlamaLayer``'s fallback).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

__all__ = ["layer_ops_or_why"]

SOURCE = Path(__file__).with_name("layer_ops.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp-simd", "-std=c++17"]


@functools.cache
def layer_ops_or_why() -> str | None:
    """None when the ops are loaded (built first if need be), else why not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch sees {capability})"
    try:
        from torch.utils import cpp_extension

        from mstar.engine.cachedir import cache_root

        folder = cache_root() / "layer_ops"
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="mstar_layer_ops",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            build_directory=str(folder),
            is_python_module=False,
        )
    except Exception as err:  # no compiler, no ninja, a failed build: fall back, say why
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return f"the layer ops did not build ({type(err).__name__}: {first})"
    return None
