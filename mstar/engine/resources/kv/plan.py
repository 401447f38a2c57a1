"""The KV plan: what ``KVManager.plan`` hands its dependents.

Attention and positions read this and nothing else of the KV resource — the
packed ordering, one view per (request, label) stream, and the index tensors a
paged-attention wrapper plans against. Kept apart from the manager so a
consumer depends on the contract rather than on the cache.

Conventions (FlashInfer's): every index tensor is int32 and built on the CPU; a
row's pages, in order, hold tokens ``[start, start + length)`` of the page
space, so its last page holds ``(start + length) % page_size`` tokens (0: full).

``start > 0`` (a windowed stream whose first pages went back to the pool):
FlashInfer has no per-row start, so a row's keys are its page-space slots
``[0, start + length)``: ``kv_len = start + length`` and query ``i`` sits at
slot ``kv_len - to_compute + i``. The ``start`` slots before the first kept
token still hold older keys of the stream; the attention's window
(``window_left``) hides them, and causal masks and windows are relative, so
the shift changes no score. Positions are absolute: slot ``s`` of a row is
at position ``kv_offsets[row] + s`` (the tokens of the pages released
before the row's first page; 0 without ``kv_offsets``).

The contract's types, ``group_by_plan_label`` and ``context_only_views`` live
here; the host arrays from views (``build_paged_indptrs``'s checks) and the
pinned ring live beside it (``indptrs``, ``ring``) and are re-exported:
``__all__`` is the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from mstar.engine.resources.kv.indptrs import check_page_size, view_arrays
from mstar.engine.resources.kv.ring import PinnedIndexRing
from mstar.engine.resources.step import Segment

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
    arrays, kv_lens = view_arrays(segments, page_size)
    return host_indptrs(arrays, kv_lens, ring)


def host_indptrs(
    arrays: tuple[np.ndarray, ...], kv_lens: np.ndarray, ring: PinnedIndexRing | None
) -> PagedIndptrs:
    """``PagedIndptrs`` of the four int32 host ``arrays`` (copied into ring
    buffers, with a ring; else shared) and ``kv_lens``."""
    if ring is None:
        tensors = [torch.from_numpy(a) for a in arrays]
    else:
        tensors = [ring.take(a) for a in arrays]
    return PagedIndptrs(*tensors, HostLens(kv_lens))


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
    pays for them; positions are read from the index arrays until they are. ``rows`` is each row's ``(request_id, label)`` in plan
    order. ``decode_pages``/``decode_offsets`` (numpy int64 ``[B]``), when
    given, are each row's write page and offset within it. ``kv_offsets``
    (numpy int64 ``[B]``, or None for all 0; an attribute, set by a windowed
    ``KVManager``, so the spec's signature stands) is each row's position of
    its first key slot: tokens released behind a window before its first page.
    """

    __slots__ = (
        "kv_offsets",
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
        self.kv_offsets: np.ndarray | None = None  # set by a windowed manager's plan
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


def context_only_views(
    views: list[SequenceView], query_spans: list[int], page_size: int
) -> list[SequenceView]:
    """The views of a step's streams without the tokens the step appends:
    length shrinks by ``to_compute`` (the pages beyond it dropped; a row that
    stored nothing keeps none) and ``to_compute`` becomes the row's query
    count. For attention over the stored context alone."""
    if len(views) != len(query_spans):
        raise ValueError(f"expected one query span per view ({len(views)}), got {len(query_spans)}")
    check_page_size(page_size)
    out = []
    for v, queries in zip(views, query_spans):
        stored = v.length - v.to_compute
        keep = -(-(v.start + stored) // page_size) if stored > 0 else 0
        out.append(v._replace(page_idxs=v.page_idxs[:keep], length=stored, to_compute=queries))
    return out
