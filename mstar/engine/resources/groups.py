"""KV groups: a hybrid model's layers split by attention kind, over one page pool.

Gemma 2/3, Cohere 2, GPT-OSS, OLMo 3 ... alternate sliding-window and full
attention layers. Their layers are split into KV groups of ``size`` layers
each (the fewest layers of any window, ``block_groups``), every group's
layers sharing one window (None: full); a window with more layers gets
several groups, a group with fewer leaves cache slots unused. Every group
has its own ``KVManager`` (``window=W`` releases the pages behind the
window) and all allocate from ONE ``PagePool``, over ONE ``KVCache`` of
``size`` layer slots: a page id names, for the group owning it, its layers'
pages (the group's i-th layer in slot i). So a page a windowed group gives
back is at once capacity for a full group; the memory is ``num_pages x
size`` layer-pages. Every step goes to every group's manager with the same
segments, so the groups hold the same streams and plan the same rows;
``forward_step`` hands each layer its group's plan and the cache (a
``GroupPlans`` and the ``KVCache``).

``KVGroups`` answers the calls the engine makes of a ``KVManager``, from
one thread. Not composed: the prefix cache (a shared pool refuses it: engines
with the prefix cache on keep one manager over every layer instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.errors import AllocationFailed
from mstar.engine.resources.kv.invariants import check_owners
from mstar.engine.resources.kv.manager import KVManager, check_sizes
from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.plan import KVPlanOutput, KVPlanOutputs, PagedIndptrs
from mstar.engine.resources.kv.ring import PinnedIndexRing
from mstar.engine.resources.step import KVStep

__all__ = ["GroupPlans", "KVGroups", "block_groups", "group_size"]


@dataclass(frozen=True)
class GroupPlans:
    """One plan label's plans, one per KV group in the model's group order,
    over the same rows (``rows``, ``qo_indptr`` and positions agree; each
    group's pages and ``kv_offsets`` are its own)."""

    plans: tuple[KVPlanOutput, ...]

    @property
    def rows(self) -> list[tuple[str, str]]:
        return self.plans[0].rows

    @property
    def cpu_indptrs(self) -> PagedIndptrs:
        return self.plans[0].cpu_indptrs

    def get_total_len(self) -> int:
        return self.plans[0].get_total_len()


def group_size(groups: Sequence[tuple[int | None, Sequence[int]]]) -> int:
    """The layers of a KV group on one pool: the fewest of any window in
    ``groups`` (``(window, layers)`` each, as ``KVSpec.groups``)."""
    return min(len(layers) for _, layers in groups)


def block_groups(
    groups: Sequence[tuple[int | None, Sequence[int]]], size: int | None = None
) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
    """``groups`` (``(window, layers)`` each, as ``KVSpec.groups``) split into
    groups of at most ``size`` layers (None: the fewest layers of any group),
    each window's layers in order, windows in order."""
    if len(groups) < 1:
        raise ValueError(f"expected at least one KV group, got {groups!r}")
    size = group_size(groups) if size is None else size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"expected size an int >= 1, got {size!r}")
    return tuple(
        (window, tuple(layers[i : i + size]))
        for window, layers in groups
        for i in range(0, len(layers), size)
    )


