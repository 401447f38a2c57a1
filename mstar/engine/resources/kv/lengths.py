"""Index arrays from lengths, and lengths back from index arrays.

The arithmetic every producer and reader of a plan's index arrays shares
(FlashInfer's conventions): a row whose pages hold tokens ``[0, end)`` of the
page space has ``last_page_len = (end - 1) % page_size + 1`` (``end %
page_size``, a full page reading as ``page_size``) and ``kv_lens = max(pages
- 1, 0) * page_size + last_page_len``. The manager and ``build_paged_indptrs``
build their arrays with ``index_arrays``; the cache's write slots, paged
attention and positions read rows back with ``row_lengths``.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np
import torch

INT32_MAX = 2**31 - 1
# The types an integer length, count or page id may have: Python int or a
# numpy integer (not bool).
INT_TYPES = frozenset(
    {int, *(t for t in np.sctypeDict.values() if issubclass(t, np.integer))} - {np.timedelta64}
)


class IndexArrays(NamedTuple):
    """int32 ``[B + 1]``, ``[B + 1]``, ``[B]``, ``[B]``."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    last_page_len: np.ndarray
    kv_lens: np.ndarray


def index_arrays(
    queries: list[int] | np.ndarray,
    num_pages: list[int] | np.ndarray,
    ends: list[int] | np.ndarray,
    page_size: int,
    exact: bool = False,
) -> IndexArrays:
    """The index arrays of rows with ``queries`` new tokens, ``num_pages``
    pages and ``ends`` tokens each (``end >= 0``, ``end <= num_pages *
    page_size``). Lists of Python ints (a few rows: per-row arithmetic costs
    less than numpy calls there) or integer arrays; a value beyond int32
    raises ``OverflowError`` from lists. ``exact``: each row holds just the
    pages of its end (the manager's rows), so ``kv_lens`` is ``max(end,
    last_page_len)``, one array op."""
    if isinstance(ends, list):  # one array, four views of it: one conversion
        last = [(end - 1) % page_size + 1 for end in ends]
        kv_lens = [(n - 1) * page_size + x if n else x for n, x in zip(num_pages, last)]
        b = len(ends)
        flat = np.array(
            [0, *accumulate(queries), 0, *accumulate(num_pages), *last, *kv_lens], np.int32
        )
        qo_indptr, kv_indptr = flat[: b + 1], flat[b + 1 : 2 * b + 2]
        return IndexArrays(qo_indptr, kv_indptr, flat[2 * b + 2 : 3 * b + 2], flat[3 * b + 2 :])
    b = len(ends)
    qo_indptr = np.zeros(b + 1, dtype=np.int32)
    np.add.accumulate(queries, out=qo_indptr[1:])
    kv_indptr = np.zeros(b + 1, dtype=np.int32)
    np.add.accumulate(num_pages, out=kv_indptr[1:])
    kv_lens = ends.astype(np.int32)
    last = kv_lens - 1
    last %= page_size
    last += 1
    if exact:
        np.maximum(kv_lens, last, out=kv_lens)
    else:
        kv_lens = np.maximum(num_pages, 1, dtype=np.int32)
        kv_lens -= 1
        kv_lens *= page_size
        kv_lens += last
    return IndexArrays(qo_indptr, kv_indptr, last, kv_lens)


class RowLengths(NamedTuple):
    """A plan's rows read back from its index tensors, int64 host arrays:
    ``qo_indptr`` and ``kv_indptr`` ``[B + 1]``, then per row its queries,
    pages and keys (``kv_lens``; 0 for a row of no pages)."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    queries: np.ndarray
    num_pages: np.ndarray
    kv_lens: np.ndarray


def row_lengths(indptrs: Any, page_size: int) -> RowLengths:
    """The rows of ``indptrs`` (a ``PagedIndptrs``, on any device)."""
    qo_indptr, kv_indptr = _host(indptrs.qo_indptr), _host(indptrs.paged_kv_indptr)
    num_pages = np.diff(kv_indptr)
    last = _host(indptrs.paged_kv_last_page_len)
    kv_lens = np.where(num_pages > 0, (num_pages - 1) * page_size + last, 0)
    return RowLengths(qo_indptr, kv_indptr, np.diff(qo_indptr), num_pages, kv_lens)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy().astype(np.int64)
