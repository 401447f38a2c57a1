"""A KV cache's pages as rows of bytes: every layer's keys and values of a
page, side by side, so one page is one byte string in any tier."""

from __future__ import annotations

import numpy as np
import torch


def _parts(cache) -> list[torch.Tensor]:
    """Every page tensor of ``cache`` (a ``KVCache``): one per layer, or a
    layer's ``(k, v)`` pair."""
    out: list[torch.Tensor] = []
    for layer in range(cache.num_layers):
        t = cache.layer(layer)
        out += list(t) if isinstance(t, tuple) else [t]
    return out


def page_bytes(cache) -> int:
    """Bytes of one page over every layer."""
    return sum(p[0].numel() * p.element_size() for p in _parts(cache))


def read_pages(cache, pages: np.ndarray) -> torch.Tensor:
    """A copy of ``pages``' KV: uint8 ``[len(pages), page_bytes]`` on the CPU."""
    idx = torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(cache.device)
    n = len(idx)
    rows = [p[idx].reshape(n, -1).view(torch.uint8) for p in _parts(cache)]
    return torch.cat(rows, dim=1).cpu()


def write_pages(cache, pages: np.ndarray, data: torch.Tensor) -> None:
    """Store ``data`` (uint8 ``[len(pages), page_bytes]``, as ``read_pages``
    gives) into ``pages``."""
    idx = torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(cache.device)
    data = data.to(cache.device)
    n, at = len(idx), 0
    for p in _parts(cache):
        width = p[0].numel() * p.element_size()
        chunk = data[:, at : at + width].contiguous().view(p.dtype)
        p[idx] = chunk.reshape(n, *p.shape[1:])
        at += width
