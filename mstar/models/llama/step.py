"""The fused forward of a packed step, for the Llama family on the CPU.

``fused_step(model)`` gives a ``FusedLlama`` for a model it computes exactly
as HF's eager forward does (up to float32 rounding), or None, and then
``forward_step`` runs HF's own forward. It serves the causal LMs of
``family.FAMILIES`` (``LlamaForCausalLM``: SmolLM2, Llama 2/3, TinyLlama,
...; Mistral, Qwen2/2.5, Qwen3) with HF's own modules (any rope type,
activation, bias), float32 activations on the CPU, plain or packed
(``PackedLinear``) linear layers, a float32 or GGUF-block
(``QuantizedEmbedding``) embedding, in eval mode, without hooks or replaced
forwards (a compiled forward is one);
anything else is refused up front (``fused_refusal`` says why).

A step: the embedding; the rotary tables at the step's positions and the
attention schedule of its plan, once (``StepRotary``, ``StepAttention``);
every ``FusedLlamaLayer`` on the residual stream in place; the final norm
and the head at the kept tokens only.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from mstar.cpu.layer_ops import layer_ops_or_why
from mstar.cpu.quant.embedding import QuantizedEmbedding
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.plan import KVPlanOutput
from mstar.models.llama.attention import StepAttention
from mstar.models.llama.family import FAMILIES
from mstar.models.llama.fused_linear import StorageCheck, concat_refusal, linear
from mstar.models.llama.layer import FusedLlamaLayer, added_norm, layer_refusal
from mstar.models.llama.rotary import RotaryTable, StepRotary
from mstar.models.llama.stack import LayerStack

__all__ = ["FUSED_ATTRIBUTE", "FusedLlama", "fused_refusal", "fused_step"]

FUSED_ATTRIBUTE = "_mstar_fused"  # where a model keeps its FusedLlama (or the refusal)


def fused_step(model: PreTrainedModel) -> FusedLlama | None:
    """The model's ``FusedLlama`` (built at the first call, rebuilt when
    the model's q/k/v or gate/up weights got new storage since), or None
    when ``fused_refusal`` refuses it (its verdict kept on the model, as
    ``supports``'; hooks or replaced forwards of its submodules added after
    the first step are not seen)."""
    if model.training or "forward" in vars(model):
        return None  # HF's forward computes dropout / a compiled or wrapped forward runs
    fused = vars(model).get(FUSED_ATTRIBUTE)
    if isinstance(fused, FusedLlama) and fused.current():
        return fused
    if fused is None or isinstance(fused, FusedLlama):
        reason = fused_refusal(model)
        fused = reason if reason is not None else FusedLlama(model)
        vars(model)[FUSED_ATTRIBUTE] = fused
    return fused if isinstance(fused, FusedLlama) else None


def fused_refusal(model: PreTrainedModel) -> str | None:
    """Why the fused forward cannot serve ``model`` (None: it can), in
    training mode or with its forward replaced (compiled, wrapped) aside
    (``fused_step`` checks those per step)."""
    family = FAMILIES.get(type(model))
    if family is None:
        names = ", ".join(kind.__name__ for kind in FAMILIES)
        return f"is a {type(model).__name__}, not one of {names}"
    if type(model.model) is not family.model:
        return f"has a {type(model.model).__name__} where a {family.model.__name__} is expected"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "runs in a process group (tensor parallel shards)"
    inner = model.model
    reason = _embedding_refusal(inner.embed_tokens)
    if reason is not None:
        return reason
    if type(inner.norm) is not family.norm:
        return "has a final norm of its own"
    if len(inner.layers) != model.config.num_hidden_layers:
        return "runs fewer layers than it holds (config.num_hidden_layers)"
    floats = [p for p in model.parameters() if p.is_floating_point()]
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in floats):
        return "has parameters that are not float32 on the CPU"
    if any(m._forward_hooks or m._forward_pre_hooks for m in (model, inner, inner.norm)):
        return "has hooks on its modules"
    if any("forward" in vars(m) for m in model.modules()):
        return "has a module whose forward was replaced on the instance"
    reason = concat_refusal((model.lm_head,))
    for layer in inner.layers:
        reason = reason or layer_refusal(layer, family)
    return reason


def _embedding_refusal(embed: torch.nn.Module) -> str | None:
    """Why the fused forward cannot look tokens up in ``embed`` (None: it
    can): a float32 ``nn.Embedding`` on the CPU without ``max_norm``, or a
    ``QuantizedEmbedding`` (float32 rows; called as HF's forward calls it)."""
    if type(embed) is QuantizedEmbedding:
        return None
    if type(embed) is not torch.nn.Embedding:
        return "has an embedding of its own"
    if embed.max_norm is not None:
        return "renormalizes its embeddings (max_norm)"
    weight = embed.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return f"computes in {weight.dtype} on {weight.device}, not float32 on the CPU"
    return None


class FusedLlama:
    """A Llama-family causal LM (``fused_refusal`` None) as fused layers."""

    def __init__(self, model: PreTrainedModel) -> None:
        inner = model.model
        self.embed, self.norm, self.head = inner.embed_tokens, inner.norm, model.lm_head
        self.rotary_emb = inner.rotary_emb
        self.kernels = layer_ops_or_why() is None
        family = FAMILIES[type(model)]
        self.layers = [
            FusedLlamaLayer(layer, i, family, self.kernels) for i, layer in enumerate(inner.layers)
        ]
        self.scaling = inner.layers[0].self_attn.scaling
        self._signs: torch.Tensor | None = None  # the last step's ``StepRotary.signs``
        # the rotary tables at every position so far, where the rope type's are fixed
        self._table = RotaryTable(self.rotary_emb) if RotaryTable.serves(self.rotary_emb) else None
        self.stack = LayerStack(self.layers) if LayerStack.refusal(self.layers) is None else None
        # every layer's q/k/v and gate/up checks as one (``current`` runs every step)
        self._check = StorageCheck.joined(
            [joined.check for layer in self.layers for joined in (layer.qkv, layer.gate_up)]
        )

    def current(self) -> bool:
        """Whether every layer still shares the model's weights."""
        return self._check()

    def _rotary(self, position_ids: torch.Tensor) -> StepRotary:
        """The step's rotary tables (float32 on the CPU: what this forward serves)."""
        rotary = None if self._table is None else self._table(position_ids)
        if rotary is not None:
            return rotary
        rotary = StepRotary(self.rotary_emb, position_ids, torch.float32, self._signs)
        self._signs = rotary.signs
        return rotary

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        plan: KVPlanOutput,
        cache: KVCache,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """Logits ``[len(keep), vocab]`` (``keep`` None: every token) of
        the step ``input_ids`` ``[T]`` at ``position_ids`` ``[T]``; writes
        every layer's keys and values into ``cache`` where ``plan`` says."""
        with torch.no_grad():
            if type(self.embed) is QuantizedEmbedding:
                h = self.embed(input_ids)
            else:
                h = torch.nn.functional.embedding(input_ids, self.embed.weight)
            rotary = self._rotary(position_ids.to(h.device))
            attention = StepAttention(plan, cache, self.scaling, h.device, self.kernels)
            pending = None if self.stack is None else self.stack(h, rotary, attention)
            if pending is None:  # not a step the stack serves
                for layer in self.layers:
                    pending = layer(h, pending, rotary, attention)
            if keep is not None:
                rows = keep.to(h.device)
                h, pending = h[rows], None if pending is None else pending[rows]
            return linear(self.head, added_norm(h, pending, self.norm, self.kernels))
