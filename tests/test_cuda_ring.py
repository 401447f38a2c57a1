"""PinnedIndexRing on CUDA (CUDA only; the GPU check's second stage): its
buffers are page-locked, copies out of them are really asynchronous, and a
buffer set is rewritten only after the copies out of it have completed.

The GPU is kept busy with ``torch.cuda._sleep`` (a kernel that spins for a
number of clock cycles) so that a copy queued behind it is still pending
when the host looks."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.kv.plan import PinnedIndexRing
from mstar.engine.resources.step import KVStep, Segment

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BUSY_S = 0.3


@functools.cache
def _cycles_per_s() -> float:
    """The spin kernel's clock, measured after a warm-up that raises the
    clocks (CUDA 13 dropped ``clockRate``). Only a rough figure: the tests
    compare host times with the busy kernel's own measured length."""
    torch.cuda._sleep(200_000_000)  # about 0.1 s at full clock
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (start.elapsed_time(end) / 1e3)


class Busy:
    """A kernel keeping the current stream busy for about ``BUSY_S``;
    ``seconds()`` (after a synchronize) is how long it really ran."""

    def __init__(self) -> None:
        cycles = int(BUSY_S * _cycles_per_s())
        self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._start.record()
        torch.cuda._sleep(cycles)
        self._end.record()

    def seconds(self) -> float:
        return self._start.elapsed_time(self._end) / 1e3


def test_buffers_are_page_locked():
    ring = PinnedIndexRing(numel=8, depth=2, per_plan=1)
    ring.begin_plan()
    assert ring.take([1, 2, 3]).is_pinned()
    assert ring.take(list(range(100))).is_pinned()  # a set grown by a take
    assert ring.take(list(range(50_000))).is_pinned()  # a buffer grown for a long value


def test_copies_out_of_the_ring_do_not_wait_for_the_gpu():
    """A non-blocking copy from a ring buffer returns while the stream is
    busy and completes after it; one from pageable memory is printed beside it."""
    ring = PinnedIndexRing(numel=1 << 16, depth=2, per_plan=1)
    ring.begin_plan()
    values = list(range(1 << 16))
    src = ring.take(values)
    _cycles_per_s()
    torch.cuda.synchronize()
    busy = Busy()
    t0 = time.perf_counter()
    dst = src.to("cuda", non_blocking=True)
    enqueue_s = time.perf_counter() - t0
    done = torch.cuda.Event()
    done.record()
    assert not done.query(), "the copy finished while the GPU was busy: it did not queue"
    torch.cuda.synchronize()
    assert enqueue_s < busy.seconds() / 4, f"the copy call took {enqueue_s * 1e3:.1f} ms: it waited"
    assert dst.tolist() == values
    pageable = torch.tensor(values, dtype=torch.int32)
    Busy()
    t0 = time.perf_counter()
    pageable.to("cuda", non_blocking=True)
    print(
        f"copy call: pinned {enqueue_s * 1e6:.0f} µs, pageable {(time.perf_counter() - t0) * 1e6:.0f} µs"
    )
    torch.cuda.synchronize()


def test_a_set_is_rewritten_only_after_its_copies_completed():
    """Plan A's buffer is copied behind a busy kernel; two ``begin_plan``
    later (depth 2) the ring comes back to A's set: that call must wait for
    A's copy, so the GPU gets A's values, not the next plan's."""
    ring = PinnedIndexRing(numel=1 << 12, depth=2, per_plan=1)
    a_values = list(range(1 << 12))
    ring.begin_plan()
    a = ring.take(a_values)
    _cycles_per_s()
    torch.cuda.synchronize()
    busy = Busy()
    copied = a.to("cuda", non_blocking=True)  # queued behind the busy kernel
    ring.begin_plan()  # plan B: records the event that covers A's copy
    ring.take([0])
    t0 = time.perf_counter()
    ring.begin_plan()  # plan C: A's set again, after A's copy
    waited_s = time.perf_counter() - t0
    c = ring.take([-1] * len(a_values))
    assert c.data_ptr() == a.data_ptr()  # the same buffer, reused
    torch.cuda.synchronize()
    assert copied.tolist() == a_values, "the ring rewrote a buffer whose copy was pending"
    assert waited_s > busy.seconds() / 2, f"begin_plan returned after {waited_s * 1e3:.1f} ms"


def test_manager_plans_through_the_ring_copy_to_the_gpu():
    """A manager with a ring hands out plans whose index arrays are ring
    buffers (pinned), and they copy to the GPU as they read on the host."""
    mgr = KVManager(num_pages=64, page_size=4, ring=PinnedIndexRing(numel=64, depth=2))
    previous = None
    for spans in ([5, 9, 2], [1, 1, 1], [1, 3, 1]):
        step = KVStep(tuple(Segment(f"r{i}", "main", s) for i, s in enumerate(spans)))
        mgr.admit(step)
        plan = mgr.plan(step)["main"]
        host = plan.cpu_indptrs
        assert all(t.is_pinned() for t in host[:4])
        device = host.to_device("cuda")
        torch.cuda.synchronize()
        assert all(torch.equal(d.cpu(), h) for d, h in zip(device[:4], host[:4]))
        if previous is not None:  # the last plan's arrays are still intact (depth 2)
            assert [t.tolist() for t in previous[0]] == previous[1]
        previous = (host[:4], [t.tolist() for t in host[:4]])
        mgr.commit(step)
