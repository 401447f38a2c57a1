"""The device an engine runs on: a device a user names, checked; the KV page
pool sized to its memory; FlashInfer's attention on CUDA when installed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mstar.models.hf_support import KVSpec, flashinfer_unsupported, kv_spec

# num_pages=None: the pool takes this share of the free device memory (on the
# CPU, of the available host memory, at most HOST_POOL_BYTES: the host is shared)
KV_MEMORY_FRACTION = 0.25
HOST_POOL_BYTES = 1 << 30
MEMINFO = Path("/proc/meminfo")  # the host's MemAvailable, where the OS has one


def pool_pages(
    spec: KVSpec,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    memory: int | None = None,
) -> int:
    """Pages filling ``memory`` bytes, by default ``KV_MEMORY_FRACTION`` of
    the free memory of ``device`` (on the host its available memory, at
    most ``HOST_POOL_BYTES``)."""
    page_bytes = page_bytes_of(spec, page_size, dtype)
    if memory is not None:
        if memory < page_bytes:
            raise ValueError(
                f"expected kv_cache_memory of at least one page ({page_bytes} bytes), got {memory}"
            )
        return memory // page_bytes
    free = _free_bytes(device)
    if device.type != "cuda":
        free = min(free, int(HOST_POOL_BYTES / KV_MEMORY_FRACTION))
    pages = int(free * KV_MEMORY_FRACTION) // page_bytes
    if pages < 1:
        raise ValueError(
            f"expected a page_size whose page fits {KV_MEMORY_FRACTION:.0%} of the free memory"
            f" ({free * KV_MEMORY_FRACTION / 2**30:.2f} GiB), got {page_size}"
            f" ({page_bytes / 2**30:.2f} GiB a page)"
        )
    return pages


def check_pool_fits(
    spec: KVSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse a pool larger than the free memory of ``device``."""
    need = page_bytes_of(spec, page_size, dtype) * num_pages
    free = _free_bytes(device)
    if need > free:
        raise ValueError(
            f"expected a KV pool that fits the free memory ({free / 2**30:.2f} GiB on {device}),"
            f" got num_pages {num_pages} x page_size {page_size} = {need / 2**30:.2f} GiB"
        )


def page_bytes_of(spec: KVSpec, page_size: int, dtype: torch.dtype) -> int:
    """The bytes of one KV page over every layer."""
    per_token = spec.num_layers * spec.num_kv_heads * (spec.head_dim + spec.v_head_dim)
    return per_token * page_size * dtype.itemsize


def _free_bytes(device: torch.device) -> int:
    """The memory a pool may take: CUDA's free bytes; on the host Linux's
    ``MemAvailable`` (free pages and the page cache it would drop), else the
    free pages alone: a load that just read or wrote gigabytes of files
    leaves the free pages low and the page cache full (an 8B file's first
    start: 0.26 GiB of pool by the free pages, 1 GiB by ``MemAvailable``)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        lines = MEMINFO.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def checked_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` this machine has, or a named error."""
    if not isinstance(device, str | torch.device):
        raise TypeError(f"expected device a str or a torch.device, got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"expected a device such as 'cpu' or 'cuda:0', got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"expected an available device, got {str(device)!r}: no CUDA")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"expected a CUDA device index < {torch.cuda.device_count()}, got {str(device)!r}"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"expected device 'cpu' or 'cuda', got {str(device)!r}")
    return device


# what FlashInfer's paged prefill/decode kernels are built for
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def flashinfer_or_none(device: str, model: Any = None) -> Any:
    """FlashInfer's paged attention on ``device``, or None (PyTorch's) without
    it, or when ``model``'s weights or head width are ones its kernels lack
    (float32, say): that model is served exactly by ``paged_attention``."""
    from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention

    if model is not None:
        spec = kv_spec(model)
        dtype = next(model.parameters()).dtype
        if (
            dtype not in FLASHINFER_DTYPES
            or spec.head_dim not in FLASHINFER_HEAD_DIMS
            or flashinfer_unsupported(spec) is not None
        ):
            return None
    try:
        return FlashInferPagedAttention(device=device)
    except RuntimeError:
        return None
