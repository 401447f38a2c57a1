"""Index arrays from views: ``build_paged_indptrs``'s checks and builders.

Every view is checked (integer fields, page ids, every value within int32)
and an invalid one is named by request and label; the arithmetic is
``index_arrays``'. A few rows are built on Python ints (a C-level pass a
column), more column-wise through numpy (``view_arrays`` picks). Also
``context_only_views``. ``plan`` re-exports the public names.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from itertools import repeat as _repeat
from typing import Any

import numpy as np

from mstar.engine.resources.kv.lengths import INT32_MAX, INT_TYPES, index_arrays

# A ``plan.SequenceView``'s fields, in order: (request_id, label, page_idxs,
# length, to_compute, start, generation); the helpers here unpack them.
ViewRow = tuple[str, str, Any, int, int, int, int]

_DTYPE = operator.attrgetter("dtype")


def check_page_size(page_size: int) -> None:
    if type(page_size) not in INT_TYPES or not 1 <= page_size <= INT32_MAX:
        raise ValueError(f"expected page_size an integer in [1, 2**31), got {page_size!r}")


def _int_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is no valid int32 count (None when it is)."""
    if type(value) not in INT_TYPES:
        return f"expected {name} an integer, got {value!r} ({type(value).__name__})"
    if not 0 <= value <= INT32_MAX:
        return f"expected {name} in [0, 2**31), got {value}"
    return None


def _pages_problem(pages: Any) -> str | None:
    """Why ``pages`` are no valid page ids (None when they are)."""
    if isinstance(pages, np.ndarray):
        if pages.ndim != 1 or pages.dtype.kind not in "iu":
            return f"expected page_idxs a 1-D integer array, got {pages.dtype} {pages.shape}"
        bad = (pages < 0) | (pages > INT32_MAX)
        return f"expected page indices in [0, 2**31), got {pages[bad][0]}" if bad.any() else None
    for page in pages:
        if type(page) not in INT_TYPES:
            return f"expected integer page indices, got {page!r} ({type(page).__name__})"
        if not 0 <= page <= INT32_MAX:
            return f"expected page indices in [0, 2**31), got {page}"
    return None


def _overflows(end: np.ndarray, room: np.ndarray, computed: np.ndarray, page_size: int) -> bool:
    """Whether an int32 result would overflow: an end, a ``kv_lens`` or the
    total of ``to_compute`` beyond 2**31 - 1 (int64 ``end`` and ``room``)."""
    kv_lens = np.maximum(room - page_size, 0)
    kv_lens += (end - 1) % page_size + 1
    return bool(
        end.max() > INT32_MAX
        or kv_lens.max() > INT32_MAX
        or computed.sum(dtype=np.int64) > INT32_MAX
    )


