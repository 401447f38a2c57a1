"""The architectures the fused forward serves, as their transformers classes.

Llama's decoder and those built as it is, module for module: Mistral (its
sliding window is the attention's, which ``hf`` checks per step), Qwen2
(q/k/v with bias, which the fused linear layers add) and Qwen3 (an RMSNorm
over each query and key head before rotary: ``head_norms``). A model is
served only when every module is exactly its architecture's class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3

__all__ = ["FAMILIES", "Family"]


@dataclass(frozen=True)
class Family:
    """One architecture's classes: the decoder stack (a causal LM's
    ``model``), its layers and their attention, MLP and RMSNorm modules;
    ``head_norms``: the attention's ``q_norm`` and ``k_norm`` (of ``norm``'s
    class) over each head."""

    model: type[torch.nn.Module]
    layer: type[torch.nn.Module]
    attention: type[torch.nn.Module]
    mlp: type[torch.nn.Module]
    norm: type[torch.nn.Module]
    head_norms: bool = False


# by causal LM class
FAMILIES: dict[type[torch.nn.Module], Family] = {
    llama.LlamaForCausalLM: Family(
        llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP,
        llama.LlamaRMSNorm,
    ),
    mistral.MistralForCausalLM: Family(
        mistral.MistralModel, mistral.MistralDecoderLayer, mistral.MistralAttention,
        mistral.MistralMLP, mistral.MistralRMSNorm,
    ),
    qwen2.Qwen2ForCausalLM: Family(
        qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP,
        qwen2.Qwen2RMSNorm,
    ),
    qwen3.Qwen3ForCausalLM: Family(
        qwen3.Qwen3Model, qwen3.Qwen3DecoderLayer, qwen3.Qwen3Attention, qwen3.Qwen3MLP,
        qwen3.Qwen3RMSNorm, head_norms=True,
    ),
}  # fmt: skip
