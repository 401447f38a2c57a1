"""Run a Hugging Face decoder's packed step through a KV plan.

transformers calls a registered attention function per layer; ``forward_step``
hands it the step's plan and cache through a context variable set around the
forward (and reset after it), so they arrive even through decoder layers
that drop ``**kwargs``, and nothing rides in module state. A name unknown to
transformers' mask interface makes the model skip building a mask, which the
plan replaces.

What the paged path cannot serve exactly is refused before anything runs:
``supports(model)`` probes the model once (a three-token forward whose
attention records how it is called and returns zeros) and names the reason —
attention not routed through the interface, called more than once per layer,
layers without it (hybrid SSM / linear attention), a mask of its own (ALiBi),
bidirectional attention, or an attention keyword this function does not
understand.
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel

from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention, unsupported
from mstar.engine.resources.attn.paged import AttentionSchedule, paged_attention
from mstar.engine.resources.groups import GroupPlans, block_groups
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import KVPlanOutput
from mstar.engine.resources.position import positions

__all__ = ["ATTENTION_NAME", "KVSpec", "forward_step", "kv_spec", "register", "supports"]

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
# Layer types whose attention the plan serves; any other type (linear
# attention, mamba, conv, ...) mixes tokens outside attention.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
_SUPPORT_ATTRIBUTE = "_mstar_support"


@dataclass(frozen=True)
class KVSpec:
    """What a model stores per token, read from its attention calls: the
    ``KVCache`` sizes it needs (``KVCache(num_pages=..., page_size=...,
    **spec.cache_kwargs())``) and each layer's attention chunk (None: none)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    chunk_sizes: tuple[int | None, ...]
    # Whether its attention has sinks (s_aux).
    sinks: bool
    # Whether the model's forward takes ``logits_to_keep`` as a tensor of indices.
    keeps_logits: bool
    # The sliding window every layer shares (HF's ``sliding_window``), None when
    # some layer has none or they differ: a KVManager(..., window=...) for it
    # releases the pages behind it.
    window: int | None = None
    # Each layer's sliding window (None: it reads every key); all None for a
    # model with chunked attention, whose chunks count from a stream's first key.
    layer_windows: tuple[int | None, ...] = ()

    @property
    def groups(self) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
        """The KV groups: ``(window, layers)`` per distinct window (None: full
        attention), in order of their first layer. A hybrid model has two or
        more; ``KVGroups`` splits them into groups of equal size
        (``block_groups``), each with its own ``KVManager(..., window=window)``
        on one page pool and one ``KVCache``."""
        windows = self.layer_windows or (self.window,) * self.num_layers
        layers: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            layers.setdefault(window, []).append(layer)
        return tuple((window, tuple(group)) for window, group in layers.items())

    def cache_kwargs(self) -> dict[str, int]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
        }


@dataclass
class _Step:
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


@dataclass
class _Probe:
    """What a probe forward records of the model's attention calls."""

    calls: list[dict[str, Any]] = field(default_factory=list)


_CONTEXT: contextvars.ContextVar[_Step | _Probe | None] = contextvars.ContextVar(
    "mstar_step", default=None
)


def register() -> str:
    """Register the paged attention function with transformers (idempotent)
    and return its name, for ``model.set_attn_implementation(register())``."""
    AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)
    return ATTENTION_NAME


def supports(model: PreTrainedModel) -> str | None:
    """None when the paged path serves ``model`` exactly, else the reason it
    cannot. Probes the model on its first call (a three-token forward without
    autograd); the verdict is kept on the model object."""
    verdict = _verdict(model)
    return verdict if isinstance(verdict, str) else None


def flashinfer_unsupported(spec: KVSpec) -> str | None:
    """Why FlashInfer's adapter cannot serve a model of ``spec`` (None: it can)."""
    return unsupported(
        sinks=spec.sinks,
        chunk_size=next((c for c in spec.chunk_sizes if c is not None), None),
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim,
    )


def kv_spec(model: PreTrainedModel) -> KVSpec:
    """The cache layout ``model`` needs; raises ``ValueError`` with the reason
    when ``supports(model)`` refuses it."""
    verdict = _verdict(model)
    if isinstance(verdict, str):
        raise ValueError(f"expected a model the paged path serves exactly, got one that {verdict}")
    return verdict


