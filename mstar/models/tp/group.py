"""The driver's end of a tensor-parallel group (rank 0 of ``size``).

The driver plans every step with its one ``KVManager``; ``forward_step``
broadcasts the step (``wire``) and runs it on its own shard while each
worker runs it on theirs, so the model's all-reduces meet; the logits come
back on the driver, which samples. Page copies of forks go to every rank.

Workers are spawned (torch.multiprocessing) and stopped by ``close``, by
the garbage collector or at exit; under ``torchrun`` the ranks exist
already and ranks other than 0 serve until the driver closes. A worker that
dies fails the next message, or the collective in flight, with
``WorkerFailed`` within seconds, and every later call the same way.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import KVPlanOutput
from mstar.models.hf import forward_step, supports
from mstar.models.tp import worker
from mstar.models.tp.wire import Command, Message, copy_message, forward_message, message

__all__ = ["BroadcastStats", "TensorParallel", "WorkerFailed"]

REAP_SECONDS = 2.0  # how long a failed collective waits for a dying worker to be reaped
JOIN_SECONDS = 10.0  # how long close waits for workers to stop before terminating them


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or a collective failed: the group cannot
    step any more (close the engine and start a new one)."""


@dataclass
class BroadcastStats:
    """The driver's messages: how many, their payload bytes, their seconds."""

    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Ranks:
    """What stopping the workers needs (kept apart from the group, so its
    finalizer holds no reference to it): the control group, the spawned
    processes, and why the group broke (None: it did not)."""

    control: Any
    procs: list[Any]
    error: str | None = None