def _invalid_view(segments: Sequence[ViewRow], page_size: int) -> ValueError:
    """The error for the first invalid row of ``segments`` (the slow path,
    taken only once a builder's checks have failed)."""
    computed = 0
    for i, v in enumerate(segments):
        why = (
            _int_problem("length", v.length)
            or _int_problem("to_compute", v.to_compute)
            or _int_problem("start", v.start)
            or _pages_problem(v.page_idxs)
        )
        if why is None:
            # Python ints: sums of numpy scalars may wrap
            length, to_compute, start = int(v.length), int(v.to_compute), int(v.start)
            end = start + length
            need = -(-end // page_size)
            computed += to_compute
            if to_compute > length:
                why = (
                    f"expected to_compute <= length, got to_compute={to_compute} > length={length}"
                )
            elif len(v.page_idxs) < need:
                why = (
                    f"expected at least {need} pages for start + length = {end}"
                    f" at page_size {page_size}, got {len(v.page_idxs)}"
                )
            elif end > INT32_MAX:
                why = f"expected start + length < 2**31, got {start} + {length}"
            elif (
                kv := max(len(v.page_idxs) - 1, 0) * page_size + (end - 1) % page_size + 1
            ) > INT32_MAX:
                why = f"expected kv_lens < 2**31 (it is int32), got {kv}"
            elif computed > INT32_MAX:
                why = f"expected the plan's to_compute to total < 2**31, got {computed} by this row"
            else:
                continue
        return ValueError(
            f"invalid view for request {v.request_id!r}, label {v.label!r} (row {i}): {why}"
        )
    raise AssertionError("a builder's checks failed but no row is invalid")


def _page_ids(pages: Sequence, total: int) -> np.ndarray:
    """All rows' page ids concatenated, int32 [total]; ``ValueError`` if any
    is no integer or out of range (the caller then names the row)."""
    if pages and isinstance(pages[0], np.ndarray):
        try:
            dtypes = set(map(_DTYPE, pages))
        except AttributeError:  # lists among the arrays: checked as lists
            dtypes = {None}
        if dtypes == {np.dtype(np.int32)}:
            indices = np.concatenate(pages)  # the common case: no cast, no range check
        elif all(d is not None and d.kind in "iu" for d in dtypes):
            indices = np.concatenate(pages, dtype=np.int64, casting="same_kind")  # 2**63+: < 0
            if indices.size and (
                np.minimum.reduce(indices) < 0 or np.maximum.reduce(indices) > INT32_MAX
            ):
                raise ValueError("page ids out of range")
            indices = indices.astype(np.int32)
        else:
            indices = None
        if indices is not None:
            if indices.ndim != 1 or indices.size != total:
                raise ValueError("expected 1-D page_idxs")
            return indices
    if not INT_TYPES.issuperset(map(type, itertools.chain.from_iterable(pages))):
        raise ValueError("non-integer page ids")
    return np.fromiter(itertools.chain.from_iterable(pages), dtype=np.int32, count=total)


# Up to this many rows ``build_paged_indptrs`` works on Python ints: a numpy
# call has a fixed cost that C-level passes over a few rows undercut.
_FEW_ROWS = 32

# What the two builders return: (qo_indptr, paged_kv_indptr, paged_kv_indices,
# paged_kv_last_page_len) and kv_lens, int32 arrays.
_Arrays = tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def view_arrays(segments: Sequence[ViewRow], page_size: int) -> _Arrays:
    """``build_paged_indptrs``'s host arrays for ``segments`` (checked)."""
    if type(page_size) is not int or not 0 < page_size <= INT32_MAX:
        check_page_size(page_size)  # raises unless a numpy integer in range
        page_size = int(page_size)
    build = _arrays_by_row if len(segments) <= _FEW_ROWS else _arrays_by_column
    return build(segments, page_size)


def _arrays_by_row(segments: Sequence[ViewRow], page_size: int) -> _Arrays:
    """The arrays of a few rows on Python ints: each check one C-level pass
    over a column (no per-row Python, no numpy call per check), then
    ``index_arrays`` on lists (a value beyond int32 raises there)."""
    try:
        _, _, pages, length, to_compute, start, _ = zip(*segments) if segments else ((),) * 7
        lists = not (pages and isinstance(pages[0], np.ndarray))  # page lists: typed here too
        ints = itertools.chain(length, to_compute, start)
        types = set(map(type, itertools.chain(ints, *pages) if lists else ints))
        if types != {int}:  # numpy integers: as Python ints, so sums cannot wrap
            if not INT_TYPES.issuperset(types):
                raise ValueError("non-integer lengths or page ids")
            length, to_compute, start = (list(map(int, c)) for c in (length, to_compute, start))
        ends = list(map(operator.add, start, length))
        num_pages = list(map(len, pages))
        # _arrays_by_column's refusals: with the pages covering the end,
        # 0 <= to_compute <= length <= end <= kv_lens
        if segments and (
            min(itertools.chain(to_compute, start)) < 0
            or not all(map(operator.le, to_compute, length))
            or not all(map(operator.le, ends, map(operator.mul, num_pages, _repeat(page_size))))
        ):
            raise ValueError("invalid row")
        qo_indptr, kv_indptr, last, kv_lens = index_arrays(to_compute, num_pages, ends, page_size)
        total = int(kv_indptr[-1])
        if lists:  # typed above; beyond int32 raises
            indices = np.fromiter(itertools.chain(*pages), np.int32, total)
        else:
            indices = _page_ids(pages, total)
        if indices.size and np.minimum.reduce(indices) < 0:
            raise ValueError("negative page ids")
    except (ValueError, TypeError, OverflowError):
        raise _invalid_view(segments, page_size) from None
    return (qo_indptr, kv_indptr, indices, last), kv_lens


def _arrays_by_column(segments: Sequence[ViewRow], page_size: int) -> _Arrays:
    """The arrays column-wise through numpy: a handful of array ops whatever
    the batch. Their count is the cost at small batch (hence ufunc methods
    over their slower numpy wrappers)."""
    _, _, pages, length, to_compute, start, _ = zip(*segments) if segments else ((),) * 7
    try:
        if not INT_TYPES.issuperset(map(type, itertools.chain(length, start, to_compute))):
            raise ValueError("non-integer lengths")
        # out-of-range Python or numpy integers raise OverflowError here
        cols = np.array((length, start, to_compute), dtype=np.int32).reshape(3, -1)
        num_pages = np.fromiter(map(len, pages), dtype=np.int32, count=len(pages))
        indices = _page_ids(pages, int(np.add.reduce(num_pages, dtype=np.int64)))
    except (ValueError, TypeError, OverflowError):
        raise _invalid_view(segments, page_size) from None
    length, start, computed = cols
    end = np.add(length, start, dtype=np.int64)
    room = np.multiply(num_pages, page_size, dtype=np.int64)
    # With every row's pages covering its end, to_compute <= length <= end <=
    # room, so all pages * page_size < 2**31 rules out any int32 overflow.
    if segments and (
        min(
            np.minimum.reduce(cols, axis=None),
            np.minimum.reduce(length - computed),
            np.minimum.reduce(room - end),
        )
        < 0
        or (indices.size and np.minimum.reduce(indices) < 0)
        or (len(indices) * page_size > INT32_MAX and _overflows(end, room, computed, page_size))
    ):
        raise _invalid_view(segments, page_size)
    qo_indptr, kv_indptr, last, kv_lens = index_arrays(computed, num_pages, end, page_size)
    return (qo_indptr, kv_indptr, indices, last), kv_lens
