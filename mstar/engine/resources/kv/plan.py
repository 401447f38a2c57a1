"""The KV plan: what ``KVManager.plan`` hands its dependents.

Attention and positions read this and nothing else of the KV resource — the
packed ordering, one view per (request, label) stream, and the index tensors a
paged-attention wrapper plans against. Kept apart from the manager so a
consumer depends on the contract rather than on the cache.

Conventions (FlashInfer's): every index tensor is int32 and built on the CPU; a
row's pages, in order, hold tokens ``[start, start + length)`` of the page
space, so its last page holds ``(start + length) % page_size`` tokens (0: full).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from mstar.engine.resources.step import Segment

_INT32_MAX = 2**31 - 1
_DTYPE = operator.attrgetter("dtype")
# The types an integer field may have: Python int or a numpy integer (not bool).
_INT_TYPES = frozenset(
    {int, *(t for t in np.sctypeDict.values() if issubclass(t, np.integer))} - {np.timedelta64}
)

__all__ = [
    "HostLens",
    "KVPlanOutput",
    "KVPlanOutputs",
    "PagedIndptrs",
    "PinnedIndexRing",
    "SequenceView",
    "build_paged_indptrs",
    "context_only_views",
    "group_by_plan_label",
]


class HostLens(torch.Tensor):
    """A host int32 row whose iteration yields numpy scalars.

    FlashInfer's decode plan takes the longest row with the builtin ``max()``
    and calls ``.item()`` on the result; iterating a tensor hands out one 0-d
    tensor per row (about 2 us each, on the plan thread every decode step).
    Iterating the numpy view costs about 0.1 us a row, and a numpy scalar has
    ``.item()`` too. Everything else (``.cpu()``, ``.min()``, ``len``, indexing,
    ``copy_``) is plain tensor behaviour: operations return plain tensors.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, data: Any = ()) -> HostLens:
        """Wrap ``data`` as int32 on the host; an int32 numpy row is not copied."""
        values = np.ascontiguousarray(data, dtype=np.int32).reshape(-1)
        return torch.Tensor._make_subclass(cls, torch.from_numpy(values))

    def __iter__(self):
        return iter(self.numpy())

    def __deepcopy__(self, memo: dict) -> HostLens:
        return HostLens(self.numpy().copy())


class SequenceView(NamedTuple):
    """One (request, label) stream as this step sees it.

    A NamedTuple because it is built per segment per step and never mutated.
    ``length`` is the tokens resident after this step (already stored +
    ``to_compute``); ``page_idxs`` (a list of ints, or a 1-D integer numpy array)
    are the pages holding tokens ``[start, start + length)`` of the page space;
    ``generation`` changes whenever the stream's pages or length change.
    """

    request_id: str
    label: str
    page_idxs: list[int]
    length: int
    to_compute: int
    start: int = 0
    generation: int = 0

    def last_page_len(self, page_size: int) -> int:
        """Tokens in the last page: ``(start + length) % page_size``, 0 meaning full."""
        return (self.start + self.length) % page_size


class PagedIndptrs(NamedTuple):
    """The four int32 index tensors a FlashInfer prefill/decode wrapper's plan
    consumes, built on CPU (so ``wrapper.plan``'s ``.to("cpu")`` is a no-op).

    Shapes for ``B`` rows: ``qo_indptr`` and ``paged_kv_indptr`` ``[B + 1]``,
    ``paged_kv_indices`` ``[paged_kv_indptr[-1]]``, ``paged_kv_last_page_len``
    ``[B]`` (each in ``[1, page_size]``). ``kv_lens`` ``[B]`` is a host
    ``HostLens``: FlashInfer's ``max(num_pages - 1, 0) * page_size + last``.
    """

    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor | None = None

    def to_device(self, device: torch.device | str) -> PagedIndptrs:
        """The four index tensors copied to ``device`` (``non_blocking``);
        ``kv_lens`` stays on the host, where plan-time code reads it."""
        return PagedIndptrs(*(t.to(device, non_blocking=True) for t in self[:4]), self.kv_lens)

    def to_kwargs_dict(self) -> dict[str, torch.Tensor | None]:
        """All five fields by name."""
        return self._asdict()


