"""One step's paged attention, shared by every layer of the step.

What ``hf_attention`` does per layer call, with what is the same for every
layer set up once: the plan's write rows (``KVCache.write`` computes them at
the first layer), the attention schedule (rows batched, their gather
indices and masks: ``AttentionSchedule``) and the options. Each layer then
writes its keys and values where the plan says and attends over its pages.

A step whose rows each have one query (decode) or at most ``KERNEL_PAIRS``
query-key pairs (prefills up to a few hundred tokens: chat turns) attends
through the layer ops' ``attention`` when they are built (``kernels``,
``fused``) and the cache holds float32 or bfloat16 (``KERNEL_DTYPES``):
from the q/k/v GEMM's output, rotary applied, the layer's keys and values
written at the cache's ``write_rows``, then each query over its
row's pages read in place, no gather, no padding; the row arrays it reads
are converted once per step.
Longer rows (a long prompt's prefill) go to SDPA's blocked kernel over
gathered pages (``paged_attention``), faster there than the op's query at a
time.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import AttentionSchedule, paged_attention
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.lengths import row_lengths
from mstar.engine.resources.kv.plan import KVPlanOutput
from mstar.models.llama.rotary import StepRotary

__all__ = ["StepAttention"]

# most (query, key) pairs a row of several queries for the layer ops' attention: a fresh
# prompt of 511 tokens (SmolLM2's whole step: 278 ms against SDPA's 289 at 512 tokens,
# 812 against 738 at 1024; measured on Zen 5)
KERNEL_PAIRS = 1 << 17
# the cache dtypes the layer ops' attention reads (a float16 cache: paged_attention)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class StepAttention:
    """Causal paged attention (no window, chunks, softcap or sinks) over
    ``plan`` and ``cache`` for one step, scores scaled by ``scaling``."""

    def __init__(
        self,
        plan: KVPlanOutput,
        cache: KVCache,
        scaling: float,
        device: torch.device,
        kernels: bool = False,
    ) -> None:
        self.plan, self.cache, self.scaling = plan, cache, scaling
        self.schedule: AttentionSchedule | None = None
        self.rows: tuple[torch.Tensor, ...] | None = None
        indptrs = plan.cpu_indptrs
        qo_indptr, kv_indptr, qo_lens, _, kv_lens = row_lengths(indptrs, cache.page_size)
        # one [P, 2, ...] tensor per layer, of a dtype the op reads
        dense = cache.v_head_dim == cache.head_dim and cache.dtype in KERNEL_DTYPES
        if kernels and dense and device.type == "cpu" and _short(qo_lens, kv_lens):
            q_index = np.where(qo_lens > 0, qo_indptr[:-1], -1)
            self.rows = cache.write_rows(plan) + tuple(
                torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
                for a in (q_index, qo_lens, kv_indptr, indptrs.paged_kv_indices.numpy(), kv_lens)
            )
            self._fused = torch.ops.mstar_layer.attention.default
        else:
            self.schedule = AttentionSchedule(indptrs, cache.page_size, device)
            self.options = AttentionOptions(True, scaling)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``layer``: ``k``, ``v`` ``[T, H_kv, D]`` written into the
        cache, then ``q`` ``[T, H, D]``'s attention over the plan,
        ``[T, H, D_v]``."""
        self.cache.write(layer, self.plan, k, v)
        return paged_attention(
            q, self.cache.layer(layer), self.plan.cpu_indptrs, self.options,
            schedule=self.schedule,
        )  # fmt: skip

    def fused(self, layer: int, qkv: torch.Tensor, rotary: StepRotary, heads: int) -> torch.Tensor:
        """Layer ``layer`` of a step the layer ops serve (``rows`` not None)
        straight from the q/k/v GEMM's output ``[T, (H + 2 H_kv) D]``:
        rotary on q and k, k and v written into the cache, q's attention
        over each row's pages: ``[T, H * D]``."""
        return self._fused(
            qkv, rotary.cos_rows, rotary.sin_rows, self.cache.layer(layer), *self.rows,
            heads, self.scaling,
        )  # fmt: skip


def _short(qo_lens: np.ndarray, kv_lens: np.ndarray) -> bool:
    """Whether every row has one query or at most ``KERNEL_PAIRS`` causal
    (query, key) pairs."""
    if qo_lens.max(initial=0) <= 1:  # decode rows (or none)
        return True
    q, kv = qo_lens.astype(np.int64), kv_lens.astype(np.int64)
    return bool(((q <= 1) | (q * kv - q * (q - 1) // 2 <= KERNEL_PAIRS)).all())
