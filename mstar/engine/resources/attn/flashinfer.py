"""FlashInfer's paged attention behind the KV plan (CUDA only).

FlashInfer splits a step into a host-side ``plan`` (scheduling from the CPU
index arrays, once per step) and a ``run`` per layer. This adapter feeds it the
plan's CPU index tensors and picks the decode kernel when every row computes
one token. ``flashinfer`` is imported when an adapter is built, so this module
imports without it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.kv.plan import KVPlanOutput

__all__ = ["FlashInferPagedAttention", "unsupported"]


def unsupported(
    *, sinks: bool = False, chunk_size: int | None = None, head_dim: int = 0, v_head_dim: int = 0
) -> str | None:
    """Why this adapter cannot serve an attention (None: it can). FlashInfer's
    paged prefill/decode wrappers have soft-capping (``logits_soft_cap``) but
    no attention sinks, no chunked attention and one head width for K and V."""
    if sinks:
        return "attention sinks (s_aux)"
    if chunk_size is not None:
        return "chunked attention (attention_chunk_size)"
    if head_dim != v_head_dim:
        return f"a value width ({v_head_dim}) other than the key width ({head_dim})"
    return None


class FlashInferPagedAttention:
    """One workspace and a lazily built prefill and decode wrapper (NHD).

    Call ``plan`` once per step, then ``run`` per layer. ``plan`` is a no-op
    when called again with the same plan object and parameters, so per-layer
    callers may call it unconditionally.
    """

    def __init__(
        self, workspace_bytes: int = 128 * 1024 * 1024, device: torch.device | str = "cuda"
    ) -> None:
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError("FlashInferPagedAttention needs the flashinfer package") from e
        if not torch.cuda.is_available():
            raise RuntimeError("FlashInferPagedAttention needs CUDA, which is unavailable")
        self._flashinfer = flashinfer
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill: Any = None
        self._decode: Any = None
        self._active: Any = None
        self._planned: tuple[KVPlanOutput, tuple] | None = None

    def plan(
        self,
        plan: KVPlanOutput,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        options: AttentionOptions = AttentionOptions(),
        q_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Plan the step's attention (decode kernel for decode plans; the
        prefill kernel, bottom-right ``options.causal``, otherwise). A decode
        row's single query sees its whole KV, so ``causal`` does not apply
        there. ``softcap`` is FlashInfer's ``logits_soft_cap``; ``sinks`` and
        ``chunk_size`` raise ``ValueError``."""
        reason = unsupported(sinks=options.sinks is not None, chunk_size=options.chunk_size)
        if reason is not None:
            raise ValueError(f"expected an attention FlashInfer serves, got {reason}")
        params = (num_qo_heads, num_kv_heads, head_dim, page_size, options, q_dtype, kv_dtype)
        if self._planned is not None and self._planned[0] is plan and self._planned[1] == params:
            return
        idx = plan.cpu_indptrs
        shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        kwargs: dict[str, Any] = {
            "sm_scale": options.sm_scale,
            "window_left": options.window_left,
            "q_data_type": q_dtype,
            "kv_data_type": q_dtype if kv_dtype is None else kv_dtype,
        }
        if options.softcap is not None:
            kwargs["logits_soft_cap"] = options.softcap
        if plan.is_decode:
            if self._decode is None:
                self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD"
                )
            wrapper = self._decode
            if idx.kv_lens is not None and _accepts_keyword(wrapper.plan, "seq_lens"):
                kwargs["seq_lens"] = idx.kv_lens
            indices = (idx.paged_kv_indptr, idx.paged_kv_indices, idx.paged_kv_last_page_len)
        else:
            if self._prefill is None:
                self._prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, "NHD"
                )
            wrapper = self._prefill
            kwargs["causal"] = options.causal
            indices = idx[:4]
        wrapper.plan(*indices, *shape, **kwargs)
        self._active = wrapper
        self._planned = (plan, params)

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention for one layer: ``q`` ``[total_q, num_qo_heads, head_dim]``,
        ``kv_layer`` ``[num_pages, 2, page_size, num_kv_heads, head_dim]``;
        returns q's shape. A ``(k, v)`` pair of different widths raises."""
        if self._active is None:
            raise RuntimeError("FlashInferPagedAttention.run called before plan")
        if isinstance(kv_layer, tuple):
            reason = unsupported(head_dim=kv_layer[0].shape[-1], v_head_dim=kv_layer[1].shape[-1])
            if reason is not None:
                raise ValueError(f"expected an attention FlashInfer serves, got {reason}")
        return self._active.run(q.contiguous(), kv_layer)


def _accepts_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` (a ``**kwargs`` counts: newer
    FlashInfer releases forward ``plan``'s keywords to an implementation)."""
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