class KVGroups:
    """A ``KVManager`` per group of ``block_groups(groups)`` (``groups``:
    ``(window, layers)`` each, as ``KVSpec.groups``), all on one ``PagePool``
    of ``num_pages`` pages (``pool``), and with ``cache`` (a model's
    ``KVSpec.cache_kwargs()``) one ``KVCache`` of ``size`` layers over them
    (``cache``; None without). The step protocol (``admit``/``plan``/
    ``commit``/``abort``) and ``release`` go to every manager, all or nothing.
    ``rings``: each manager hands its index arrays out of a
    ``PinnedIndexRing``."""

    def __init__(
        self,
        groups: Sequence[tuple[int | None, Sequence[int]]],
        num_pages: int,
        page_size: int,
        *,
        cache: dict[str, int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rings: bool = False,
    ) -> None:
        split = block_groups(groups)
        self.windows = tuple(window for window, _ in split)
        self.layers = tuple(layers for _, layers in split)
        self.size = len(self.layers[0])  # the fewest layers of any window
        check_sizes(num_pages, page_size)
        self.pool = PagePool(num_pages, page_size)
        self.cache = None
        if cache is not None:
            self.cache = KVCache(
                num_pages=num_pages,
                page_size=page_size,
                dtype=dtype,
                device=device,
                **{**cache, "num_layers": self.size},
            )
        self.managers = tuple(
            KVManager(
                num_pages,
                page_size,
                cache=self.cache,
                ring=PinnedIndexRing() if rings else None,
                window=window,
                pool=self.pool,
            )
            for window in self.windows
        )
        self.num_pages, self.page_size = num_pages, page_size
        # steps whose commit failed part-way: the index of the first group not committed
        self._partial: dict[KVStep, int] = {}

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_pages(self) -> int:
        """Always 0: groups run without the prefix cache."""
        return self.pool.num_cached

    def held_pages(self, request_id: str, label: str) -> tuple[int, ...]:
        """Pages the stream holds in each group."""
        return tuple(m.held_pages(request_id, label) for m in self.managers)

    def group_pages(self) -> tuple[int, ...]:
        """Pages each group owns now (its streams' and its steps' in flight)."""
        return tuple(int(np.count_nonzero(m.owner_counts())) for m in self.managers)

    def stored_len(self, request_id: str, label: str) -> int:
        return self.managers[0].stored_len(request_id, label)

    def labels(self, request_id: str) -> list[str]:
        return self.managers[0].labels(request_id)

    def shared_pages(self) -> int:
        return self.managers[0].shared_pages()  # the pool's

    def prefix_stats(self) -> dict[str, int]:
        return self.managers[0].prefix_stats()  # the prefix cache is off: zeros

    def admit(self, step: KVStep) -> None:
        """Admit ``step`` in every group, or (it raises) in none. When the
        pool is short, ``AllocationFailed`` names the first row whose pages
        in all groups, with those of the rows before it, do not fit."""
        admitted: list[KVManager] = []
        try:
            for mgr in self.managers:
                mgr.admit(step)
                admitted.append(mgr)
        except BaseException as err:
            for mgr in reversed(admitted):
                mgr.abort(step)
            if isinstance(err, AllocationFailed):
                raise self._refusal(step) from None
            raise

    def _refusal(self, step: KVStep) -> AllocationFailed:
        """The shortfall of ``step`` (which does not fit) over every group:
        a group that refused counted the pages the groups before it reserved
        for every row, so its row may come too early."""
        needs = [mgr.pages_needed(step) for mgr in self.managers]
        keys, total = needs[0][0], np.cumsum(sum(grow for _, grow in needs))
        free = self.pool.num_free
        row = min(int(np.searchsorted(total, free, side="right")), len(keys) - 1)
        return AllocationFailed(int(total[-1]) - free, *keys[row])

    def plan(self, step: KVStep) -> KVPlanOutputs:
        """Each plan label's ``GroupPlans``. If a group raises, abort the step."""
        outs = [mgr.plan(step) for mgr in self.managers]
        plans = {label: GroupPlans(tuple(o[label] for o in outs)) for label in outs[0]}
        return KVPlanOutputs(plans, step.pre_forks, step.post_forks)

    def commit(self, step: KVStep, kept: Any = None) -> None:
        """Commit ``step`` in every group (``kept``: see ``KVManager.commit``;
        a bad one raises from the first group, before any change). If one
        raises after others committed (a cache copy of a fork), ``abort`` then
        aborts the rest and the step's requests must be released (the
        engine's ``step`` does)."""
        for i, mgr in enumerate(self.managers):
            try:
                mgr.commit(step, kept)
            except BaseException:
                if i:
                    self._partial[step] = i
                raise

    def abort(self, step: KVStep) -> None:
        for mgr in self.managers[self._partial.pop(step, 0) :]:
            mgr.abort(step)

    def rewind(self, request_id: str, label: str, n: int) -> None:
        """``KVManager.rewind`` in every group: a rewind one group refuses (a
        windowed group's released pages) is checked in all before any takes it."""
        for mgr in self.managers:
            mgr.check_rewind(request_id, label, n)
        for mgr in self.managers:
            mgr.rewind(request_id, label, n)

    def release(self, request_id: str, label: str | None = None) -> None:
        """Free the request's streams (or ``label``'s) in every group; a bad
        id raises from the first group, before any change."""
        for mgr in self.managers:
            mgr.release(request_id, label)

    def check_invariants(self) -> None:
        """Each group's manager's ``check_invariants``, then the pool against
        them all: each page's refcount is the sum of its owners over the
        groups, a free page is owned by none."""
        for mgr in self.managers:
            mgr.check_invariants()
        check_owners(self.pool, sum(m.owner_counts() for m in self.managers))
