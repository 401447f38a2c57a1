"""What the driver sends its tensor-parallel workers: one int32 header and
one int32 payload per message, broadcast from rank 0.

A step's message holds the token ids, the plan's four index arrays, the
positions the head reads (``logits_at``) and, when the plan has them, its
decode write slots and window offsets: everything ``forward_step`` reads of a
plan, so every rank computes the same step over its own KV heads. Page
copies (a fork's partial tail) travel the same way.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from mstar.engine.resources.kv.lengths import row_lengths
from mstar.engine.resources.kv.plan import HostLens, KVPlanOutput, PagedIndptrs

__all__ = [
    "HEADER",
    "Command",
    "Forward",
    "copy_message",
    "forward_message",
    "message",
    "read_copy",
]

HEADER = 8  # int32 slots: the command, the sizes of the payload's parts, its length last


class Command(IntEnum):
    SETUP = 1  # payload: num_pages, page_size, flashinfer (0/1)
    FORWARD = 2
    COPY = 3
    STOP = 4


Message = tuple[torch.Tensor, torch.Tensor]


def message(command: Command, sizes: list[int], parts: list[np.ndarray | torch.Tensor]) -> Message:
    """``(header, payload)``: int32 tensors on the CPU."""
    header = torch.zeros(HEADER, dtype=torch.int32)
    header[: 1 + len(sizes)] = torch.tensor([command, *sizes], dtype=torch.int32)
    flat = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
    values = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    if values.size and (values.min() < -(2**31) or values.max() >= 2**31):
        raise ValueError(f"expected int32 values in a {command.name} message, got {values.max()}")
    header[-1] = values.size
    return header, torch.from_numpy(values.astype(np.int32))


def forward_message(
    input_ids: torch.Tensor, plan: KVPlanOutput, logits_at: torch.Tensor | None
) -> Message:
    """A step: ``forward_step(model, input_ids, plan, cache, logits_at=...)`` on every rank."""
    idx = plan.cpu_indptrs
    arrays = [t.cpu().numpy() for t in idx[:4]]
    decode = plan.decode_pages is not None
    extras = [plan.decode_pages, plan.decode_offsets] if decode else []
    if plan.kv_offsets is not None:
        extras.append(plan.kv_offsets)
    at = [] if logits_at is None else [logits_at.cpu().numpy()]
    sizes = [
        len(input_ids),
        len(arrays[0]) - 1,  # rows
        len(arrays[2]),  # pages
        -1 if logits_at is None else len(logits_at),
        int(decode),
        int(plan.kv_offsets is not None),
    ]
    return message(Command.FORWARD, sizes, [input_ids.cpu().numpy(), *arrays, *at, *extras])


class Forward:
    """A step as a worker reads it: ``input_ids`` (int64, CPU), ``plan`` (a
    ``KVPlanOutput`` without views) and ``logits_at`` (int64 or None)."""

    def __init__(self, header: torch.Tensor, payload: torch.Tensor, page_size: int) -> None:
        tokens, rows, pages, at, decode, offsets = header[1:7].tolist()
        lengths = [tokens, rows + 1, rows + 1, pages, rows, max(at, 0)]
        lengths += [rows, rows] if decode else []
        lengths += [rows] if offsets else []
        parts = list(torch.split(payload, lengths))
        ids, qo, kv, indices, last, logits_at = parts[:6]
        self.input_ids = ids.long()
        self.logits_at = logits_at.long() if at >= 0 else None
        indptrs = PagedIndptrs(qo, kv, indices, last)
        kv_lens = row_lengths(indptrs, page_size).kv_lens
        extras = [p.numpy().astype(np.int64) for p in parts[6:]]
        self.plan = KVPlanOutput(
            indptrs._replace(kv_lens=HostLens(kv_lens)),
            view_builder=_no_views,
            decode_pages=extras[0] if decode else None,
            decode_offsets=extras[1] if decode else None,
            rows=[("", "")] * rows,  # names stay with the driver
        )
        self.plan.kv_offsets = extras[-1] if offsets else None


def copy_message(src: np.ndarray, dst: np.ndarray) -> Message:
    """A page copy (``KVCache.copy_pages(src, dst)``) on every rank."""
    return message(Command.COPY, [len(src)], [src, dst])


def read_copy(header: torch.Tensor, payload: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    n = int(header[1])
    values = payload.numpy().astype(np.int64)
    return values[:n], values[n:]


def _no_views() -> list:
    raise AssertionError("a worker's plan has no views: forward_step reads its index arrays")
