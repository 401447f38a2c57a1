"""What tensor parallelism can serve, judged from a model's config before
any worker starts."""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["TensorParallelUnsupported", "check_size", "check_support"]


class TensorParallelUnsupported(ValueError):
    """A model or device that tensor parallelism cannot serve, refused
    before any worker process is started."""


def check_size(size: object) -> int:
    """``tensor_parallel_size`` as an int >= 1."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"expected tensor_parallel_size an int, got {size!r}")
    if size < 1:
        raise ValueError(f"expected tensor_parallel_size >= 1, got {size}")
    return size


def check_support(config: Any, size: int, device: torch.device) -> None:
    """Refuse (``TensorParallelUnsupported``) a model whose config ships no
    tensor-parallel plan (transformers' ``base_model_tp_plan``) or whose
    attention or KV heads do not divide by ``size``, and a device that
    cannot hold this machine's ranks: CUDA needs a GPU per rank (local rank
    ``r`` on ``cuda:r``; under torchrun ``LOCAL_WORLD_SIZE`` ranks); the CPU
    (gloo) needs a machine without CUDA, since transformers shards onto the
    accelerator it finds."""
    text = config.get_text_config()
    name = type(text).__name__
    if not getattr(text, "base_model_tp_plan", None):
        raise TensorParallelUnsupported(
            f"expected a model whose config ships a tensor-parallel plan (base_model_tp_plan),"
            f" got {name} without one"
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    counts = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    bad = [f"{field}={value}" for field, value in counts.items() if value % size]
    if bad:
        raise TensorParallelUnsupported(
            f"expected the heads of {name} divisible by tensor_parallel_size={size}, got"
            f" {' and '.join(bad)}: each rank holds 1/{size} of the heads"
        )
    if device.type == "cuda":
        # the ranks on this machine: all of them, or torchrun's share of them
        here = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        if (device.index or 0) != 0 or torch.cuda.device_count() < here:
            raise TensorParallelUnsupported(
                f"expected device 'cuda' with {here} GPUs (local rank r on cuda:r), got"
                f" {str(device)!r} with {torch.cuda.device_count()}"
            )
    elif torch.cuda.is_available():
        raise TensorParallelUnsupported(
            "expected device 'cuda' for tensor parallelism on a machine with CUDA, got 'cpu'"
            " (transformers shards onto the accelerator it finds)"
        )
