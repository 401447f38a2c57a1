"""The driver's step message, read back as a worker reads it: everything
``forward_step`` reads of a plan arrives (no processes here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.engine.resources.kv.cache import _write_slots
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.position import positions
from mstar.engine.resources.step import KVStep, Segment
from mstar.models.tp.wire import Command, Forward, copy_message, forward_message, read_copy

PAGE = 4


def plans(window: int | None):
    """Plans of a prefill, a mixed step and decode steps of three streams."""
    mgr = KVManager(64, PAGE, window=window)
    spans = [(9, 5, 14), (1, 3, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1)]
    for n, row in enumerate(spans):
        step = KVStep(tuple(Segment(f"r{i}", "main", s) for i, s in enumerate(row)))
        mgr.admit(step)
        yield n, mgr.plan(step)["main"]
        mgr.commit(step)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("keep", [True, False])
def test_a_worker_reads_the_plan_the_driver_sent(window, keep):
    seen_decode = seen_offsets = False
    for n, plan in plans(window):
        total = plan.get_total_len()
        ids = torch.arange(total) * 7 + n
        at = torch.tensor([total - 1, 0]) if keep else None
        header, payload = forward_message(ids, plan, at)
        assert header[0] == Command.FORWARD and header[-1] == len(payload)
        got = Forward(header, payload, PAGE)
        assert torch.equal(got.input_ids, ids)
        assert (got.logits_at is None) if at is None else torch.equal(got.logits_at, at)
        for mine, theirs in zip(got.plan.cpu_indptrs[:4], plan.cpu_indptrs[:4]):
            assert torch.equal(mine, theirs)
        assert np.array_equal(got.plan.cpu_indptrs.kv_lens, plan.cpu_indptrs.kv_lens)
        assert torch.equal(positions(got.plan), positions(plan))
        for mine, theirs in zip(_write_slots(got.plan, PAGE), _write_slots(plan, PAGE)):
            assert np.array_equal(mine, theirs)
        for name in ("decode_pages", "decode_offsets", "kv_offsets"):
            theirs = getattr(plan, name)
            mine = getattr(got.plan, name)
            assert (mine is None) if theirs is None else np.array_equal(mine, theirs)
        seen_decode |= plan.decode_pages is not None
        seen_offsets |= plan.kv_offsets is not None and bool(plan.kv_offsets.any())
        assert not got.plan.views_built
    assert seen_decode and seen_offsets == (window is not None)


def test_a_page_copy_arrives_as_sent():
    header, payload = copy_message(np.array([3, 1]), np.array([7, 8]))
    assert header[0] == Command.COPY
    src, dst = read_copy(header, payload)
    assert src.tolist() == [3, 1] and dst.tolist() == [7, 8]


def test_a_value_outside_int32_is_refused():
    with pytest.raises(ValueError, match="expected int32 values in a COPY message"):
        copy_message(np.array([2**31]), np.array([0]))
