"""Run a Hugging Face decoder's packed step through a KV plan.

transformers calls a registered attention function per layer with the
keywords the caller passed to ``model(...)``; ``forward_step`` passes the plan
and the cache that way (``mstar_plan``, ``mstar_cache``, and optionally
``mstar_flashinfer``), so nothing rides in module state. Checked against
transformers 5.24 (Llama and Mistral): the extra keywords reach the attention
function unchanged, and a name unknown to the mask interface makes the model
skip building a mask, which the plan replaces.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention
from mstar.engine.resources.attn.paged import paged_attention
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import KVPlanOutput
from mstar.engine.resources.position import positions

__all__ = ["ATTENTION_NAME", "forward_step", "register"]

ATTENTION_NAME = "mstar_paged"


def register() -> str:
    """Register the paged attention function with transformers (idempotent)
    and return its name, for ``model.set_attn_implementation(register())``."""
    AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)
    return ATTENTION_NAME


def forward_step(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    plan: KVPlanOutput,
    cache: KVCache,
    *,
    flashinfer: FlashInferPagedAttention | None = None,
) -> torch.Tensor:
    """One packed step: ``input_ids`` ``[plan.get_total_len()]`` in plan order
    in, logits ``[plan.get_total_len(), vocab]`` out. Each layer writes the
    step's keys and values into ``cache`` and attends over the plan's pages
    (through ``flashinfer`` when given, planned once per step). Inference
    only: runs without autograd. The model must use ``register()``'s
    attention implementation."""
    implementation = model.config._attn_implementation
    if implementation != ATTENTION_NAME:
        raise ValueError(
            f"expected the model's attention implementation {ATTENTION_NAME!r}"
            f" (model.set_attn_implementation(register())), got {implementation!r}"
        )
    if input_ids.dim() != 1 or input_ids.shape[0] != plan.get_total_len():
        raise ValueError(
            f"expected input_ids of shape ({plan.get_total_len()},), got {tuple(input_ids.shape)}"
        )
    if input_ids.shape[0] == 0:  # a zero-span step: nothing to compute
        return torch.empty(0, model.config.vocab_size, device=input_ids.device)
    position_ids = positions(plan).to(input_ids.device)
    with torch.no_grad():
        output = model(
            input_ids[None],
            position_ids=position_ids[None],
            use_cache=False,
            mstar_plan=plan,
            mstar_cache=cache,
            mstar_flashinfer=flashinfer,
        )
    return output.logits[0]


def _paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    sliding_window: int | None = None,
    mstar_plan: KVPlanOutput | None = None,
    mstar_cache: KVCache | None = None,
    mstar_flashinfer: FlashInferPagedAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract: ``query`` ``[1, H, T, D]`` and
    ``key``/``value`` ``[1, H_kv, T, D]`` (RoPE applied) in, ``[1, T, H, D]``
    out. ``attention_mask`` is ignored: the plan says what each token sees."""
    if mstar_plan is None or mstar_cache is None:
        raise ValueError(
            f"expected mstar_plan and mstar_cache keywords (call through forward_step),"
            f" got {type(mstar_plan).__name__} and {type(mstar_cache).__name__}"
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"expected no {name} (paged attention has none), got one")
    if query.shape[0] != 1:
        raise ValueError(f"expected a packed batch of 1, got batch {query.shape[0]}")
    layer = module.layer_idx
    q = query[0].transpose(0, 1)
    mstar_cache.write(layer, mstar_plan, key[0].transpose(0, 1), value[0].transpose(0, 1))
    causal = getattr(module, "is_causal", True)
    window_left = -1 if sliding_window is None else sliding_window - 1
    if mstar_flashinfer is None:
        out = paged_attention(
            q,
            mstar_cache.layer(layer),
            mstar_plan.cpu_indptrs,
            causal=causal,
            sm_scale=scaling,
            window_left=window_left,
        )
    else:
        mstar_flashinfer.plan(
            mstar_plan,
            num_qo_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=query.shape[3],
            page_size=mstar_cache.page_size,
            causal=causal,
            sm_scale=scaling,
            window_left=window_left,
            q_dtype=q.dtype,
            kv_dtype=mstar_cache.dtype,
        )
        out = mstar_flashinfer.run(q, mstar_cache.layer(layer))
    return out[None], None
