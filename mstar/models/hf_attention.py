"""The attention function registered with transformers, and its custom op.

transformers calls a registered attention function per layer; ``forward_step``
hands it the step's plan and cache through ``CONTEXT``, set around the
forward (and reset after it), so they arrive even through decoder layers
that drop ``**kwargs``, and nothing rides in module state. A name unknown to
transformers' mask interface makes the model skip building a mask, which the
plan replaces. Under ``supports``' probe the same context holds a ``Probe``,
and the function records how it is called instead of attending.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface

from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention
from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import AttentionSchedule, paged_attention
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import KVPlanOutput

__all__ = ["ATTENTION_NAME", "CONTEXT", "KNOWN_KEYWORDS", "PagedStep", "Probe", "register"]

ATTENTION_NAME = "mstar_paged"

# Keywords transformers' decoders pass the attention function that it honours
# (scaling, sliding_window, softcap, s_aux; dropout must be 0) or that carry
# nothing it needs (the rest). Any other keyword refuses the call.
KNOWN_KEYWORDS = frozenset(
    {
        "scaling",
        "dropout",
        "sliding_window",
        "softcap",
        "s_aux",
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_router_logits",
    }
)


@dataclass
class PagedStep:
    """What one ``forward_step`` hands its attention calls: a plan and a
    cache per KV group (the groups' one cache), and each layer's (group,
    slot in the cache) (None: one group of every layer)."""

    plans: tuple[KVPlanOutput, ...]
    caches: tuple[KVCache, ...]
    flashinfer: FlashInferPagedAttention | None
    chunk_sizes: tuple[int | None, ...]
    where: tuple[tuple[int, int], ...] | None = None
    layers_seen: set[int] = field(default_factory=set)
    # Each group's attention schedule, built by its first layer.
    schedules: dict[int, AttentionSchedule] = field(default_factory=dict)
    # Each group's plan's token count, read by its first layer.
    totals: dict[int, int] = field(default_factory=dict)


@dataclass
class Probe:
    """What a probe forward records of the model's attention calls."""

    calls: list[dict[str, Any]] = field(default_factory=list)


CONTEXT: contextvars.ContextVar[PagedStep | Probe | None] = contextvars.ContextVar(
    "mstar_step", default=None
)


def register() -> str:
    """Register the paged attention function with transformers (idempotent)
    and return its name, for ``model.set_attn_implementation(register())``."""
    AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)
    return ATTENTION_NAME


def _paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract: ``query`` ``[1, H, T, D]`` and
    ``key``/``value`` ``[1, H_kv, T, D]`` / ``[..., D_v]`` (RoPE applied) in,
    ``[1, T, H, D_v]`` out. ``attention_mask`` is ignored: the plan says what
    each token sees."""
    if not torch.compiler.is_compiling():
        context = CONTEXT.get()
        if isinstance(context, Probe):
            return _record(context, module, query, key, value, attention_mask, kwargs)
    # a loop, not ``kwargs.keys() - KNOWN_KEYWORDS``: torch 2.11's dynamo fails on that
    # difference (InternalTorchDynamoError, NotImplementedType not iterable)
    unknown = [k for k in kwargs if k not in KNOWN_KEYWORDS]
    if unknown:
        raise ValueError(
            f"expected attention keywords among {sorted(KNOWN_KEYWORDS)}, got {sorted(unknown)}"
        )
    if query.shape[0] != 1:
        raise ValueError(f"expected a packed batch of 1, got batch {query.shape[0]}")
    if kwargs.get("dropout"):
        raise ValueError(f"expected attention dropout 0 (model.eval()), got {kwargs['dropout']}")
    sliding_window = kwargs.get("sliding_window")
    scaling, softcap, sinks = kwargs.get("scaling"), kwargs.get("softcap"), kwargs.get("s_aux")
    if torch.compiler.is_compiling():  # one opaque op in the graph: it never breaks there
        out = torch.ops.mstar.paged_attention(
            query, key, value, module.layer_idx, scaling, sliding_window, softcap, sinks
        )
        return out, None
    out = _attend_layer(
        query, key, value, module.layer_idx, scaling, sliding_window, softcap, sinks
    )
    return out, None


def _attend_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Write layer ``layer``'s keys and values into the step's cache and
    attend over its plan: ``[1, T', H, D_v]``. ``query`` ``[1, H, T', D]``
    may be padded past the step's tokens (a compiled forward's bucket): the
    queries past them give zeros."""
    context = CONTEXT.get()
    if not isinstance(context, PagedStep):
        raise ValueError(
            "expected a plan and a cache for paged attention, got none: run the model"
            " through mstar.models.hf.forward_step(model, input_ids, plan, cache)"
        )
    if layer in context.layers_seen:
        raise ValueError(
            f"expected one attention call per layer and step, got a second in layer {layer}"
        )
    context.layers_seen.add(layer)
    group, local = (0, layer) if context.where is None else context.where[layer]
    plan, cache = context.plans[group], context.caches[group]
    if group not in context.totals:
        context.totals[group] = plan.get_total_len()
    total, padded = context.totals[group], query.shape[2]
    if padded != total:
        query, key, value = query[:, :, :total], key[:, :, :total], value[:, :, :total]
    q = query[0].transpose(0, 1)
    cache.write(local, plan, key[0].transpose(0, 1), value[0].transpose(0, 1))
    window_left = -1 if sliding_window is None else sliding_window - 1
    # causal, sm_scale, window_left, softcap, sinks, chunk_size (by position: cheaper per layer)
    options = AttentionOptions(
        True, scaling, window_left, softcap, sinks, context.chunk_sizes[layer]
    )
    if context.flashinfer is None:
        schedule = context.schedules.get(group)
        if schedule is None:
            schedule = AttentionSchedule(plan.cpu_indptrs, cache.page_size, q.device)
            context.schedules[group] = schedule
        kv_layer = cache.layer(local)
        out = paged_attention(q, kv_layer, plan.cpu_indptrs, options, schedule=schedule)
    else:
        context.flashinfer.plan(
            plan,
            num_qo_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=query.shape[3],
            page_size=cache.page_size,
            options=options,
            q_dtype=q.dtype,
            kv_dtype=cache.dtype,
        )
        out = context.flashinfer.run(q, cache.layer(local))
    if padded != total:
        out = torch.cat([out, out.new_zeros((padded - total, *out.shape[1:]))])
    return out[None]


# For a compiled forward, ``_attend_layer`` as one custom op per layer,
# opaque to the graph: the step's plan and cache come from ``CONTEXT`` (they
# are no tensors of the graph), the cache is written in place. Host work each
# call (the plan's index arrays): CUDA graphs capture around it.
_paged_attention_op = torch.library.custom_op(
    "mstar::paged_attention",
    _attend_layer,
    mutates_args=(),
    tags=(torch.Tag.cudagraph_unsafe,),
)


@_paged_attention_op.register_fake
def _(query, key, value, layer, scaling, sliding_window, softcap, sinks):
    return query.new_empty((1, query.shape[2], query.shape[1], value.shape[3]))


def _record(
    probe: Probe,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    probe.calls.append(
        {
            "layer": getattr(module, "layer_idx", None),
            "keywords": set(kwargs),
            "mask": attention_mask is not None,
            "sinks": kwargs.get("s_aux") is not None,
            "window": kwargs.get("sliding_window"),
            "causal": getattr(module, "is_causal", True) and kwargs.get("is_causal", True),
            "shape": (key.shape[1], key.shape[3], value.shape[3]),
        }
    )
    shape = (query.shape[0], query.shape[2], query.shape[1], value.shape[3])
    return query.new_zeros(shape), None