class PinnedIndexRing:
    """A ring of page-locked int32 host buffers for the index arrays a plan
    hands FlashInfer, so its ``copy_(non_blocking=True)`` calls are really
    asynchronous (from pageable memory the driver stages each one).

    The ring holds ``depth`` buffer sets, one per plan. ``begin_plan`` moves to
    the next set, and each ``take`` until the next ``begin_plan`` fills a buffer
    of that set no other take uses (the set grows if needed), so every label of
    a plan keeps its arrays however many labels there are. A set is rewritten
    only after the copies out of it have completed: ``begin_plan`` records an
    event on the current stream for the set just used, and a set waits on its
    own event before reuse. Without CUDA the buffers are plain tensors and
    nothing is recorded.
    """

    def __init__(self, numel: int = 4096, depth: int = 2, per_plan: int = 4) -> None:
        for name, value in (("numel", numel), ("depth", depth), ("per_plan", per_plan)):
            if value < 1:
                raise ValueError(f"expected {name} >= 1, got {value}")
        self._numel = numel
        self._pinned = torch.cuda.is_available()
        # Each buffer is kept with its numpy view, so a take is one numpy copy.
        self._sets = [[self._alloc(numel) for _ in range(per_plan)] for _ in range(depth)]
        self._events: list[Any] = [None] * depth
        self._current: int | None = None
        self._used = 0

    def _alloc(self, numel: int) -> tuple[torch.Tensor, np.ndarray]:
        buf = torch.empty(numel, dtype=torch.int32, pin_memory=self._pinned)
        return buf, buf.numpy()

    def begin_plan(self) -> None:
        """Start a plan: move to the next buffer set, waiting until the copies
        out of its last use have completed. A set no take has written since
        the last ``begin_plan`` (a plan refused before its arrays, or one
        ``discard_plan`` dropped) is reused instead: it holds nothing a
        handed-out plan reads."""
        if self._current is not None and self._used == 0:
            return
        if self._current is not None and self._pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[self._current] = event
        self._current = 0 if self._current is None else (self._current + 1) % len(self._sets)
        self._used = 0
        event = self._events[self._current]
        if event is not None:
            event.synchronize()
            self._events[self._current] = None

    def discard_plan(self) -> None:
        """The plan begun last will not be handed out (it failed after some
        takes): the next ``begin_plan`` reuses its buffer set, so the plan
        before it keeps its arrays."""
        self._used = 0

    def take(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Copy ``values`` into a buffer no other take of this plan uses and
        return an int32 view of exactly ``len(values)``. Values must be
        integers (Python ``int`` or numpy integer, not bool) in int32 range:
        anything else raises ``ValueError`` and takes nothing."""
        if not isinstance(values, np.ndarray) or values.dtype != np.int32 or values.ndim != 1:
            values = _int32_values(values)
        if self._current is None:
            self.begin_plan()
        n = len(values)
        buffers = self._sets[self._current]
        if self._used == len(buffers):
            buffers.append(self._alloc(max(self._numel, n)))
        buf, arr = buffers[self._used]
        if n > arr.size:
            buffers[self._used] = buf, arr = self._alloc(max(n, 2 * arr.size))
        self._used += 1
        arr[:n] = values
        return buf[:n]


def _int32_values(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """``values`` as a 1-D int32 array, or ``ValueError`` naming the first
    value that is no integer or out of int32 range."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ValueError(f"expected a 1-D integer array, got {values.dtype} {values.shape}")
        if values.size and (
            np.minimum.reduce(values) < -_INT32_MAX - 1 or np.maximum.reduce(values) > _INT32_MAX
        ):
            i = int(np.flatnonzero((values < -_INT32_MAX - 1) | (values > _INT32_MAX))[0])
            raise ValueError(f"expected int32 values, got {values[i]} at index {i}")
        return values.astype(np.int32)
    values = list(values)
    if _INT_TYPES.issuperset(map(type, values)):
        try:
            return np.array(values, dtype=np.int32)
        except OverflowError:
            pass
    for i, v in enumerate(values):
        if type(v) not in _INT_TYPES:
            raise ValueError(
                f"expected integer values, got {v!r} ({type(v).__name__}) at index {i}"
            )
        if not -_INT32_MAX - 1 <= v <= _INT32_MAX:
            raise ValueError(f"expected int32 values, got {v} at index {i}")
    raise AssertionError("int32 conversion failed but every value is valid")


def _check_page_size(page_size: int) -> None:
    if type(page_size) not in _INT_TYPES or not 1 <= page_size <= _INT32_MAX:
        raise ValueError(f"expected page_size an integer in [1, 2**31), got {page_size!r}")


def _int_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is no valid int32 count (None when it is)."""
    if type(value) not in _INT_TYPES:
        return f"expected {name} an integer, got {value!r} ({type(value).__name__})"
    if not 0 <= value <= _INT32_MAX:
        return f"expected {name} in [0, 2**31), got {value}"
    return None


def _pages_problem(pages: Any) -> str | None:
    """Why ``pages`` are no valid page ids (None when they are)."""
    if isinstance(pages, np.ndarray):
        if pages.ndim != 1 or pages.dtype.kind not in "iu":
            return f"expected page_idxs a 1-D integer array, got {pages.dtype} {pages.shape}"
        bad = (pages < 0) | (pages > _INT32_MAX)
        return f"expected page indices in [0, 2**31), got {pages[bad][0]}" if bad.any() else None
    for page in pages:
        if type(page) not in _INT_TYPES:
            return f"expected integer page indices, got {page!r} ({type(page).__name__})"
        if not 0 <= page <= _INT32_MAX:
            return f"expected page indices in [0, 2**31), got {page}"
    return None


def _overflows(end: np.ndarray, room: np.ndarray, computed: np.ndarray, page_size: int) -> bool:
    """Whether an int32 result would overflow: an end, a ``kv_lens`` or the
    total of ``to_compute`` beyond 2**31 - 1 (int64 ``end`` and ``room``)."""
    kv_lens = np.maximum(room - page_size, 0)
    kv_lens += (end - 1) % page_size + 1
    return bool(
        end.max() > _INT32_MAX
        or kv_lens.max() > _INT32_MAX
        or computed.sum(dtype=np.int64) > _INT32_MAX
    )


def _invalid_view(segments: Sequence[SequenceView], page_size: int) -> ValueError:
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
            elif end > _INT32_MAX:
                why = f"expected start + length < 2**31, got {start} + {length}"
            elif (
                kv := max(len(v.page_idxs) - 1, 0) * page_size + (end - 1) % page_size + 1
            ) > _INT32_MAX:
                why = f"expected kv_lens < 2**31 (it is int32), got {kv}"
            elif computed > _INT32_MAX:
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
                np.minimum.reduce(indices) < 0 or np.maximum.reduce(indices) > _INT32_MAX
            ):
                raise ValueError("page ids out of range")
            indices = indices.astype(np.int32)
        else:
            indices = None
        if indices is not None:
            if indices.ndim != 1 or indices.size != total:
                raise ValueError("expected 1-D page_idxs")
            return indices
    if not _INT_TYPES.issuperset(map(type, itertools.chain.from_iterable(pages))):
        raise ValueError("non-integer page ids")
    return np.fromiter(itertools.chain.from_iterable(pages), dtype=np.int32, count=total)


def build_paged_indptrs(
    segments: list[SequenceView], page_size: int, ring: PinnedIndexRing | None = None
) -> PagedIndptrs:
    """The index tensors for ``segments`` (one row each, in order).

    ``qo_indptr`` is the running sum of ``to_compute`` from 0,
    ``paged_kv_indptr`` that of ``len(page_idxs)``, ``paged_kv_indices`` all
    ``page_idxs`` concatenated, ``paged_kv_last_page_len`` each row's
    ``last_page_len(page_size) or page_size``, ``kv_lens`` (a ``HostLens``)
    ``max(num_pages - 1, 0) * page_size + last``. All int32 on the CPU; with a
    ``ring`` the four index tensors are ring buffers. Lengths, starts and page
    ids must be integers (Python ``int`` or numpy integer, not bool; page ids
    a list or a 1-D integer array) and every value must fit int32; an invalid
    view raises ``ValueError`` naming the row's request and label.
    """
    if type(page_size) is not int or not 0 < page_size <= _INT32_MAX:
        _check_page_size(page_size)  # raises unless a numpy integer in range
        page_size = int(page_size)
    build = _arrays_by_row if len(segments) <= _FEW_ROWS else _arrays_by_column
    arrays, kv_lens = build(segments, page_size)
    if ring is None:
        tensors = [torch.from_numpy(a) for a in arrays]
    else:
        tensors = [ring.take(a) for a in arrays]
    return PagedIndptrs(*tensors, HostLens(kv_lens))


# Up to this many rows ``build_paged_indptrs`` works row by row on Python ints:
# a row costs under a microsecond there against a few tenths column-wise, but
# the column-wise route's 25 or so numpy ops cost about 30 us whatever the
# batch. Measured, the two meet at about 36-40 rows.
_FEW_ROWS = 32

# What the two builders return: (qo_indptr, paged_kv_indptr, paged_kv_indices,
# paged_kv_last_page_len) as int32 arrays, and kv_lens (int32 array or list).
_Arrays = tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], Any]


def _arrays_by_row(segments: Sequence[SequenceView], page_size: int) -> _Arrays:
    """``build_paged_indptrs``'s arrays for a few rows: the arithmetic and
    checks on Python ints, then one ``np.array`` per column."""
    qo, kv_indptr, last, kv_lens, pages = [0], [0], [], [], []
    queries = total_pages = 0
    try:
        for _, _, row_pages, length, to_compute, start, _ in segments:
            if not (
                type(length) in _INT_TYPES
                and type(to_compute) in _INT_TYPES
                and type(start) in _INT_TYPES
            ):
                raise ValueError("non-integer lengths")
            length, to_compute, start = int(length), int(to_compute), int(start)
            num_pages = len(row_pages)
            end = start + length
            row_last = (end - 1) % page_size + 1  # (start + length) % page_size or page_size
            row_kv_len = max(num_pages - 1, 0) * page_size + row_last
            queries += to_compute
            total_pages += num_pages
            # _arrays_by_column's refusals: with the pages covering the end,
            # 0 <= to_compute <= length <= end <= row_kv_len < 2**31
            if not (
                0 <= to_compute <= length
                and start >= 0
                and end <= num_pages * page_size
                and row_kv_len <= _INT32_MAX
                and queries <= _INT32_MAX
            ):
                raise ValueError("invalid row")
            qo.append(queries)
            kv_indptr.append(total_pages)
            last.append(row_last)
            kv_lens.append(row_kv_len)
            pages.append(row_pages)
        indices = _page_ids(pages, total_pages)
        if indices.size and np.minimum.reduce(indices) < 0:
            raise ValueError("negative page ids")
    except (ValueError, TypeError, OverflowError):
        raise _invalid_view(segments, page_size) from None
    qo, kv_indptr, last = (np.array(a, dtype=np.int32) for a in (qo, kv_indptr, last))
    return (qo, kv_indptr, indices, last), kv_lens


def _arrays_by_column(segments: Sequence[SequenceView], page_size: int) -> _Arrays:
    """``build_paged_indptrs``'s arrays column-wise through numpy: a handful
    of array ops whatever the batch. Each op costs about a microsecond, so
    their count is the cost at small batch (hence ufunc methods over their
    slower numpy wrappers)."""
    _, _, pages, length, to_compute, start, _ = zip(*segments) if segments else ((),) * 7
    try:
        if not _INT_TYPES.issuperset(map(type, itertools.chain(length, start, to_compute))):
            raise ValueError("non-integer lengths")
        # out-of-range Python or numpy integers raise OverflowError here
        cols = np.array((length, start, to_compute), dtype=np.int32).reshape(3, -1)
        counts = np.fromiter(itertools.chain((0,), map(len, pages)), dtype=np.int32)
        kv_indptr = np.add.accumulate(counts, dtype=np.int32)
        indices = _page_ids(pages, int(kv_indptr[-1]))
    except (ValueError, TypeError, OverflowError):
        raise _invalid_view(segments, page_size) from None
    length, start, computed = cols
    qo_indptr = np.zeros(len(segments) + 1, dtype=np.int32)
    np.add.accumulate(computed, out=qo_indptr[1:])
    num_pages = counts[1:]
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
        or (
            int(kv_indptr[-1]) * page_size > _INT32_MAX
            and _overflows(end, room, computed, page_size)
        )
    ):
        raise _invalid_view(segments, page_size)
    last = end.astype(np.int32)
    last -= 1
    last %= page_size
    last += 1  # (start + length) % page_size or page_size
    kv_lens = num_pages - 1
    np.maximum(kv_lens, 0, out=kv_lens)
    kv_lens *= page_size
    kv_lens += last
    return (qo_indptr, kv_indptr, indices, last), kv_lens


def context_only_views(
    views: list[SequenceView], query_spans: list[int], page_size: int
) -> list[SequenceView]:
    """The views of a step's streams without the tokens the step appends:
    length shrinks by ``to_compute`` (the pages beyond it dropped; a row that
    stored nothing keeps none) and ``to_compute`` becomes the row's query
    count. For attention over the stored context alone."""
    if len(views) != len(query_spans):
        raise ValueError(f"expected one query span per view ({len(views)}), got {len(query_spans)}")
    _check_page_size(page_size)
    out = []
    for v, queries in zip(views, query_spans):
        stored = v.length - v.to_compute
        keep = -(-(v.start + stored) // page_size) if stored > 0 else 0
        out.append(v._replace(page_idxs=v.page_idxs[:keep], length=stored, to_compute=queries))
    return out


def group_by_plan_label(
    segments: tuple[Segment, ...], combined_labels: dict[tuple[str, ...], str]
) -> dict[str, list[Segment]]:
    """Segments per plan label, in the order of the packed forward.

    A combined plan label (a value of ``combined_labels``) concatenates its
    source labels' segments label-major: all of the first source in batch
    order, then the second... Labels in no key stay standalone, in batch order.
    Combined labels come first (in ``combined_labels`` order), then standalone
    ones in order of first appearance. KV is the sole producer of this
    ordering; everyone else reads it from the plan.

    A combined key with a source label that has no segments in the step raises
    ``KeyError``; a label in two keys, or a plan label that collides with
    another, raises ``ValueError``.
    """
    by_label: dict[str, list[Segment]] = {}
    for seg in segments:
        by_label.setdefault(seg.label, []).append(seg)
    out: dict[str, list[Segment]] = {}
    sources: set[str] = set()
    for key, plan_label in combined_labels.items():
        merged: list[Segment] = []
        for label in key:
            if label in sources:
                raise ValueError(f"expected each label in one combined key, got {label!r} twice")
            sources.add(label)
            if label not in by_label:
                raise KeyError(
                    f"combined label {plan_label!r} = {key!r}: source label {label!r}"
                    " has no segments in this step"
                )
            merged.extend(by_label[label])
        if plan_label in out:
            raise ValueError(f"expected distinct plan labels, got {plan_label!r} twice")
        out[plan_label] = merged
    for label, segs in by_label.items():
        if label in sources:
            continue
        if label in out:
            raise ValueError(
                f"expected plan label {label!r} to be either combined or standalone, got both"
            )
        out[label] = segs
    return out


class KVPlanOutput:
    """Output of ``KVManager.plan`` for a single plan label.

    ``views`` are built at most once, on first access, when only a
    ``view_builder`` (a zero-argument callable) was given: the hot path never
    pays for them. A builder's views start at 0 (``start == 0``), so until
    they are built positions are read from the index arrays. ``rows`` is each row's ``(request_id, label)`` in plan
    order. ``decode_pages``/``decode_offsets`` (numpy int64 ``[B]``), when
    given, are each row's write page and offset within it.
    """

    __slots__ = (
        "cpu_indptrs",
        "cuda_indptrs",
        "decode_pages",
        "decode_offsets",
        "_rows",
        "_views",
        "_view_builder",
    )

    def __init__(
        self,
        cpu_indptrs: PagedIndptrs,
        views: list[SequenceView] | None = None,
        cuda_indptrs: PagedIndptrs | None = None,
        decode_pages: np.ndarray | None = None,
        decode_offsets: np.ndarray | None = None,
        rows: list[tuple[str, str]] | None = None,
        view_builder: Callable[[], list[SequenceView]] | None = None,
    ) -> None:
        if views is None and view_builder is None:
            raise ValueError("expected views or a view_builder, got neither")
        self.cpu_indptrs = cpu_indptrs
        self.cuda_indptrs = cuda_indptrs
        self.decode_pages = decode_pages
        self.decode_offsets = decode_offsets
        self._rows = rows
        self._views = views
        self._view_builder = view_builder

    @property
    def views(self) -> list[SequenceView]:
        if self._views is None:
            self._views = self._view_builder()
            self._view_builder = None
        return self._views

    @property
    def views_built(self) -> bool:
        """Whether ``views`` exist yet (reading them builds nothing)."""
        return self._views is not None

    @property
    def rows(self) -> list[tuple[str, str]]:
        if self._rows is None:
            self._rows = [(v.request_id, v.label) for v in self.views]
        return self._rows

    def get_total_len(self) -> int:
        """Query tokens in this plan: ``qo_indptr[-1]``."""
        return int(self.cpu_indptrs.qo_indptr[-1])

    @property
    def is_decode(self) -> bool:
        """True when every row computes exactly one token (read from
        ``qo_indptr``; never builds views)."""
        if self.decode_pages is not None:
            return True
        return bool(np.all(np.diff(self.cpu_indptrs.qo_indptr.numpy()) == 1))

    def __repr__(self) -> str:
        rows = len(self.cpu_indptrs.qo_indptr) - 1
        return f"KVPlanOutput(rows={rows}, tokens={self.get_total_len()}, decode={self.is_decode})"


class KVPlanOutputs(dict[str, KVPlanOutput]):
    """Plan label -> output, plus the label forks of the step it came from.

    A dict subclass so consumers that only want the per-label plans keep
    reading it as the mapping it is. Positions need the forks too — a fork
    target inherits the source's counter the way it inherits its pages — and a
    fork target is not necessarily a segment of the step, so it has nowhere
    else to ride.
    """

    __slots__ = ("pre_forks", "post_forks")

    def __init__(
        self,
        mapping: dict[str, KVPlanOutput] | None = None,
        pre_forks: tuple[tuple[str, str], ...] = (),
        post_forks: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(mapping or {})
        self.pre_forks = tuple(pre_forks)
        self.post_forks = tuple(post_forks)

    def __reduce__(self):
        return (type(self), (dict(self), self.pre_forks, self.post_forks))

    def __copy__(self) -> KVPlanOutputs:
        return type(self)(self, self.pre_forks, self.post_forks)

    def __repr__(self) -> str:
        return (
            f"KVPlanOutputs({dict.__repr__(self)}, pre_forks={self.pre_forks!r},"
            f" post_forks={self.post_forks!r})"
        )
