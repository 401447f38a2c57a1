"""Tensor parallelism: one plan for every rank, each rank its own KV heads.

``shard(model, size)`` and ``load_sharded(name, size, device, dtype)`` start
a group (``TensorParallel``) for the ``Engine``; models are sharded by
transformers' own tensor-parallel plans, and refused before any worker
starts when they have none or their heads do not divide (``check_support``).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from mstar.models.tp.group import BroadcastStats, TensorParallel, WorkerFailed
from mstar.models.tp.support import TensorParallelUnsupported, check_size, check_support

__all__ = [
    "BroadcastStats",
    "TensorParallel",
    "TensorParallelUnsupported",
    "WorkerFailed",
    "check_size",
    "load_sharded",
    "shard",
]

_GROUP_ATTRIBUTE = "_mstar_tp"


def shard(model: Any, size: int) -> TensorParallel | None:
    """None for ``size`` 1; else a running group of ``size`` ranks serving
    ``model`` (the group ``load_sharded`` made it with, or a new one loaded
    from a copy of it saved to a temporary folder: ``model`` is left as it
    is, the engine serves the group's shard). Refuses what
    ``check_support`` refuses before starting anything."""
    if check_size(size) == 1:
        return None
    group = getattr(model, _GROUP_ATTRIBUTE, None)
    if group is not None:
        if group.size != size:
            raise ValueError(
                f"expected tensor_parallel_size={group.size} for a shard of {group.size} ranks,"
                f" got {size}"
            )
        return group
    param = next(model.parameters())
    check_support(model.config, size, param.device)
    with tempfile.TemporaryDirectory(prefix="mstar-tp-") as folder:
        model.save_pretrained(folder)
        return TensorParallel.launch(folder, size, param.device, param.dtype)


def load_sharded(name: str, size: int, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """``(shard, tokenizer)`` of ``name`` (as ``loader.load`` takes it) over a
    new group of ``size`` ranks; the driver never holds the whole model.
    ``shard(model, size)`` returns that group."""
    from transformers import AutoConfig

    from mstar.models.loader import load_tokenizer, model_folder

    folder = model_folder(name)
    check_support(AutoConfig.from_pretrained(folder), size, device)
    tokenizer = load_tokenizer(folder)
    group = TensorParallel.launch(str(folder), size, device, dtype)
    setattr(group.model, _GROUP_ATTRIBUTE, group)
    return group.model, tokenizer
