"""The index builder: a plan label's index arrays and write slots from its rows.

After a step's pages are applied, each plan label's rows (slots, spans,
lengths, page counts) become the four index arrays (``index_arrays``), its
``paged_kv_indices`` and, for a step of decode rows, each row's write page
and offset; ``publish`` turns them into a ``KVPlanOutput`` (through the ring,
when there is one) whose views are built only if a consumer reads them.

Indices are the rows' page tables concatenated. From ``Paths.splice_rows``
rows on, a label's indices are spliced from its previous plan's: rows that
kept their place are copied in runs (one slice copy per run), and only rows
that are new or took a page read their page table. The previous arrays are
owned here and never written in place; ``forget`` drops them when pages they
name may have gone back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mstar.engine.resources.kv.lengths import index_arrays
from mstar.engine.resources.kv.paths import LEFT_AHEAD, Paths
from mstar.engine.resources.kv.plan import (
    KVPlanOutput,
    PinnedIndexRing,
    SequenceView,
    host_indptrs,
)
from mstar.engine.resources.kv.recycler import Recycler
from mstar.engine.resources.kv.streams import StreamTable

if TYPE_CHECKING:
    from mstar.engine.resources.kv.admission import Admitted


@dataclass(eq=False)
class _Index:
    """A plan label's last index arrays, what its next plan is spliced from."""

    slots: np.ndarray  # int64 [B]
    epochs: np.ndarray  # int64 [B]: the streams' epochs then (a new stream, a new epoch)
    num_pages: np.ndarray  # int64 [B]
    kv_indptr: np.ndarray  # int32 [B + 1]
    indices: np.ndarray  # int32 [kv_indptr[-1]]


