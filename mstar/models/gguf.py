"""A GGUF file straight to a model, never through a float32 copy of it.

The first load reads the file's metadata once (gguf-py's reader and
transformers' GGUF config and tokenizer: tens of seconds for a 49k-token
vocabulary) into a folder under the cache folder (``gguf_folder``): the
config, the tokenizer and an index of the tensors (name, the Hugging Face
parameter it maps to, type, offset, shape). A later load reads that folder
and the tensors straight from the file, each read into memory of its own
(not mapped: a mapping's pages count in the process's RSS until unmapped,
the whole file by the end of a load). The model is built
with its parameters on the meta device (accelerate's
``init_empty_weights``: buffers such as rotary frequencies stay real), and
each tensor is read once:

- a linear layer's weights of a type the kernels take exactly (Q4_0, Q4_1,
  Q8_0, Q4_K, Q5_K, Q6_K) are packed as they stand (``mstar.cpu.quant.gguf.decode_blocks``),
  read only when ``quantize_model`` swaps the layer (which keeps a meta
  weight until then) for a ``PackedLinear``: one layer's read form at a time;
- with ``pack``, the token embedding (a plain ``nn.Embedding``) of any
  type but F32 stays in its blocks (``QuantizedEmbedding``: rows
  dequantized as looked up), never a float32 table; a head tied to it
  gets its own packed form of the blocks (Q4_0, Q4_1, Q8_0) or, of other
  types, its float32 dequantization (``quantize_model`` makes that panels);
- every other tensor is dequantized to float32 (gguf-py's ``dequantize``,
  what transformers' own conversion does) into the parameter it maps to.

Rows come in the Hugging Face model's order: transformers' tensor processor
(llama's q/k permutation) applies to float tensors as it does on conversion
and to a packed tensor's or the kept embedding's rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from mstar.cpu.cachedir import cached, file_key
from mstar.cpu.quant.embedding import QuantizedEmbedding
from mstar.cpu.quant.gguf import PACKED_TYPES, Deferred, decode_blocks
from mstar.cpu.quant.packed import Packed

__all__ = ["GGUFWeights", "gguf_folder", "load_gguf"]

INDEX = "tensors.json"  # the index of the file's tensors, in the cache folder

# each weight the file holds, by its state-dict name: its packed form (None
# where no kernel takes its type, or packing was not asked) and its GGUF type
GGUFWeights = dict[str, tuple[Packed | Deferred | None, str]]


def load_gguf(
    path: Path, *, pack: bool, skip: frozenset[str] = frozenset()
) -> tuple[Any, GGUFWeights]:
    """The float32 model of the GGUF file at ``path`` in eval mode, and its
    weights (``GGUFWeights``). With ``pack``, linear layers of the packed
    types hold meta weights for ``quantize_model`` to swap, their tensors
    not read yet (``Deferred``: read as each layer is packed, so a load
    holds one layer's read form at a time, not the model's), and a quantized
    embedding stays in its blocks (``QuantizedEmbedding``); without, every
    weight is its float32 dequantization. The weights ``skip`` names are not
    read (they stay meta: packed layers stored from an earlier load take
    their place). ``ValueError`` naming a weight the model has and the file
    lacks."""
    from transformers import AutoConfig

    folder = gguf_folder(path)
    model = _empty_model(AutoConfig.from_pretrained(folder))
    linear = frozenset(
        f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    )
    kept = _embedding_weight(model) if pack else None
    weights: GGUFWeights = {}
    with torch.no_grad():
        tensors = _tensors(path, folder, model, pack, kept, skip, linear if pack else frozenset())
        for name, type_name, value in tensors:
            weights[name] = (value if isinstance(value, Packed | Deferred) else None, type_name)
            if isinstance(value, Deferred):  # a linear layer's, read when quantize_model swaps it
                continue
            if isinstance(value, QuantizedEmbedding):
                model.set_input_embeddings(value)
                continue
            floats = value.dequantize() if isinstance(value, Packed) else value
            _assign(model, name, floats)
        if getattr(model.config, "tie_word_embeddings", False):
            if isinstance(model.get_input_embeddings(), QuantizedEmbedding):
                _tie_head(model, weights, skip)
            else:
                model.tie_weights()
    missing = [
        n
        for n, p in model.named_parameters()
        if p.is_meta and n not in skip and weights.get(n, (None,))[0] is None
    ]
    if missing:
        raise ValueError(
            f"expected {path.name} to hold every weight of its model, got none for"
            f" {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
        )
    return model.eval(), weights


def gguf_folder(path: Path) -> Path:
    """The cache folder of the GGUF file ``path``: its config, tokenizer and
    ``INDEX`` (made on first use)."""
    return cached(f"{file_key(path)}-gguf", INDEX, lambda scratch: _write_folder(path, scratch))


def _empty_model(config: Any) -> Any:
    """The float32 model of ``config``, its parameters on the meta device
    (its buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _write_folder(path: Path, scratch: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    _head_dim_from_file(config, reader, arch)
    names = get_gguf_hf_weights_map(_empty_model(config), _processor(arch, config))
    tensors = [
        {"name": t.name, "hf": names[t.name], "type": t.tensor_type.name,
         "dtype": str(t.data.dtype), "shape": list(t.data.shape), "offset": int(t.data_offset)}
        for t in reader.tensors if t.name in names
    ]  # fmt: skip
    config.save_pretrained(scratch)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(scratch)
    (scratch / INDEX).write_text(json.dumps({"architecture": arch, "tensors": tensors}))


def _head_dim_from_file(config: Any, reader: Any, arch: str) -> None:
    """``config.head_dim`` as the file's ``attention.key_length`` says, where
    the config has one: transformers' GGUF reader leaves it at the config's
    default (Qwen3's 128) whatever the file holds."""
    field = reader.fields.get(f"{arch}.attention.key_length")
    if field is not None and getattr(config, "head_dim", None) is not None:
        config.head_dim = int(field.parts[-1][0])


def _processor(arch: str, config: Any) -> Any:
    """transformers' tensor processor for ``arch`` (llama's q/k permutation)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())


def _embedding_weight(model: Any) -> str | None:
    """The state-dict name of ``model``'s input embedding's weight where it
    may stay quantized (a plain ``nn.Embedding``, no ``max_norm``: no scale
    or renorm of its own), else None."""
    embedding = model.get_input_embeddings()
    if type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None:
        return None
    return next(f"{n}.weight" for n, m in model.named_modules() if m is embedding)


def _tie_head(model: Any, weights: GGUFWeights, skip: frozenset[str]) -> None:
    """The head tied to the quantized input embedding, from its blocks: its
    packed form where a kernel takes the type (a meta weight until
    ``quantize_model`` swaps the layer), else its float32 dequantization;
    none where ``skip`` names it (stored packed from an earlier load)."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    name = next(f"{n}.weight" for n, m in model.named_modules() if m is head)
    if name in skip:
        return
    type_name = embedding.type_name
    packed = None
    if type_name in PACKED_TYPES:
        packed = decode_blocks(type_name, embedding.blocks.numpy())
    weights[name] = (packed, type_name)
    if packed is None:
        _assign(model, name, embedding.dequantize())


def _tensors(
    path: Path,
    folder: Path,
    model: Any,
    pack: bool,
    kept: str | None,
    skip: frozenset[str],
    defer: frozenset[str],
) -> Iterator[tuple[str, str, Packed | Deferred | QuantizedEmbedding | torch.Tensor]]:
    """Each tensor of the file the model maps: ``(state-dict name, GGUF
    type, packed weights, the embedding kept in its blocks (``kept``, of a
    type other than F32) or float32 tensor)``, one at a time (none of those
    ``skip`` names), read from the file at the offsets ``folder``'s index
    holds."""
    from gguf import GGMLQuantizationType, dequantize

    index = json.loads((folder / INDEX).read_text())
    processor = _processor(index["architecture"], model.config)
    with path.open("rb") as file:
        for entry in index["tensors"]:
            if entry["hf"] in skip:
                continue
            dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
            name, type_name = entry["hf"], entry["type"]
            if name in defer and type_name in PACKED_TYPES:
                order = torch.from_numpy(_row_order(processor, entry["name"], shape[0]))
                read = partial(_packed_at, path, entry["offset"], shape, type_name, order)
                yield (
                    name,
                    type_name,
                    Deferred(tuple(model.get_parameter(name).shape), type_name, read),
                )
                continue
            data = _read(file, entry["offset"], int(np.prod(shape)) * dtype.itemsize)
            data = data.view(dtype).reshape(shape)
            if name == kept and type_name != "F32":
                order = _row_order(processor, entry["name"], shape[0])
                blocks = torch.from_numpy(data.view(np.uint8)[order])  # its own memory
                yield name, type_name, QuantizedEmbedding(blocks, type_name)
                continue
            if pack and type_name in PACKED_TYPES:
                order = torch.from_numpy(_row_order(processor, entry["name"], shape[0]))
                yield name, type_name, decode_blocks(type_name, data).rows(order)
                continue
            floats = dequantize(data, GGMLQuantizationType[type_name])
            floats = processor.process(weights=floats, name=entry["name"]).weights
            yield name, type_name, torch.from_numpy(np.array(floats, np.float32))  # its own memory


def _packed_at(
    path: Path, offset: int, shape: tuple[int, ...], type_name: str, order: torch.Tensor
) -> Packed:
    """The blocks of a ``type_name`` tensor (uint8 ``shape``) at ``offset`` of
    the file ``path``, packed, rows in ``order``."""
    with path.open("rb") as file:
        data = _read(file, offset, int(np.prod(shape))).reshape(shape)
    return decode_blocks(type_name, data).rows(order)


def _read(file: BinaryIO, offset: int, count: int) -> np.ndarray:
    """``count`` bytes of ``file`` from ``offset``, as uint8 of their own."""
    data = np.empty(count, dtype=np.uint8)
    file.seek(offset)
    if file.readinto(memoryview(data)) != count:
        raise ValueError(f"expected {count} bytes at offset {offset} of {file.name}, got fewer")
    return data


def _row_order(processor: Any, name: str, rows: int) -> np.ndarray:
    """The file's rows of the tensor ``name`` in the Hugging Face model's
    order (int64 ``[rows]``): ``processor`` applied to the row numbers."""
    numbers = np.arange(rows, dtype=np.float32)[:, None]
    return processor.process(weights=numbers, name=name).weights[:, 0].astype(np.int64)


def _assign(model: Any, name: str, value: torch.Tensor) -> None:
    """``value`` as the parameter ``name`` of ``model`` (replacing its meta one)."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    old = getattr(owner, attr)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(
            f"expected {name} of shape {list(old.shape)} in the GGUF file, got {list(value.shape)}"
        )
    setattr(owner, attr, torch.nn.Parameter(value, requires_grad=False))
