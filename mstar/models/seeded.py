"""A seeded random transformers model: no download, for the demo's
``--model random``, the tests and the benchmarks where speed, not text, matters."""

from __future__ import annotations

import copy

import torch


def build_model(
    seed: int,
    device: str | torch.device = "cpu",
    vocab_size: int = 256,
    config_class: str = "LlamaConfig",
    **settings: object,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded random model (no download; a 2-layer Llama unless
    ``config_class``, a transformers config name, and ``settings`` say
    otherwise), and a twin for the engine: the first is the oracle ``check``
    compares against."""
    import transformers

    sizes = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": 0,
    }
    config = getattr(transformers, config_class)(**{**sizes, **settings})
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval().to(device)
    return reference, copy.deepcopy(reference)