class IndexBuilder:
    """Index arrays of plan labels over ``streams``; the labels' last
    indices, and the memory they are built in."""

    def __init__(
        self, streams: StreamTable, page_size: int, paths: Paths, window: int | None = None
    ) -> None:
        self.streams = streams
        self.page_size = page_size
        self.paths = paths
        self.window = window
        self._last: dict[str, _Index] = {}
        self._recycler = Recycler()

    def forget(self) -> None:
        """Splice no plan from the last ones (their pages may have gone back)."""
        self._last.clear()

    def arrays(self, plan_label: str, members: np.ndarray | None, rec: Admitted) -> tuple:
        """One plan label's arrays, after the step's pages are applied: (qo_indptr,
        kv_indptr, indices, last, kv_lens, ends, slots, spans, keys, write),
        ``write`` each row's (page, offset) for a step of decode rows, else
        None. ``members`` are the label's row numbers in the step (None: all, in order)."""
        slots, spans, ends, num_pages, keys = (
            rec.slots,
            rec.spans,
            rec.ends,
            rec.num_pages,
            rec.keys,
        )
        if members is not None:
            rows = members.tolist()
            keys = [keys[i] for i in rows]
            slots, spans = slots[members], spans[members]
            if rec.few:
                ends, num_pages = [ends[i] for i in rows], [num_pages[i] for i in rows]
            else:
                ends, num_pages = ends[members], num_pages[members]
        if rec.few:
            return self._few(slots, spans, ends, num_pages, keys)
        qo_indptr, kv_indptr, last, kv_lens = index_arrays(
            spans, num_pages, ends, self.page_size, exact=True
        )
        b = len(slots)
        if b < self.paths.splice_rows:
            indices = self._recycler.empty(int(kv_indptr[-1]))
            self._copy_rows(indices, slots.tolist(), num_pages.tolist(), kv_indptr.tolist())
        else:
            indices = self._splice(plan_label, slots, num_pages, kv_indptr)
        write = None
        if b and int(qo_indptr[-1]) == b and np.maximum.reduce(spans) == 1:  # decode rows
            write = indices[kv_indptr[1:] - 1].astype(np.int64), (last - 1).astype(np.int64)
        return qo_indptr, kv_indptr, indices, last, kv_lens, ends, slots, spans, keys, write

    def _few(self, slots, spans, ends: list, num_pages: list, keys) -> tuple:
        """``arrays`` for a few rows, on Python ints: per-row arithmetic
        costs less than numpy calls there."""
        queries = spans.tolist()
        qo_indptr, kv_indptr, last, kv_lens = index_arrays(queries, num_pages, ends, self.page_size)
        starts = kv_indptr.tolist()
        indices = self._recycler.empty(starts[-1])
        self._copy_rows(indices, slots.tolist(), num_pages, starts)
        write = None
        if ends and queries.count(1) == len(queries):  # decode rows: one conversion
            pages = [indices.item(d - 1) for d in starts[1:]]
            offsets = [n - 1 for n in last.tolist()]
            write_pages, offsets, ends = np.array([pages, offsets, ends], np.int64)
            write = write_pages, offsets
        else:
            ends = np.array(ends, np.int64)
        return qo_indptr, kv_indptr, indices, last, kv_lens, ends, slots, spans, keys, write

    def publish(self, arrays: tuple, ring: PinnedIndexRing | None) -> KVPlanOutput:
        """A label's ``KVPlanOutput`` from its ``arrays``: tensors (ring
        buffers, with a ring) and a lazy view builder."""
        qo_indptr, kv_indptr, indices, last, kv_lens, ends, slots, spans, keys, write = arrays
        decode_pages, decode_offsets = write or (None, None)
        starts = offsets = None
        if self.window is not None:  # the first key each row's window reaches
            starts = np.maximum(ends - spans - (self.window - 1), 0)
            offsets = self.streams.base[slots]
        gens = self.streams.gen[slots]
        out = KVPlanOutput(
            host_indptrs((qo_indptr, kv_indptr, indices, last), kv_lens, ring),
            decode_pages=decode_pages,
            decode_offsets=decode_offsets,
            rows=keys,
            view_builder=_Views(keys, indices, kv_indptr, ends, spans, gens, starts),
        )
        out.kv_offsets = offsets
        return out

    def _splice(
        self, plan_label: str, slots: np.ndarray, num_pages: np.ndarray, kv_indptr: np.ndarray
    ) -> np.ndarray:
        """The label's ``paged_kv_indices``: runs of rows that sit in the
        label's previous indices in the same order are one slice copy each;
        pages not there (a new row's, a row's new pages) come from its table."""
        out = self._recycler.empty(int(kv_indptr[-1]))
        epochs = self.streams.epoch[slots]
        prev = self._last.get(plan_label)
        if prev is None:
            copied = np.zeros(len(slots), np.int64)
        elif (
            len(slots) - (kept := _kept_rows(prev, slots, epochs, num_pages))[1]
            <= self.paths.tail_rows
        ):
            self._splice_kept(prev, *kept, out, slots, num_pages, kv_indptr)
            self._last[plan_label] = _Index(slots, epochs, num_pages, kv_indptr, out)
            return out
        else:
            copied = self._splice_runs(prev, out, slots, epochs, num_pages, kv_indptr)
        rest = (copied < num_pages).nonzero()[0]
        tables = self.streams.tables
        for slot, a, b, d in zip(
            slots[rest].tolist(),
            copied[rest].tolist(),
            num_pages[rest].tolist(),
            kv_indptr[rest].tolist(),
        ):
            out[d + a : d + b] = tables[slot][a:b]
        self._last[plan_label] = _Index(slots, epochs, num_pages, kv_indptr, out)
        return out

    def _splice_runs(self, prev: _Index, out, slots, epochs, num_pages, kv_indptr) -> np.ndarray:
        """Copy into ``out`` each run of rows found in ``prev`` in the same
        order (the pages each had then); returns the pages copied per row."""
        where = np.full(len(self.streams.epoch), -1, dtype=np.int64)
        where[prev.slots] = np.arange(len(prev.slots))
        old = where[slots]
        valid = old >= 0
        valid &= prev.epochs[old] == epochs
        had = np.where(valid, prev.num_pages[old], 0)
        copied = np.minimum(had, num_pages)
        # Row i extends row i - 1's run when both copy from consecutive old
        # rows and row i - 1 was copied whole into a row of the same size.
        cont = valid[1:] & valid[:-1]
        cont &= old[1:] == old[:-1] + 1
        cont &= copied[:-1] == had[:-1]
        cont &= copied[:-1] == num_pages[:-1]
        heads = np.concatenate(([0], (~cont).nonzero()[0] + 1))
        csum = np.zeros(len(slots) + 1, np.int64)
        np.add.accumulate(copied, out=csum[1:])
        lens = csum[np.append(heads[1:], len(slots))] - csum[heads]
        run = lens.nonzero()[0]
        src = prev.kv_indptr[old[heads[run]]].tolist()
        dst = kv_indptr[heads[run]].tolist()
        for s, d, n in zip(src, dst, lens[run].tolist()):
            out[d : d + n] = prev.indices[s : s + n]
        return copied

    def _splice_kept(self, prev: _Index, d: int, k: int, out, slots, num_pages, kv_indptr) -> None:
        """``_splice`` when the first ``k`` rows are the previous plan's rows
        ``[d, d + k)`` (see ``_kept_rows``) and the rest are few: the old
        indices in runs between rows that took pages, each such row's new
        pages and each later row's pages from its table."""
        had = prev.num_pages[d : d + k]
        grown = (num_pages[:k] != had).nonzero()[0]
        old, tables = prev.indices, self.streams.tables
        src, dst = int(prev.kv_indptr[d]), 0
        for end, slot, a, b, stop in zip(
            prev.kv_indptr[grown + d + 1].tolist(),
            slots[grown].tolist(),
            had[grown].tolist(),
            num_pages[grown].tolist(),
            kv_indptr[grown + 1].tolist(),
        ):
            out[dst : dst + end - src] = old[src:end]
            dst += end - src
            out[dst:stop] = tables[slot][a:b]
            src, dst = end, stop
        end = int(prev.kv_indptr[d + k])
        out[dst : dst + end - src] = old[src:end]
        self._copy_rows(out, slots[k:].tolist(), num_pages[k:].tolist(), kv_indptr[k:].tolist())

    def _copy_rows(self, out: np.ndarray, slots: list, num_pages: list, starts: list) -> None:
        """Each row's pages from its table into ``out`` at its start."""
        tables = self.streams.tables
        for slot, n, start in zip(slots, num_pages, starts):
            out[start : start + n] = tables[slot][:n]


