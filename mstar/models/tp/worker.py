"""A tensor-parallel rank other than the driver: its shard of the model, a
``KVCache`` of its own KV heads, and a loop that runs what the driver
broadcasts (``wire``) until told to stop. It never plans or samples.

Also the process-group setup every rank shares: the model's collectives run
on the default group (gloo on the CPU, NCCL on CUDA); the driver's messages
on a gloo group of their own whose timeout is long, so an idle engine does
not time its workers out (a dead peer still fails it at once: gloo sees the
closed socket).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mstar.engine.resources.kv.cache import KVCache
from mstar.models.hf import forward_step, kv_spec, register
from mstar.models.tp.wire import HEADER, Command, Forward, read_copy

__all__ = ["join", "load_shard", "run", "serve"]

MODEL_TIMEOUT = timedelta(minutes=5)  # one collective of the model's forward
CONTROL_TIMEOUT = timedelta(days=30)  # the wait for the driver's next message
STARTUP_TIMEOUT = timedelta(minutes=10)  # every rank joining the group


def join(rank: int, size: int, device: torch.device, store: Any = None) -> Any:
    """Join the default process group (from ``store``, else from torchrun's
    environment) and return the control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    where = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=MODEL_TIMEOUT, **where)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def load_shard(folder: str | Path, dtype: torch.dtype) -> Any:
    """This rank's shard of the model in ``folder``, through transformers'
    tensor-parallel plan (``tp_plan="auto"``: DTensor weights), in eval mode
    with the paged attention implementation. Collective: every rank calls it."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, distributed_config=config)
    return model.eval()


def run(rank: int, size: int, port: int, folder: str, dtype: torch.dtype, device: str) -> None:
    """A spawned worker's entry point: join the driver's store on ``port``,
    then ``serve``."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    os.environ["LOCAL_RANK"] = str(rank)  # transformers binds cuda:LOCAL_RANK
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=STARTUP_TIMEOUT)
    store.set(f"up{rank}", "1")
    control = join(rank, size, torch.device(device), store)
    serve(control, folder, dtype, torch.device(device, rank) if device == "cuda" else "cpu")


def serve(control: Any, folder: str, dtype: torch.dtype, device: torch.device | str) -> None:
    """Load this rank's shard and run the driver's messages until ``STOP``.
    An error ends the process (its socket closes, which fails the driver)."""
    register()
    model = load_shard(folder, dtype)
    dist.barrier(group=control)  # every rank has read the folder
    spec = kv_spec(model)  # the probe forward, in step with the driver's (group.py)
    model.set_attn_implementation(register())
    cache, flashinfer = None, None
    header = torch.empty(HEADER, dtype=torch.int32)
    while True:
        dist.broadcast(header, 0, group=control)
        command = Command(int(header[0]))
        payload = torch.empty(int(header[-1]), dtype=torch.int32)
        dist.broadcast(payload, 0, group=control)
        if command is Command.STOP:
            break
        if command is Command.SETUP:
            num_pages, page_size, use_flashinfer = payload.tolist()
            cache = KVCache(
                num_pages=num_pages,
                page_size=page_size,
                dtype=dtype,
                device=device,
                **spec.cache_kwargs(),
            )
            if use_flashinfer:
                from mstar.models.device import flashinfer_or_none

                flashinfer = flashinfer_or_none(str(device), model)
        elif command is Command.FORWARD:
            step = Forward(header, payload, cache.page_size)
            forward_step(
                model,
                step.input_ids.to(device),
                step.plan,
                cache,
                flashinfer=flashinfer,
                logits_at=step.logits_at,
            )
        else:
            cache.copy_pages(*read_copy(header, payload))
    dist.destroy_process_group()
