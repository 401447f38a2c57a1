"""Small Llama-shaped GGUF files written here, no downloads: random blocks of
any GGUF type (the scales finite and small), a byte-level tokenizer, the
tensors in the types a caller names (e.g. ``q4_k_m_types``, what llama.cpp's
Q4_K_M mix puts where). ``gguf.quants.dequantize`` is the reference for what
the blocks hold. Also used by ``benchmarks/gguf_models.py``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from itertools import chain, islice
from pathlib import Path

import numpy as np

# byte offsets of each block's float16 scales (d, and dmin / min where the type has one)
HALF_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
# a scale's standard deviation per type: the weights then stay within ~0.1-0.3
SCALE_STD = {
    "Q4_0": 0.01,
    "Q4_1": 0.01,
    "Q5_0": 0.005,
    "Q5_1": 0.005,
    "Q8_0": 0.001,
    "Q2_K": 0.002,
    "Q3_K": 0.0005,
    "Q4_K": 0.0002,
    "Q5_K": 0.0001,
    "Q6_K": 0.00005,
}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


@dataclass(frozen=True)
class LlamaShape:
    """A Llama's sizes, as a GGUF's metadata gives them."""

    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 512
    vocab: int = 288  # 256 bytes, 31 merges, the end-of-text token

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def random_blocks(
    type_name: str, rows: int, width: int, rng: np.random.Generator, std: float | None = None
) -> np.ndarray:
    """Raw GGUF rows (uint8 ``[rows, bytes a row]``) of random ``type_name``
    blocks: random bytes, the float16 scales drawn small and finite, so
    the weights' standard deviation is ``std`` where given (the scales
    drawn ``std / weight_std(type_name)`` times wider)."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    per_block, size = gguf.GGML_QUANT_SIZES[kind]
    if width % per_block:
        raise ValueError(f"expected a width divisible by {per_block} for {type_name}, got {width}")
    blocks = rng.integers(0, 256, (rows, width // per_block, size), dtype=np.uint8)
    spread = SCALE_STD[type_name] * (1 if std is None else std / weight_std(type_name))
    for offset in HALF_OFFSETS[type_name]:
        halves = np.abs(rng.normal(0, spread, (rows, width // per_block)))
        blocks[:, :, offset : offset + 2] = halves.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@cache
def weight_std(type_name: str) -> float:
    """The standard deviation of ``random_blocks``' weights of ``type_name``
    (by ``SCALE_STD``), measured on a sample dequantized by gguf-py."""
    import gguf

    sample = random_blocks(type_name, 64, 1024, np.random.default_rng(0))
    return float(gguf.quants.dequantize(sample, gguf.GGMLQuantizationType[type_name]).std())


def random_tensor(
    type_name: str, rows: int, width: int, rng: np.random.Generator, std: float | None = None
) -> np.ndarray:
    """A weight ``[rows, width]`` as ``GGUFWriter.add_tensor`` takes it: raw
    blocks for a quantized type, the values for F32/F16; of standard
    deviation ``std`` where given (else the types' own: ~0.05-0.08)."""
    if type_name in FLOAT_TYPES:
        return rng.normal(0, std or 0.05, (rows, width)).astype(FLOAT_TYPES[type_name])
    return random_blocks(type_name, rows, width, rng, std)


def q4_k_m_types(name: str, layer: int, layers: int) -> str:
    """llama.cpp's Q4_K_M mix: Q6_K for the head and for ``attn_v`` and
    ``ffn_down`` in the first and last eighths of the layers and every third
    between, Q4_K elsewhere."""
    if name == "output":
        return "Q6_K"
    more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if name in ("attn_v", "ffn_down") and more_bits:
        return "Q6_K"
    return "Q4_K"


def q5_k_m_types(name: str, layer: int, layers: int) -> str:
    """llama.cpp's Q5_K_M mix: Q4_K_M's (``q4_k_m_types``) with Q5_K for Q4_K."""
    type_name = q4_k_m_types(name, layer, layers)
    return "Q5_K" if type_name == "Q4_K" else type_name


def linear_shapes(shape: LlamaShape) -> dict[str, tuple[int, int]]:
    """Each layer's linear tensors' ``[rows, width]`` by GGUF name."""
    kv = shape.kv_heads * shape.head_dim
    return {
        "attn_q": (shape.hidden, shape.hidden),
        "attn_k": (kv, shape.hidden),
        "attn_v": (kv, shape.hidden),
        "attn_output": (shape.hidden, shape.hidden),
        "ffn_gate": (shape.ffn, shape.hidden),
        "ffn_up": (shape.ffn, shape.hidden),
        "ffn_down": (shape.hidden, shape.ffn),
    }


def byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """``(tokens, merges)``: GPT-2's 256 byte tokens, ``size - 257`` merges
    (letter pairs first, then any pair of bytes), and ``<|endoftext|>`` last."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    if not 257 <= size <= 257 + len(tokens) ** 2:
        raise ValueError(
            f"expected a vocabulary of 257-{257 + len(tokens) ** 2} tokens, got {size}"
        )
    letters = "etaoinshrdlu"
    first = [(a, b) for a in "Ġ" + letters for b in letters]
    taken = set(first)
    rest = ((a, b) for a in tokens for b in tokens if (a, b) not in taken)
    pairs = list(islice(chain(first, rest), size - 257))
    return tokens + [a + b for a, b in pairs] + ["<|endoftext|>"], [f"{a} {b}" for a, b in pairs]


def write_llama_gguf(
    path: Path,
    types: Callable[[str, int, int], str] | Mapping[str, str] = q4_k_m_types,
    shape: LlamaShape = LlamaShape(),
    seed: int = 0,
    arch: str = "llama",
    tied: bool = False,
    std: float | None = None,
) -> Path:
    """A Llama GGUF at ``path`` of ``shape``, its linear tensors and embedding
    in the types ``types`` gives (a function of the GGUF name without
    ``blk.N.`` / ``.weight``, the layer and the layer count, the head's
    name ``output``, the embedding's ``token_embd``; or a mapping of those
    names, ``Q4_K`` where absent); norms float32. ``arch`` ``qwen2`` adds
    q/k/v biases, ``qwen3`` q/k RMSNorms (float32, as llama.cpp writes them).
    ``tied``: no ``output.weight``, the head tied to the embedding (as
    SmolLM2's and Llama 3.2 1B's files). ``std``: every linear tensor's and
    the embedding's weights of that standard deviation (a real 1B's are
    ~0.02), else each type's own (``random_tensor``)."""
    import gguf

    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"expected arch llama, qwen2 or qwen3, got {arch!r}")
    pick = types if callable(types) else (lambda name, i, n: types.get(name, "Q4_K"))
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, shape)

    def add(name: str, type_name: str, rows: int, width: int) -> None:
        data = random_tensor(type_name, rows, width, rng, std)
        raw = None if type_name in FLOAT_TYPES else gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, data, raw_dtype=raw)

    add("token_embd.weight", pick("token_embd", 0, shape.layers), shape.vocab, shape.hidden)
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", _norm(shape.hidden, rng))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", _norm(shape.hidden, rng))
        for name, (rows, width) in linear_shapes(shape).items():
            add(f"blk.{i}.{name}.weight", pick(name, i, shape.layers), rows, width)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                bias = rng.normal(0, 0.1, rows).astype(np.float32)
                writer.add_tensor(f"blk.{i}.{name}.bias", bias)
        if arch == "qwen3":
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", _norm(shape.head_dim, rng))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", _norm(shape.head_dim, rng))
    writer.add_tensor("output_norm.weight", _norm(shape.hidden, rng))
    if not tied:
        add("output.weight", pick("output", 0, shape.layers), shape.vocab, shape.hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _norm(width: int, rng: np.random.Generator) -> np.ndarray:
    return (1 + rng.normal(0, 0.1, width)).astype(np.float32)


def _write_metadata(writer: object, shape: LlamaShape) -> None:
    writer.add_name("tiny-llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_key_length(shape.head_dim)  # (qwen3's config reads its head_dim here)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    tokens, merges = byte_level_vocab(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])  # the last: control
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
