"""Run a Hugging Face decoder's packed step through a KV plan.

``forward_step`` checks a step against the model (``kv_spec``) and runs the
model's forward once, its attention calls (``hf_attention``) reading the
step's plan and cache. ``supports``, ``kv_spec``, ``KVSpec`` (``hf_support``)
and ``register`` (``hf_attention``) are importable from here too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention
from mstar.engine.resources.groups import GroupPlans, block_groups
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import KVPlanOutput
from mstar.engine.resources.position import positions
from mstar.models.hf_attention import ATTENTION_NAME, CONTEXT, PagedStep, register
from mstar.models.hf_support import KVSpec, flashinfer_unsupported, kv_spec, supports
from mstar.models.llama.step import FusedLlama, fused_step

__all__ = [
    "ATTENTION_NAME",
    "KVSpec",
    "forward_step",
    "kv_spec",
    "register",
    "runs_fused",
    "supports",
]


def forward_step(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    plan: KVPlanOutput | GroupPlans,
    cache: KVCache,
    *,
    flashinfer: FlashInferPagedAttention | None = None,
    logits_at: torch.Tensor | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """One packed step: ``input_ids`` ``[plan.get_total_len()]`` in plan order
    in; logits ``[len(logits_at), vocab]`` out, at the step's token indices
    ``logits_at`` (int64, None: every token), the model's head applied to
    those tokens only. Each layer writes the step's keys and values into
    ``cache`` and attends over the plan's pages (through ``flashinfer`` when
    given, planned once per step). Refuses, before computing anything, a model
    ``supports`` refuses and a cache that does not fit it. Inference only:
    runs without autograd. The model must use ``register()``'s attention
    implementation. Never builds the plan's views itself.

    KV groups (a hybrid model's windowed and full layers managed apart on one
    page pool, see ``KVGroups``): ``plan`` a ``GroupPlans`` of a plan per
    group of ``block_groups(kv_spec(model).groups, k)`` and ``cache`` the
    groups' ``KVCache`` of ``k`` layer slots, each layer reading its group's
    plan and its slot; one plan and one cache over every layer serve any
    model (every page kept).

    ``fused`` (the default) runs a model ``fused_step`` serves (the Llama
    family on the CPU, float32 activations, eager; a windowed model's steps
    within its window) through its fused layers
    (``mstar.models.llama.step``), the same logits up to float32
    rounding; anything else, or ``fused=False``, runs HF's forward."""
    spec = kv_spec(model)
    implementation = model.config._attn_implementation
    if implementation != ATTENTION_NAME:
        raise ValueError(
            f"expected the model's attention implementation {ATTENTION_NAME!r}"
            f" (model.set_attn_implementation(register())), got {implementation!r}"
        )
    total = plan.get_total_len()
    if input_ids.dim() != 1 or input_ids.shape[0] != total:
        raise ValueError(f"expected input_ids of shape ({total},), got {tuple(input_ids.shape)}")
    plans, caches, windows, where = _layout(spec, plan, cache)
    if flashinfer is not None:
        reason = flashinfer_unsupported(spec)
        if reason is not None:
            raise ValueError(f"expected a model FlashInfer serves, got one with {reason}")
    if logits_at is not None:
        _check_logits_at(logits_at, total)
    if total == 0:
        vocab = model.config.get_text_config().vocab_size
        return torch.empty(0, vocab, device=input_ids.device)
    keep = logits_at
    if logits_at is not None and not len(logits_at):  # the step's KV is still written
        keep = torch.tensor([total - 1])  # (the head at one token, dropped)
    position_ids = positions(plans[0])
    for group, other in enumerate(plans[1:], 1):
        if not torch.equal(positions(other), position_ids):
            raise ValueError(f"expected every KV group at the same positions, group {group} is not")
    if any(spec.chunk_sizes):
        _check_chunk_positions(plans[0], position_ids.numpy(), caches[0].page_size)
    for each, window in zip(plans, windows):
        if each.kv_offsets is not None:
            _check_window(each, position_ids.numpy(), window)
    served = fused and flashinfer is None and len(plans) == 1
    fast = _fused(model, spec, position_ids) if served else None
    if fast is not None:
        logits = fast(input_ids, position_ids, plans[0], caches[0], keep)
        return logits if logits_at is None else logits[: len(logits_at)]
    options: dict[str, Any] = {}
    if keep is not None and spec.keeps_logits:
        options["logits_to_keep"] = keep.to(input_ids.device)
    token = CONTEXT.set(PagedStep(plans, caches, flashinfer, spec.chunk_sizes, where))
    try:
        with torch.no_grad():
            output = model(
                input_ids[None],
                position_ids=position_ids.to(input_ids.device)[None],
                use_cache=False,
                **options,
            )
    finally:
        CONTEXT.reset(token)
    logits = output.logits[0]
    if keep is not None and not spec.keeps_logits:
        logits = logits[keep.to(logits.device)]
    return logits if logits_at is None else logits[: len(logits_at)]


def runs_fused(model: PreTrainedModel) -> bool:
    """Whether ``forward_step(model, ...)`` (``fused=True``, no FlashInfer)
    runs the fused forward: a model ``fused_step`` serves, every layer
    attending causally over every key (a sliding window's model: its steps
    within the window, see ``_fused``)."""
    return _fused(model, kv_spec(model)) is not None


