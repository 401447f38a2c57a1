"""The packed-weight linear kernels (``kernels.cpp``), built with the
system's C++ compiler at first use (8 s on a 2-core Zen 5) together with the fused
layer's small ops (``mstar/cpu/csrc/layer_ops.cpp``) as one extension, so that
both share one team of threads (``csrc/team.h``: kept awake through a step,
where torch's OpenMP threads may sleep after every call); cached under the
cache folder (``cache_root() / "kernels"``, by a hash of the sources: see
``mstar.cpu.build``), and registered as the torch ops
``torch.ops.mstar_quant.int4_linear`` / ``int8_linear``, their
``*_i16`` twins on activations rounded to int16 (``int16_rows(bits)``
rows of them), and ``bf16_linear`` (on bfloat16 panels: ``bf16_or_why()``),
with fake implementations, so ``torch.compile`` traces through them, and
``torch.ops.mstar_layer.*`` (``mstar.cpu.layer_ops``).

``kernel_or_why()`` says whether they run here: they need a CPU with AVX2
(with FMA and F16C) and a compiler; otherwise the quantized layers fall back
to float32 ``F.linear`` on their dequantized weights (exact, not smaller).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from mstar.cpu.build import build, build_or_why, flags

__all__ = ["bf16_or_why", "build_under", "kernel_or_why"]

CSRC = Path(__file__).parents[1] / "csrc"  # every C++ source of the backend
SOURCE = CSRC / "kernels.cpp"
LAYER_OPS = CSRC / "layer_ops.cpp"
DECODE_LAYERS = CSRC / "decode_layers.cpp"  # calls both of them
# the one extension's source: all three files in one unit, so one Team (team.h) for all
BOTH = '#include "kernels.cpp"\n#include "layer_ops.cpp"\n#include "decode_layers.cpp"\n'


def headers() -> dict[str, str]:
    """The headers the sources include: ``{file name: text}``."""
    return {path.name: path.read_text() for path in sorted(CSRC.glob("*.h"))}


@functools.cache
def kernel_or_why() -> str | None:
    """None when the kernels are loaded (built first if need be), else why not."""
    files = {
        **headers(),
        **{path.name: path.read_text() for path in (SOURCE, LAYER_OPS, DECODE_LAYERS)},
    }
    why = build_or_why("mstar_cpu_ops", BOTH, "kernels", "the C++ ops", files)
    if why is None:
        _register_fakes()
    return why


def bf16_or_why() -> str | None:
    """None when this CPU's build of the kernels has ``bf16_linear`` (it
    has AVX512-BF16's dot products), else why not; builds nothing."""
    if "-mavx512bf16" not in flags():
        return "the CPU lacks AVX512-BF16 (bfloat16 dot products) or AVX512-VNNI"
    return None


def build_under(
    namespace: str,
    source: str,
    cflags: tuple[str, ...] | None = None,
    parts: dict[str, str] | None = None,
) -> object:
    """A kernels ``source`` text and the headers it includes (``parts``:
    this tree's unless given; another version's, or ``{}`` for one without
    them) built with ``cflags`` (this CPU's unless given) and its ops
    registered under ``namespace`` instead of ``mstar_quant``, beside this
    build in one process: ``torch.ops.<namespace>``."""
    source = source.replace("mstar_quant,", f"{namespace},")
    build(namespace, source, "kernels", cflags, headers() if parts is None else parts)
    return getattr(torch.ops, namespace)


def _register_fakes() -> None:
    @torch.library.register_fake("mstar_quant::int4_linear")
    def _(x, qweight, scales, mins):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("mstar_quant::int4_linear_i16")
    def _(x, qweight, scales, mins):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("mstar_quant::int8_linear")
    def _(x, qweight, scales):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("mstar_quant::int8_linear_i16")
    def _(x, qweight, scales):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("mstar_quant::lanes_i16")
    def _(x, lanes):
        return x.new_empty((*x.shape[:-1], lanes.shape[0] * 16))

    @torch.library.register_fake("mstar_quant::lanes_bf16")
    def _(x, lanes):
        return x.new_empty((*x.shape[:-1], lanes.shape[0] * 16))

    @torch.library.register_fake("mstar_quant::bf16_linear")
    def _(x, panels):
        return x.new_empty((*x.shape[:-1], panels.shape[0] * panels.shape[2]))
