"""A Llama-family decoder layer in few ops, on the HF layer's own weights.

``FusedLlamaLayer`` computes what HF's eager ``LlamaDecoderLayer`` (or a
layer of another ``family.FAMILIES`` architecture) computes for a packed
step (``[T, hidden]``, no batch axis): RMSNorm as one ``torch.rms_norm``;
q, k and v as one GEMM (``RowConcat``, their biases added); Qwen3's RMSNorm
of each query and key head (``head_norms``); rotary on q and k together
(``StepRotary``); the KV write and paged attention of the step
(``StepAttention``); o_proj; the residual added in place; RMSNorm; gate and
up as one GEMM; ``act(gate) * up``; down, added to the residual by the next
layer. With the layer ops built (``layer_ops``), each norm is one call with
the residual add before it (the head norms one call too), a short step's
rotary, KV write and attention one call, and SiLU times up one call. The
sums are HF's own up to float32 rounding (a GEMM over more rows, a norm's
sum in another order, a fused multiply-add).
"""

from __future__ import annotations

import torch
from transformers.activations import SiLUActivation

from mstar.models.llama.attention import StepAttention
from mstar.models.llama.family import Family
from mstar.models.llama.fused_linear import RowConcat, concat_refusal, linear
from mstar.models.llama.rotary import StepRotary

__all__ = ["FusedLlamaLayer", "added_norm", "layer_refusal"]


def layer_refusal(layer: torch.nn.Module, family: Family) -> str | None:
    """Why ``layer`` cannot run as a ``FusedLlamaLayer`` of ``family``'s
    (None: it can)."""
    types = {
        "": family.layer,
        "self_attn": family.attention,
        "mlp": family.mlp,
        "input_layernorm": family.norm,
        "post_attention_layernorm": family.norm,
    }
    if family.head_norms:
        types |= {"self_attn.q_norm": family.norm, "self_attn.k_norm": family.norm}
    for name, kind in types.items():
        module = layer.get_submodule(name) if name else layer
        if type(module) is not kind:
            return f"has a {type(module).__name__} where a {kind.__name__} is expected"
    if any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules()):
        return "has hooks on its modules"
    attn, mlp = layer.self_attn, layer.mlp
    if family.head_norms and attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
        return "has query and key head norms of different epsilons"
    for linears in (
        (attn.q_proj, attn.k_proj, attn.v_proj),
        (mlp.gate_proj, mlp.up_proj),
        (attn.o_proj,),
        (mlp.down_proj,),
    ):
        reason = concat_refusal(linears)
        if reason is not None:
            return reason
    return None


def added_norm(
    h: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module, kernels: bool
) -> torch.Tensor:
    """``norm`` (an RMSNorm) of ``h`` after ``h += delta`` in place (``delta``
    None: nothing added): one layer op with ``kernels``, else aten's."""
    if kernels:
        return torch.ops.mstar_layer.rms_norm.default(h, delta, norm.weight, norm.variance_epsilon)
    if delta is not None:
        h.add_(delta)
    return torch.rms_norm(h, (h.shape[1],), norm.weight, norm.variance_epsilon)


class FusedLlamaLayer:
    """Layer ``index`` of a Llama-family model (``layer_refusal`` None for
    its ``family``), its q/k/v and gate/up weights rebound as views of
    their concatenations."""

    def __init__(
        self, layer: torch.nn.Module, index: int, family: Family, kernels: bool = False
    ) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index, self.kernels = index, kernels
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        # Qwen3's RMSNorms of each query and of each key head (None: none)
        self.head_norms = (attn.q_norm, attn.k_norm) if family.head_norms else None
        self.qkv = RowConcat((attn.q_proj, attn.k_proj, attn.v_proj))
        self.gate_up = RowConcat((mlp.gate_proj, mlp.up_proj))
        self.o_proj, self.down, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.intermediate = mlp.gate_proj.out_features
        self.silu = type(self.act) is SiLUActivation or type(self.act) is torch.nn.SiLU

    def current(self) -> bool:
        """Whether the HF layer's q/k/v and gate/up still share the fused weights."""
        return self.qkv.current() and self.gate_up.current()

    def __call__(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        rotary: StepRotary,
        attention: StepAttention,
    ) -> torch.Tensor:
        """``h`` ``[T, hidden]`` (contiguous, the residual stream) plus
        ``pending`` (the previous layer's MLP output; None at the first),
        then this layer's attention added, in place; returns its MLP output,
        for the next layer (or the caller) to add."""
        if self.kernels:
            return self._with_kernels(h, pending, rotary, attention)
        tokens = h.shape[0]
        x = added_norm(h, pending, self.norm1, kernels=False)
        qkv = self._normed(self.qkv(x))
        split = (self.heads + self.kv_heads) * self.head_dim
        qk = rotary(qkv[:, :split].view(tokens, -1, self.head_dim))
        v = qkv[:, split:].view(tokens, self.kv_heads, self.head_dim)
        out = attention(self.index, qk[:, : self.heads], qk[:, self.heads :], v)
        x = added_norm(h, linear(self.o_proj, out.reshape(tokens, -1)), self.norm2, kernels=False)
        return self._mlp(x)

    def _with_kernels(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        rotary: StepRotary,
        attention: StepAttention,
    ) -> torch.Tensor:
        """``__call__`` through the layer ops: each norm one call with the
        residual add before it; a short step's rotary, KV write and
        attention one call; ``silu(gate) * up`` one call."""
        ops = torch.ops.mstar_layer
        x = added_norm(h, pending, self.norm1, kernels=True)
        qkv = self._normed(self.qkv(x))
        if attention.rows is not None:
            out = attention.fused(self.index, qkv, rotary, self.heads)
        else:
            tokens, dim = qkv.shape[0], self.head_dim
            rotary.rotate_(qkv, self.heads + self.kv_heads)
            q_end, k_end = self.heads * dim, (self.heads + self.kv_heads) * dim
            q = qkv[:, :q_end].view(tokens, self.heads, dim)
            k = qkv[:, q_end:k_end].view(tokens, self.kv_heads, dim)
            v = qkv[:, k_end:].view(tokens, self.kv_heads, dim)
            out = attention(self.index, q, k, v).reshape(tokens, -1)
        x = added_norm(h, linear(self.o_proj, out), self.norm2, kernels=True)
        if self.silu:
            return linear(self.down, ops.silu_mul.default(self.gate_up(x)))
        return self._mlp(x)

    def _normed(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` ``[T, (H + 2 H_kv) D]`` (the GEMM's own output) with each
        query and key head through its RMSNorm in place, where the layer has
        head norms: one layer op with the kernels, else aten's."""
        if self.head_norms is None:
            return qkv
        q_norm, k_norm = self.head_norms
        if self.kernels:
            torch.ops.mstar_layer.head_norms_.default(
                qkv, q_norm.weight, k_norm.weight, self.heads, self.kv_heads,
                q_norm.variance_epsilon,
            )  # fmt: skip
            return qkv
        width = (self.heads + self.kv_heads) * self.head_dim
        heads = qkv[:, :width].unflatten(1, (-1, self.head_dim))
        for norm, part in ((q_norm, heads[:, : self.heads]), (k_norm, heads[:, self.heads :])):
            part.copy_(torch.rms_norm(part, (self.head_dim,), norm.weight, norm.variance_epsilon))
        return qkv

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))`` in aten ops."""
        gate_up = self.gate_up(x)
        mixed = self.act(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :])
        return linear(self.down, mixed)
