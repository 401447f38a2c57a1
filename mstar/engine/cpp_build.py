"""Building a C++ extension of torch ops at first use: compiled with the
system's compiler for AVX2 (+ FMA, F16C), cached under the cache folder
(``cache_root() / folder``), loaded into the process (its ops registered
with torch). Callers keep an aten fallback for when it does not build."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["AVX2_FLAGS", "build_or_why"]

AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17")


def build_or_why(
    name: str, source: Path, folder: str, flags: tuple[str, ...] = AVX2_FLAGS
) -> str | None:
    """Build (or load the cached build of) ``source`` as the extension
    ``name``: None when its ops are loaded, else why not (a CPU without
    AVX2, no compiler, a failed build)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch sees {capability})"
    try:
        from torch.utils import cpp_extension

        from mstar.engine.cachedir import cache_root

        build = cache_root() / folder
        build.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=list(flags),
            build_directory=str(build),
            is_python_module=False,
        )
    except Exception as err:  # no compiler, no ninja, a failed build: fall back, say why
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return f"{name} did not build ({type(err).__name__}: {first})"
    return None