def forward_step(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    plan: KVPlanOutput | GroupPlans,
    cache: KVCache,
    *,
    flashinfer: FlashInferPagedAttention | None = None,
    logits_at: torch.Tensor | None = None,
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
    model (every page kept)."""
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
    vocab = model.config.get_text_config().vocab_size
    if total == 0:
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
    options: dict[str, Any] = {}
    if keep is not None and spec.keeps_logits:
        options["logits_to_keep"] = keep.to(input_ids.device)
    token = _CONTEXT.set(_Step(plans, caches, flashinfer, spec.chunk_sizes, where))
    try:
        with torch.no_grad():
            output = model(
                input_ids[None],
                position_ids=position_ids.to(input_ids.device)[None],
                use_cache=False,
                **options,
            )
    finally:
        _CONTEXT.reset(token)
    logits = output.logits[0]
    if keep is not None and not spec.keeps_logits:
        logits = logits[keep.to(logits.device)]
    return logits if logits_at is None else logits[: len(logits_at)]


def _verdict(model: PreTrainedModel) -> KVSpec | str:
    verdict = getattr(model, _SUPPORT_ATTRIBUTE, None)
    if verdict is None:
        verdict = _probe(model)
        setattr(model, _SUPPORT_ATTRIBUTE, verdict)
    return verdict


def _probe(model: PreTrainedModel) -> KVSpec | str:
    """Run the model once on three tokens with a recording attention
    function, and judge what it did."""
    config = model.config.get_text_config()
    reason = _config_refusal(config)
    if reason is not None:
        return reason
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(register())
    except Exception as e:
        return f"does not take a custom attention implementation ({type(e).__name__}: {e})"
    position_ids = torch.arange(3, device=model.device)[None]
    probe = _Probe()
    token = _CONTEXT.set(probe)
    try:
        with torch.no_grad():
            full = model(
                position_ids % config.vocab_size, position_ids=position_ids, use_cache=False
            )
            calls = list(probe.calls)
            keeps_logits = _keeps_logits(model, position_ids, full.logits)
    except Exception as e:
        return f"fails a three-token probe forward ({type(e).__name__}: {e})"
    finally:
        _CONTEXT.reset(token)
        model.set_attn_implementation(previous)
    return _judge(config, calls, keeps_logits)


def _config_refusal(config: Any) -> str | None:
    """A reason read from the config alone (ALiBi, non-attention layers)."""
    flags = [
        name
        for name, value in vars(config).items()
        if "alibi" in name.lower() and value not in (None, False, 0)
    ]
    attn_config = getattr(config, "attn_config", None)
    if getattr(attn_config, "alibi", False) or (
        isinstance(attn_config, dict) and attn_config.get("alibi")
    ):
        flags.append("attn_config.alibi")
    if flags or getattr(config, "position_embedding_type", None) == "alibi":
        return f"uses ALiBi position biases ({', '.join(flags) or 'position_embedding_type'}), which the paged path does not implement"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        return (
            f"has layers of type {other}: token mixers other than attention would see the"
            " packed step as one sequence"
        )
    return None


def _keeps_logits(model: PreTrainedModel, position_ids: torch.Tensor, full: torch.Tensor) -> bool:
    """Whether the forward takes ``logits_to_keep`` as a tensor of indices
    and gives those tokens' logits (up to the rounding of a smaller matmul)."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return False
    at = torch.tensor([2, 0], device=position_ids.device)
    ids = position_ids % full.shape[-1]
    try:
        kept = model(ids, position_ids=position_ids, use_cache=False, logits_to_keep=at).logits
    except (TypeError, IndexError, RuntimeError, ValueError):
        return False
    return kept.shape == (1, 2, full.shape[-1]) and torch.allclose(
        kept[0], full[0, at], rtol=1e-4, atol=1e-5
    )


def _judge(config: Any, calls: list[dict[str, Any]], keeps_logits: bool) -> KVSpec | str:
    """The verdict on a probe's attention calls."""
    if not calls:
        return (
            "does not route attention through transformers' AttentionInterface"
            " (set_attn_implementation has no effect on it)"
        )
    layers = [c["layer"] for c in calls]
    if None in layers:
        return "has attention modules without a layer_idx"
    twice = sorted({i for i in layers if layers.count(i) > 1})
    if twice:
        return (
            f"calls attention more than once in layer(s) {twice} (as DiffLlama), and the"
            " cache holds one K/V per layer and step"
        )
    num_layers = config.num_hidden_layers
    if sorted(layers) != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(layers))
        return (
            f"has no attention in layer(s) {missing} of {num_layers}: their token mixers"
            " (SSM, linear attention, ...) would see the packed step as one sequence"
        )
    unknown = sorted(set().union(*(c["keywords"] for c in calls)) - KNOWN_KEYWORDS)
    if unknown:
        return f"passes attention keyword(s) {unknown} the paged path does not understand"
    if any(c["mask"] for c in calls):
        return (
            "passes attention a mask of its own (a position bias such as ALiBi, or its own"
            " masking), which the plan cannot replace"
        )
    if not all(c["causal"] for c in calls):
        return "has bidirectional attention, which cannot be decoded token by token"
    shapes = {c["shape"] for c in calls}
    if len(shapes) > 1:
        return f"has layers of different K/V shapes {sorted(shapes)}, and one cache holds one"
    ((num_kv_heads, head_dim, v_head_dim),) = shapes
    layer_types = list(getattr(config, "layer_types", None) or ())
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and "chunked_attention" not in layer_types:
        return (
            f"sets attention_chunk_size={chunk} without layer_types naming its chunked"
            " layers (chunking lives in the mask, which the plan replaces)"
        )
    unwindowed = [
        c["layer"]
        for c in calls
        if c["layer"] < len(layer_types)
        and layer_types[c["layer"]] == "sliding_attention"
        and c["window"] is None
    ]
    if unwindowed:
        return (
            f"types layer(s) {unwindowed} sliding_attention but passes their attention no"
            " sliding_window (the window lives in the mask, which the plan replaces)"
        )
    chunk_sizes = [None] * num_layers
    for c in calls:
        if c["layer"] < len(layer_types) and layer_types[c["layer"]] == "chunked_attention":
            chunk_sizes[c["layer"]] = chunk
    sinks = any(c["sinks"] for c in calls)
    layer_windows = [None] * num_layers
    if not any(chunk_sizes):
        for c in calls:
            layer_windows[c["layer"]] = None if c["window"] is None else int(c["window"])
    windows = set(layer_windows)
    window = windows.pop() if len(windows) == 1 else None
    return KVSpec(
        num_layers,
        num_kv_heads,
        head_dim,
        v_head_dim,
        tuple(chunk_sizes),
        sinks,
        keeps_logits,
        window,
        tuple(layer_windows),
    )


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
    if logits_at.numel() and not (int(logits_at.min()) >= 0 and int(logits_at.max()) < total):
        raise ValueError(
            f"expected logits_at in [0, {total}), got values in"
            f" [{int(logits_at.min())}, {int(logits_at.max())}]"
        )


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
        context = _CONTEXT.get()
        if isinstance(context, _Probe):
            return _record(context, module, query, key, value, attention_mask, kwargs)
    unknown = kwargs.keys() - KNOWN_KEYWORDS
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


