"""Test-only references shared by the consumer tests: a dense attention
oracle and hand-built plans over pages taken from a shuffled pool."""

from __future__ import annotations

import numpy as np
import torch

from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import KVPlanOutput, SequenceView, build_paged_indptrs


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    window_left: int = -1,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """One row the slow, obvious way: ``q`` ``[n, H, D]`` over the row's whole
    history ``k`` ``[L, H_kv, D]`` / ``v`` ``[L, H_kv, D_v]``, query ``i`` at
    position ``L - n + i``, an explicit mask (``chunk_size``: only keys of the
    query's chunk), float64 math; scores soft-capped as
    ``softcap * tanh(s / softcap)``; ``sinks`` ``[H]`` as one extra logit per
    head in the softmax, then dropped (as GPT-OSS); fully masked queries give
    zeros. Returns ``[n, H, D_v]`` in q's dtype."""
    n, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    mask = torch.zeros(n, kv_len, dtype=torch.bool)
    for i in range(n):
        p = kv_len - n + i
        for j in range(kv_len):
            mask[i, j] = (
                (not causal or j <= p)
                and (window_left < 0 or j >= p - window_left)
                and (chunk_size is None or j // chunk_size == p // chunk_size)
            )
    out = torch.zeros(n, num_heads, v.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        seen = mask.any(dim=1)
        if sinks is not None:
            sink = torch.full((n, 1), float(sinks[h]), dtype=torch.float64)
            scores = torch.cat([scores, sink], dim=1)
            vh = torch.cat([vh, vh.new_zeros(1, vh.shape[1])])
        out[seen, h] = torch.softmax(scores[seen], dim=-1) @ vh
    return out.to(q.dtype)


class Streams:
    """Test-only page bookkeeping for hand-built plans: each stream grows by a
    span per step and takes pages from a shuffled pool, so its pages are not
    contiguous (the real allocator is ``KVManager``)."""

    def __init__(self, num_pages: int, page_size: int, seed: int = 0) -> None:
        self.page_size = page_size
        self._free = [int(p) for p in np.random.default_rng(seed).permutation(num_pages)]
        self.pages: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def view(self, stream: str, span: int) -> SequenceView:
        """Grow ``stream`` by ``span`` tokens and return its view for the step."""
        length = self.lengths.get(stream, 0) + span
        pages = self.pages.setdefault(stream, [])
        while len(pages) * self.page_size < length:
            pages.append(self._free.pop())
        self.lengths[stream] = length
        return SequenceView(stream, "text", list(pages), length, span)

    def plan(self, spans: list[tuple[str, int]]) -> KVPlanOutput:
        """A general plan: one row per ``(stream, span)``, in order."""
        views = [self.view(stream, span) for stream, span in spans]
        return KVPlanOutput(build_paged_indptrs(views, self.page_size), views=views)

    def decode_plan(self, streams: list[str], *, allow_views: bool = False) -> KVPlanOutput:
        """A decode plan (one token per stream) carrying ``decode_pages`` and
        ``decode_offsets``; unless ``allow_views``, building its views raises."""
        views = [self.view(stream, 1) for stream in streams]
        pos = [v.start + v.length - 1 for v in views]
        pages = np.array([v.page_idxs[p // self.page_size] for v, p in zip(views, pos)])
        offsets = np.array([p % self.page_size for p in pos])

        def build_views() -> list[SequenceView]:
            if not allow_views:
                raise AssertionError("a decode plan's views were built")
            return views

        return KVPlanOutput(
            build_paged_indptrs(views, self.page_size),
            decode_pages=pages.astype(np.int64),
            decode_offsets=offsets.astype(np.int64),
            view_builder=build_views,
        )


class Scenario:
    """One cache layer holding streams' histories, plus a step of new tokens.

    ``rows`` are ``(history, new)`` token counts per stream. The histories are
    written on construction, the step's tokens by ``step``. ``kv[name]`` is a
    stream's whole K/V ``[2, history + new, H_kv, head_dim]`` (CPU, float32),
    the oracle's copy of what the cache holds.
    """

    def __init__(
        self,
        rows: list[tuple[int, int]],
        page_size: int,
        num_kv_heads: int,
        seed: int,
        *,
        head_dim: int = 8,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.names = [f"r{i}" for i in range(len(rows))]
        self.rows = rows
        self.head_dim = head_dim
        num_pages = sum(-(-(h + n) // page_size) for h, n in rows) + 2
        self.streams = Streams(num_pages, page_size, seed)
        self.cache = KVCache(1, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        self.gen = torch.Generator().manual_seed(seed)
        self.kv = {
            name: torch.randn(2, h + n, num_kv_heads, head_dim, generator=self.gen)
            for name, (h, n) in zip(self.names, rows)
        }
        history = self.streams.plan([(name, h) for name, (h, _) in zip(self.names, rows)])
        self._write(history, [self.kv[name][:, :h] for name, (h, _) in zip(self.names, rows)])

    def step(self, *, decode: bool = False) -> KVPlanOutput:
        """Plan and write the step's new tokens (through a decode plan, whose
        views raise, when ``decode``); returns the plan."""
        if decode:
            plan = self.streams.decode_plan(self.names)
        else:
            plan = self.streams.plan([(name, n) for name, (_, n) in zip(self.names, self.rows)])
        self._write(plan, [self.kv[name][:, h:] for name, (h, _) in zip(self.names, self.rows)])
        return plan

    def queries(self, counts: list[int], num_qo_heads: int) -> list[torch.Tensor]:
        """Random CPU float32 queries ``[n, num_qo_heads, head_dim]`` per count."""
        return [torch.randn(n, num_qo_heads, self.head_dim, generator=self.gen) for n in counts]

    def _write(self, plan: KVPlanOutput, parts: list[torch.Tensor]) -> None:
        k, v = torch.cat(parts, dim=1).to(self.cache.device, self.cache.dtype)
        self.cache.write(0, plan, k, v)