def _fused(
    model: PreTrainedModel, spec: KVSpec, position_ids: torch.Tensor | None = None
) -> FusedLlama | None:
    """The model's fused forward (``fused_step``) when every layer attends
    causally over every key of the step at ``position_ids`` (None: of some
    step), else None. No chunks or sinks; a layer's sliding window of ``W``
    keys hides none from queries at positions below ``W``, so such steps
    are what ``StepAttention`` computes (a step past it runs HF's forward)."""
    if spec.sinks or any(spec.chunk_sizes):
        return None
    windows = [w for w in spec.layer_windows if w is not None]
    positions = [] if position_ids is None or not windows else position_ids
    if len(positions) and int(positions.max()) >= min(windows):
        return None
    return fused_step(model)


def _layout(
    spec: KVSpec, plan: KVPlanOutput | GroupPlans, cache: KVCache
) -> tuple[
    tuple[KVPlanOutput, ...],
    tuple[KVCache, ...],
    tuple[int | None, ...],
    tuple[tuple[int, int], ...] | None,
]:
    """A step's plans, caches and windows per KV group, and each layer's
    (group, slot in the cache); checked against the model. A ``GroupPlans``
    comes with one cache of a group's ``cache.num_layers`` slots, the groups
    being ``block_groups(spec.groups, cache.num_layers)``."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"expected cache a KVCache, got {type(cache).__name__}")
    if isinstance(plan, KVPlanOutput):
        _check_cache(cache, spec, spec.num_layers)
        return (plan,), (cache,), (spec.window,), None
    groups = block_groups(spec.groups, cache.num_layers)
    plans = plan.plans
    if len(plans) != len(groups):
        raise ValueError(
            f"expected a plan per KV group of {cache.num_layers} layers ({len(groups)}, windows"
            f" {[w for w, _ in groups]}), got {len(plans)} plan(s)"
        )
    _check_cache(cache, spec, max(len(layers) for _, layers in groups))
    where: list[tuple[int, int]] = [(0, 0)] * spec.num_layers
    for g, (_, layers) in enumerate(groups):
        for i, layer in enumerate(layers):
            where[layer] = (g, i)
    qo_indptr = plans[0].cpu_indptrs.qo_indptr
    for g, each in enumerate(plans[1:], 1):
        if each.rows != plans[0].rows or not torch.equal(each.cpu_indptrs.qo_indptr, qo_indptr):
            raise ValueError(
                f"expected every KV group's plan over the same rows, group {g}'s differ"
            )
    caches = (cache,) * len(groups)
    return plans, caches, tuple(w for w, _ in groups), tuple(where)


def _check_cache(cache: KVCache, spec: KVSpec, num_layers: int) -> None:
    want = {**spec.cache_kwargs(), "num_layers": num_layers}
    have = {name: getattr(cache, name) for name in want}
    if have != want:
        raise ValueError(f"expected a cache of {want} for this model, got {have}")


def _check_logits_at(logits_at: torch.Tensor, total: int) -> None:
    if logits_at.dim() != 1 or logits_at.dtype != torch.int64:
        raise ValueError(
            f"expected logits_at an int64 tensor [n], got {logits_at.dtype} {tuple(logits_at.shape)}"
        )
    if not logits_at.numel():
        return
    low, high = _bounds(logits_at)
    if not (low >= 0 and high < total):
        raise ValueError(f"expected logits_at in [0, {total}), got values in [{low}, {high}]")


def _bounds(values: torch.Tensor) -> tuple[int, int]:
    """The least and greatest of non-empty integer ``values``: a few (a decode
    step's) read to the host at once, not two reductions and two reads."""
    if values.numel() <= 256:
        host = values.tolist()
        return min(host), max(host)
    low, high = values.aminmax()
    return int(low), int(high)


def _check_chunk_positions(plan: KVPlanOutput, position_ids: np.ndarray, page_size: int) -> None:
    """Chunked attention counts chunks from a row's first key slot: refuse a
    row whose positions are not its key slots (a page-space ``start``)."""
    idx = plan.cpu_indptrs
    qo_indptr = idx.qo_indptr.numpy().astype(np.int64)
    num_pages = np.diff(idx.paged_kv_indptr.numpy().astype(np.int64))
    kv_lens = np.where(
        num_pages > 0, (num_pages - 1) * page_size + idx.paged_kv_last_page_len.numpy(), 0
    )
    counts = np.diff(qo_indptr)
    slots = np.repeat(kv_lens - counts - qo_indptr[:-1], counts) + np.arange(qo_indptr[-1])
    if not np.array_equal(slots, position_ids):
        token = int(np.flatnonzero(slots != position_ids)[0])
        raise ValueError(
            f"expected each token's position to be its key slot under chunked attention,"
            f" got position {int(position_ids[token])} at slot {int(slots[token])}"
            f" (token {token})"
        )


def _check_window(plan: KVPlanOutput, position_ids: np.ndarray, window: int | None) -> None:
    """Refuse a plan whose rows released keys the model still reads: each
    row's first query sees keys from ``position - window + 1``, which must
    not lie before the row's first page (``kv_offsets``)."""
    qo_indptr = plan.cpu_indptrs.qo_indptr.numpy().astype(np.int64)
    rows = np.flatnonzero(np.diff(qo_indptr) > 0)
    first = position_ids[qo_indptr[rows]]
    reach = np.zeros_like(first) if window is None else np.maximum(first - (window - 1), 0)
    bad = np.flatnonzero(reach < plan.kv_offsets[rows])
    if len(bad):
        row = int(rows[bad[0]])
        raise ValueError(
            f"expected the plan to hold every key the model reads, got row {row} ({plan.rows[row]})"
            f" whose keys before position {int(plan.kv_offsets[row])} were released, while the"
            f" model's window ({window}) reaches position {int(reach[bad[0]])}"
        )