# Host work each call (the plan's index arrays): CUDA graphs capture around it.
@torch.library.custom_op(
    "mstar::paged_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def _paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One layer's cache write and paged attention as a custom op, for a
    compiled forward: the step's plan and cache come from the context
    ``forward_step`` sets (they are no tensors of the graph), the cache is
    written in place. ``query`` ``[1, H, T', D]`` may be padded past the
    step's tokens (a compiled forward's bucket): the extra queries give zeros."""
    return _attend_layer(query, key, value, layer, scaling, sliding_window, softcap, sinks)


@_paged_attention_op.register_fake
def _(query, key, value, layer, scaling, sliding_window, softcap, sinks):
    return query.new_empty((1, query.shape[2], query.shape[1], value.shape[3]))


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
    attend over its plan: ``[1, T', H, D_v]`` (T' >= the step's tokens; the
    queries past them give zeros)."""
    context = _CONTEXT.get()
    if not isinstance(context, _Step):
        raise ValueError(
            "expected a plan and a cache for paged attention, got none: run the model"
            " through mstar.integrations.hf.forward_step(model, input_ids, plan, cache)"
        )
    if layer in context.layers_seen:
        raise ValueError(
            f"expected one attention call per layer and step, got a second in layer {layer}"
        )
    context.layers_seen.add(layer)
    group, local = (0, layer) if context.where is None else context.where[layer]
    plan, cache = context.plans[group], context.caches[group]
    total, padded = plan.get_total_len(), query.shape[2]
    if padded != total:
        query, key, value = query[:, :, :total], key[:, :, :total], value[:, :, :total]
    q = query[0].transpose(0, 1)
    cache.write(local, plan, key[0].transpose(0, 1), value[0].transpose(0, 1))
    options = {
        "causal": True,
        "sm_scale": scaling,
        "window_left": -1 if sliding_window is None else sliding_window - 1,
        "softcap": softcap,
        "sinks": sinks,
        "chunk_size": context.chunk_sizes[layer],
    }
    if context.flashinfer is None:
        schedule = context.schedules.get(group)
        if schedule is None:
            schedule = AttentionSchedule(plan.cpu_indptrs, cache.page_size, q.device)
            context.schedules[group] = schedule
        kv_layer = cache.layer(local)
        out = paged_attention(q, kv_layer, plan.cpu_indptrs, schedule=schedule, **options)
    else:
        context.flashinfer.plan(
            plan,
            num_qo_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=query.shape[3],
            page_size=cache.page_size,
            q_dtype=q.dtype,
            kv_dtype=cache.dtype,
            **options,
        )
        out = context.flashinfer.run(q, cache.layer(local))
    if padded != total:
        out = torch.cat([out, out.new_zeros((padded - total, *out.shape[1:]))])
    return out[None]


def _record(
    probe: _Probe,
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
