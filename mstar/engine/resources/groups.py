"""KV groups: a hybrid model's layers split by attention kind.

Gemma 2/3, Cohere 2, GPT-OSS, OLMo 3 ... alternate sliding-window and full
attention layers. Each group of layers with the same window (None: full) gets
its own ``KVManager`` (``window=W`` releases the pages behind the window) and
its own ``KVCache`` over the group's layers, with ``num_pages`` pages each —
the memory of one cache over every layer. Every step goes to every group's
manager with the same segments, so the groups hold the same streams and
plan the same rows; ``forward_step`` hands each layer its group's plan and
cache (a ``GroupPlans`` and the tuple of caches).

``KVGroups`` answers the calls the engine makes of a ``KVManager``. Not
composed: the prefix cache (a windowed manager refuses it: engines with the
prefix cache on keep one manager over every layer instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.kv.plan import KVPlanOutput, KVPlanOutputs, PagedIndptrs
from mstar.engine.resources.kv.ring import PinnedIndexRing
from mstar.engine.resources.step import KVStep

__all__ = ["GroupPlans", "KVGroups"]


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


class KVGroups:
    """One ``KVManager`` per group of ``groups`` (``(window, layers)`` each,
    as ``KVSpec.groups``), each of ``num_pages`` pages, and with ``cache``
    (a model's ``KVSpec.cache_kwargs()``) one ``KVCache`` over each group's
    layers (``caches``; empty without). The step protocol
    (``admit``/``plan``/``commit``/``abort``) and ``release`` go to every
    manager, all or nothing. ``num_free_pages`` is the fewest any group has
    free, so ``num_pages - num_free_pages`` is the most any group uses.
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
        if len(groups) < 1:
            raise ValueError(f"expected at least one KV group, got {groups!r}")
        self.windows = tuple(window for window, _ in groups)
        self.layers = tuple(tuple(layers) for _, layers in groups)
        self.caches = tuple(
            KVCache(
                num_pages=num_pages,
                page_size=page_size,
                dtype=dtype,
                device=device,
                **{**cache, "num_layers": len(layers)},
            )
            for layers in (self.layers if cache is not None else ())
        )
        self.managers = tuple(
            KVManager(
                num_pages,
                page_size,
                cache=self.caches[i] if self.caches else None,
                ring=PinnedIndexRing() if rings else None,
                window=window,
            )
            for i, window in enumerate(self.windows)
        )
        self.num_pages, self.page_size = num_pages, page_size
        # steps whose commit failed part-way: the index of the first group not committed
        self._partial: dict[KVStep, int] = {}

    @property
    def window(self) -> int | None:
        """The window admission counts: None when a group keeps every page,
        else the widest."""
        return None if None in self.windows else max(self.windows)

    @property
    def num_free_pages(self) -> int:
        return min(m.num_free_pages for m in self.managers)

    @property
    def num_cached_pages(self) -> int:
        """The most any group keeps cached (none: groups run without the prefix cache)."""
        return max(m.num_cached_pages for m in self.managers)

    def held_pages(self, request_id: str, label: str) -> tuple[int, ...]:
        """Pages the stream holds in each group."""
        return tuple(m.held_pages(request_id, label) for m in self.managers)

    def stored_len(self, request_id: str, label: str) -> int:
        return self.managers[0].stored_len(request_id, label)

    def labels(self, request_id: str) -> list[str]:
        return self.managers[0].labels(request_id)

    def shared_pages(self) -> int:
        return max(m.shared_pages() for m in self.managers)

    def prefix_stats(self) -> dict[str, int]:
        return self.managers[0].prefix_stats()  # the prefix cache is off: zeros

    def admit(self, step: KVStep) -> None:
        """Admit ``step`` in every group, or (it raises) in none."""
        admitted: list[KVManager] = []
        try:
            for mgr in self.managers:
                mgr.admit(step)
                admitted.append(mgr)
        except BaseException:
            for mgr in reversed(admitted):
                mgr.abort(step)
            raise

    def plan(self, step: KVStep) -> KVPlanOutputs:
        """Each plan label's ``GroupPlans``. If a group raises, abort the step."""
        outs = [mgr.plan(step) for mgr in self.managers]
        plans = {label: GroupPlans(tuple(o[label] for o in outs)) for label in outs[0]}
        return KVPlanOutputs(plans, step.pre_forks, step.post_forks)

    def commit(self, step: KVStep) -> None:
        """Commit ``step`` in every group. If one raises after others
        committed (a cache copy of a fork), ``abort`` then aborts the rest and
        the step's requests must be released (the engine's ``step`` does)."""
        for i, mgr in enumerate(self.managers):
            try:
                mgr.commit(step)
            except BaseException:
                if i:
                    self._partial[step] = i
                raise

    def abort(self, step: KVStep) -> None:
        for mgr in self.managers[self._partial.pop(step, 0) :]:
            mgr.abort(step)

    def release(self, request_id: str, label: str | None = None) -> None:
        """Free the request's streams (or ``label``'s) in every group; a bad
        id raises from the first group, before any change."""
        for mgr in self.managers:
            mgr.release(request_id, label)

    def check_invariants(self) -> None:
        """Each group's manager's ``check_invariants``."""
        for mgr in self.managers:
            mgr.check_invariants()
