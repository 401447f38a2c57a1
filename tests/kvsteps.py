"""Test helpers for KVManager's tests: a token-per-slot fake cache and a
step run through admit -> plan -> commit."""

import numpy as np

from mstar.engine.resources.kv.plan import build_paged_indptrs
from mstar.engine.resources.step import KVStep, Segment


class CopyFailed(RuntimeError):
    pass


class TokenCache:
    """A fake KV cache holding a token id per slot, so a stream's pages can be
    read back and compared with the tokens it was given."""

    def __init__(self, num_pages, page_size):
        self.page_size = page_size
        self.slots = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.copies = []
        self.fail = False  # the next copy_pages raises CopyFailed

    def copy_pages(self, src, dst):
        if self.fail:
            self.fail = False
            raise CopyFailed("copy_pages failed")
        self.copies.append((list(src), list(dst)))
        self.slots[np.asarray(dst)] = self.slots[np.asarray(src)]

    def write(self, view, tokens):
        assert len(tokens) == view.to_compute
        for j, token in enumerate(tokens):
            pos = view.length - view.to_compute + j
            self.slots[view.page_idxs[pos // self.page_size], pos % self.page_size] = token

    def read(self, view, n):
        return [
            int(self.slots[view.page_idxs[p // self.page_size], p % self.page_size])
            for p in range(n)
        ]


def run_step(mgr, *segments, **kwargs):
    step = KVStep(segments=tuple(Segment(*s) for s in segments), **kwargs)
    mgr.admit(step)
    plans = mgr.plan(step)
    mgr.commit(step)
    return plans


def one_view(plans, request_id, label):
    for out in plans.values():
        for view in out.views:
            if (view.request_id, view.label) == (request_id, label):
                return view
    raise AssertionError(f"no view for {request_id}/{label}")


def snapshot(mgr, streams):
    return mgr.num_free_pages, [mgr.stored_len(r, label) for r, label in streams]


def decode_step(rows, label="main"):
    return KVStep(tuple(Segment(r, label, 1) for r in rows))


def assert_same_as_fresh_build(out, page_size):
    """A decode output equals the index arrays built from its own views."""
    views = out.views
    fresh = build_paged_indptrs(views, page_size)
    for a, b in zip(out.cpu_indptrs, fresh):
        assert a.tolist() == b.tolist()
    assert out.rows == [(v.request_id, v.label) for v in views]
    for view, page, offset in zip(views, out.decode_pages, out.decode_offsets):
        pos = view.length - 1
        assert (page, offset) == (view.page_idxs[pos // page_size], pos % page_size)