class TensorParallel:
    """Rank 0 of ``size`` ranks: ``model`` is the driver's shard. Made by
    ``launch``; ``attach(cache, flashinfer)`` once, then ``forward_step``
    (the signature of ``mstar.models.hf.forward_step``) per plan and
    ``copy_pages`` for forks; ``close`` stops the workers."""

    def __init__(self, size: int, model: Any, control: Any, procs: list[Any], store: Any) -> None:
        self.size, self.model = size, model
        self.stats = BroadcastStats()
        self._ranks = _Ranks(control, procs)
        self._store = store  # the spawned ranks' rendezvous lives as long as the group
        self._cache: KVCache | None = None
        # close(), the garbage collector or the interpreter's exit, whichever comes first
        self._finalizer = weakref.finalize(self, _shutdown, self._ranks)

    @classmethod
    def launch(
        cls, folder: str, size: int, device: torch.device, dtype: torch.dtype
    ) -> TensorParallel:
        """Start ``size`` ranks on the model in ``folder`` (each loads its
        shard) and return rank 0. Under ``torchrun`` (``WORLD_SIZE`` set)
        joins its ranks instead of spawning; on a rank other than 0 this
        serves the driver and then exits the process."""
        if dist.is_initialized():
            raise RuntimeError(
                "expected no process group in this process, got one: one tensor-parallel"
                " engine per process at a time (close the other first)"
            )
        if "WORLD_SIZE" in os.environ:
            return cls._join_torchrun(folder, size, device, dtype)
        store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
            timeout=worker.STARTUP_TIMEOUT,
        )  # fmt: skip
        spawn = mp.get_context("spawn")
        args = (size, store.port, folder, dtype, device.type)
        procs = [
            spawn.Process(target=worker.run, args=(rank, *args), daemon=True, name=f"tp-rank{rank}")
            for rank in range(1, size)
        ]
        try:
            for proc in procs:
                proc.start()
            _wait_up(store, procs)
            control = worker.join(0, size, device, store)
            group = cls(size, None, control, procs, store)
        except BaseException:
            _shutdown(_Ranks(None, procs, error="failed to start"))
            raise
        try:
            group.model = group._run(lambda: _load_driver_shard(folder, dtype, control))
        except BaseException:
            group.close()
            raise
        return group

    @classmethod
    def _join_torchrun(
        cls, folder: str, size: int, device: torch.device, dtype: torch.dtype
    ) -> TensorParallel:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"expected tensor_parallel_size={world} (torchrun's WORLD_SIZE), got {size}"
            )
        local = int(os.environ.get("LOCAL_RANK", 0))
        here = torch.device("cuda", local) if device.type == "cuda" else device
        if device.type == "cuda":
            torch.cuda.set_device(local)
        control = worker.join(rank, size, device)
        if rank != 0:
            worker.serve(control, folder, dtype, here)
            sys.exit(0)
        group = cls(size, None, control, [], None)
        group.model = group._run(lambda: _load_driver_shard(folder, dtype, control))
        return group

    def attach(self, cache: KVCache, flashinfer: Any = None) -> TensorParallel:
        """Give every worker a cache like ``cache`` (its pages, its page
        size; their own heads) and FlashInfer when the driver has it. Returns
        the group, whose ``copy_pages`` serves as the ``KVManager``'s cache."""
        sizes = [cache.num_pages, cache.page_size, int(flashinfer is not None)]
        self._send(message(Command.SETUP, [], [np.asarray(sizes)]))
        self._cache = cache
        return self

    def forward_step(
        self,
        model: Any,
        input_ids: torch.Tensor,
        plan: KVPlanOutput,
        cache: KVCache,
        *,
        flashinfer: Any = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``mstar.models.hf.forward_step`` on every rank; the logits of the driver's."""
        self._send(forward_message(input_ids, plan, logits_at))
        return self._run(
            lambda: forward_step(
                model, input_ids, plan, cache, flashinfer=flashinfer, logits_at=logits_at
            )
        )

    def copy_pages(self, src: Any, dst: Any) -> None:
        """``KVCache.copy_pages`` on every rank (a fork's partial tail)."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        self._send(copy_message(src, dst))
        self._cache.copy_pages(src, dst)

    @property
    def pids(self) -> tuple[int, ...]:
        """The spawned workers' process ids (none under torchrun)."""
        return tuple(p.pid for p in self._ranks.procs)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the workers (politely, then by signal) and leave the process
        group. Idempotent."""
        self._finalizer()

    # --- failures ------------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        self._check()
        self._run(lambda: self._broadcast(msg))

    def _broadcast(self, msg: Message) -> None:
        t0 = time.perf_counter()
        for tensor in msg:
            dist.broadcast(tensor, 0, group=self._ranks.control)
        self.stats.messages += 1
        self.stats.bytes += msg[1].numel() * 4
        self.stats.seconds += time.perf_counter() - t0

    def _run(self, fn: Any) -> Any:
        """``fn()``; any failure (a collective, the forward) breaks the
        group: the ranks may be mid-step, and a worker may have died."""
        try:
            return fn()
        except BaseException as err:
            self._ranks.error = self._diagnose(err)
            if isinstance(err, Exception):
                raise WorkerFailed(self._ranks.error) from err
            raise

    def _check(self) -> None:
        if self.closed:
            raise WorkerFailed("expected a running tensor-parallel group, got a closed one")
        if self._ranks.error is None and any(not p.is_alive() for p in self._ranks.procs):
            self._ranks.error = self._diagnose(None)
        if self._ranks.error is not None:
            raise WorkerFailed(self._ranks.error)

    def _diagnose(self, err: BaseException | None) -> str:
        deadline = time.monotonic() + REAP_SECONDS
        while err is not None and time.monotonic() < deadline:
            if any(not p.is_alive() for p in self._ranks.procs):
                break
            time.sleep(0.05)
        dead = [p for p in self._ranks.procs if not p.is_alive()]
        if dead:
            what = ", ".join(f"{p.name} (pid {p.pid}) exited with code {p.exitcode}" for p in dead)
            return f"tensor-parallel worker {what}; the engine cannot step any more"
        return f"tensor-parallel step failed ({type(err).__name__}: {err}); the engine cannot step any more"


def _load_driver_shard(folder: str, dtype: torch.dtype, control: Any) -> Any:
    """This rank's shard, probed (``supports``: a forward with collectives)
    in step with the workers' ``kv_spec``, so whatever the engine refuses
    next finds the workers waiting for a message, not inside a forward."""
    model = worker.load_shard(folder, dtype)
    dist.barrier(group=control)  # every rank has read the folder
    supports(model)
    return model


def _wait_up(store: Any, procs: list[Any]) -> None:
    """Wait until every worker reached the store, failing at once if one dies first."""
    keys = [f"up{rank}" for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + worker.STARTUP_TIMEOUT.total_seconds()
    while not store.check(keys):
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise WorkerFailed(
                f"tensor-parallel worker {dead[0].name} exited with code {dead[0].exitcode}"
                " while starting"
            )
        if time.monotonic() > deadline:
            raise WorkerFailed(
                f"tensor-parallel workers did not start within {worker.STARTUP_TIMEOUT}"
            )
        time.sleep(0.05)


def _shutdown(ranks: _Ranks) -> None:
    """Tell healthy workers to stop and wait for them; terminate the rest;
    leave the process group."""
    if ranks.error is None and all(p.is_alive() for p in ranks.procs):
        try:  # a worker alive but stuck (in a collective) never takes STOP: bounded
            deadline = time.monotonic() + JOIN_SECONDS
            for tensor in message(Command.STOP, [], []):
                sent = dist.broadcast(tensor, 0, group=ranks.control, async_op=True)
                sent.wait(timeout=timedelta(seconds=max(0.1, deadline - time.monotonic())))
            for proc in ranks.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # they are terminated below
            pass
    _reap(ranks.procs)
    if dist.is_initialized():
        dist.destroy_process_group()


def _reap(procs: list[Any]) -> None:
    """Terminate the workers still running and wait for them."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
