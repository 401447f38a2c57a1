"""The packed-weight linear kernels (``kernels.cpp``): built with the
system's C++ compiler at first use (about a minute), cached under the cache
folder (``cache_root() / "kernels" / <name>``, the name keyed by a hash of
the source, so a changed source builds afresh and two trees with different
sources never share a build folder), and registered as the torch ops
``torch.ops.mstar_quant.int4_linear`` / ``int8_linear`` with fake
implementations, so ``torch.compile`` traces through them.

``kernel_or_why()`` says whether they run here: they need a CPU with AVX2
(with FMA and F16C) and a compiler; otherwise the quantized layers fall back
to float32 ``F.linear`` on their dequantized weights (exact, not smaller).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from mstar.engine.cpp_build import AVX2_FLAGS

__all__ = ["build_kernels", "kernel_or_why"]

SOURCE = Path(__file__).with_name("kernels.cpp")
# -fopenmp: without it ATen's headers compile ``at::parallel_for`` serial
# (its parallel backend needs ``_OPENMP``) and every call runs on one thread
FLAGS = [*AVX2_FLAGS, "-fopenmp"]


def build_kernels(source: str, stem: str = "mstar_quant_kernels") -> str:
    """Build (or find built) the C++ ``source`` and load it into this process;
    returns the build's name, ``stem`` and a hash of the source and flags."""
    from torch.utils import cpp_extension

    from mstar.engine.cachedir import cache_root

    digest = hashlib.sha256("\n".join([source, *FLAGS]).encode()).hexdigest()[:12]
    name = f"{stem}_{digest}"
    folder = cache_root() / "kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "kernels.cpp"
    if not path.exists() or path.read_text() != source:
        path.write_text(source)
    cpp_extension.load(
        name=name,
        sources=[str(path)],
        extra_cflags=FLAGS,
        build_directory=str(folder),
        is_python_module=False,
    )
    return name


@functools.cache
def kernel_or_why() -> str | None:
    """None when the kernels are loaded (built first if need be), else why not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch sees {capability})"
    try:
        build_kernels(SOURCE.read_text())
    except Exception as err:  # no compiler, no ninja, a failed build: fall back, say why
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return f"the kernels did not build ({type(err).__name__}: {first})"
    _register_fakes()
    return None


def _register_fakes() -> None:
    @torch.library.register_fake("mstar_quant::int4_linear")
    def _(x, qweight, scales, mins):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("mstar_quant::int8_linear")
    def _(x, qweight, scales):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))
