"""The packed layers' tensors of each kind in one allocation, in model order,
on transparent huge pages.

A decode step streams every packed layer's weights once, in the order the
model holds its layers (per Llama layer q, k, v, o, gate, up, down, then the
head). Made one by one at load, each its own allocation on 4 KiB pages
wherever the load's churn left free memory, they cost the stream a TLB miss
(on a VM, a two-level walk) every 4 KiB. ``gather`` moves every
``PackedLinear``'s tensors of a kind (lanes, panels, ...) into one
allocation a kind, in module order, advised onto 2 MiB pages
(``MADV_HUGEPAGE``) where the OS has them: on Zen 4 (a 2-vCPU VM) a
one-row SmolLM2 step 0.35 ms faster than on the load's own tensors (4.30
against 4.63 ms, the same engine switched in turns; docs/performance.md).
q/k/v and gate/up then lie side by side, so joining them
(``mstar.models.llama.fused_linear.RowConcat``) takes a view, not a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
from typing import Any

import numpy as np
import torch

from mstar.cpu.quant.linear import PackedLinear

__all__ = ["ALIGN", "HUGE_PAGE", "KINDS", "allocation", "gather", "trim_heap"]

KINDS = ("lanes", "panels", "qweight", "scales", "mins")  # a PackedLinear's tensors
ALIGN = 64  # bytes: each tensor starts on a cache line
HUGE_PAGE = 2 << 20


def gather(model: Any) -> int:
    """Every ``PackedLinear`` of ``model`` holding its tensors of each kind
    of ``KINDS`` as views of one uint8 allocation a kind, in module order
    (the same values; a tensor two modules share stays shared); returns the
    bytes moved. Inference only: the tensors are buffers, not trained."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    moved = 0
    with torch.no_grad():
        for kind in KINDS:
            held = [m._buffers.get(kind) for m in layers]
            # a tensor by where it starts and what it holds: two views of one start but of
            # another shape or dtype get a copy each, never one the other's
            unique = {_key(t): t for t in held if t is not None and t.numel()}
            if not unique:
                continue
            offsets, total = {}, 0
            for key, t in unique.items():
                offsets[key] = total
                total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            device = next(iter(unique.values())).device
            arena = allocation(total) if device.type == "cpu" else None
            if arena is None:
                arena = torch.empty(total, dtype=torch.uint8, device=device)
            holders: dict[tuple, list[PackedLinear]] = {}
            for m, t in zip(layers, held):
                if t is not None and t.numel():
                    holders.setdefault(_key(t), []).append(m)
            del held
            for key in list(unique):  # each tensor freed once moved: the arena and the rest
                t = unique.pop(key)
                at = offsets[key]
                view = arena[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                view.copy_(t)
                for m in holders[key]:
                    m._buffers[kind] = view
                del t
                trim_heap()  # its heap pages back to the OS (glibc keeps < 32 MiB ones)
            moved += total
    return moved


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def allocation(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of uint8 on the CPU in anonymous memory aligned to and
    advised onto transparent huge pages (None where the OS has no
    ``MADV_HUGEPAGE``); the tensor keeps the mapping alive."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # huge pages off ("never"): 4 KiB pages, still one run
        mapping.madvise(advice)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return torch.from_numpy(raw[start : start + nbytes])


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``);
    False where the C library has none. A load frees the tensors ``gather``
    copied and the unpacked forms it read, which glibc otherwise keeps
    resident: a 3B-shaped Q4_0 file's model 14.2 GB once loaded, 8.8 after."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` in the process's own C library (None: none),
    looked up once: ``gather`` trims after every tensor it moves."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)