class _Views:
    """Builds a plan's views on first use, from that plan's own arrays (a
    plain class, not a closure, so nothing else of the manager is held).
    ``ends`` are the rows' page-space ends; ``starts`` (None: all 0) the
    slot of each row's first key its window reaches."""

    def __init__(self, keys, indices, kv_indptr, ends, spans, generations, starts=None):
        self.args = (keys, indices, kv_indptr, ends, spans, generations, starts)

    def __call__(self) -> list[SequenceView]:
        keys, indices, kv_indptr, ends, spans, generations, starts = self.args
        bounds = kv_indptr.tolist()
        starts = [0] * len(keys) if starts is None else starts.tolist()
        return [
            SequenceView(request_id, label, indices[a:b].tolist(), end - start, span, start, gen)
            for (request_id, label), a, b, end, span, gen, start in zip(
                keys,
                bounds,
                bounds[1:],
                ends.tolist(),
                spans.tolist(),
                generations.tolist(),
                starts,
            )
        ]


def _kept_rows(prev: _Index, slots, epochs, num_pages) -> tuple[int, int]:
    """``(d, k)``: the first ``k`` rows are the previous plan's rows ``[d, d +
    k)`` (a few ahead of them may have left), on the same streams, each with
    at least the pages it had."""
    ahead = (prev.slots[: LEFT_AHEAD + 1] == slots[:1]).nonzero()[0] if len(slots) else ()
    if not len(ahead):
        return 0, 0
    d = int(ahead[0])
    m = min(len(prev.slots) - d, len(slots))
    kept = prev.slots[d : d + m] == slots[:m]
    kept &= prev.epochs[d : d + m] == epochs[:m]
    kept &= num_pages[:m] >= prev.num_pages[d : d + m]
    return d, m if kept.all() else int(kept.argmin())
