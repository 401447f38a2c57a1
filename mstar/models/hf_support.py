"""What the paged path serves of a Hugging Face model, and its KV layout.

What it cannot serve exactly is refused before anything runs:
``supports(model)`` probes the model once (a three-token forward whose
attention records how it is called and returns zeros) and names the reason —
attention not routed through the interface, called more than once per layer,
layers without it (hybrid SSM / linear attention), a mask of its own (ALiBi),
bidirectional attention, or an attention keyword the attention function does
not understand. A model it serves gets its ``KVSpec``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from mstar.engine.resources.attn.flashinfer import unsupported
from mstar.models.hf_attention import CONTEXT, KNOWN_KEYWORDS, Probe, register

__all__ = ["KVSpec", "flashinfer_unsupported", "kv_spec", "supports"]

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
    probe = Probe()
    token = CONTEXT.set(probe)
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
        CONTEXT.reset(token)
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
