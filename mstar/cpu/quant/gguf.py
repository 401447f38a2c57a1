"""A GGUF file's quantized tensors as packed weights, bit for bit.

Q4_0 and Q4_1 blocks (a float16 scale ``d``, Q4_1 also a float16 min ``m``,
and 32 four-bit values) are int4 groups of 32 as they stand: scale ``d``,
min ``m`` (Q4_0: ``-8 d``, exact in float16); Q8_0 blocks (``d`` and 32
int8 values) are int8 groups of 32. Every other type is not packed here
(``quantize_model`` serves its float32 dequantization as bfloat16 panels
where it can). Rows come in the Hugging Face
model's order: the row permutation transformers' own tensor processor applies
on conversion (llama's q/k) is applied to the packed rows too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from mstar.cpu.quant.packed import Packed

# beside the converted folder's model.safetensors, under a suffix no HF-format loader globs
# (vLLM loads every *.safetensors of a folder: the packed tensors' names broke it)
PACKED_FILE = "gguf-packed.mstar"
# bytes of one block of 32 weights
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def decode_blocks(type_name: str, data: np.ndarray) -> Packed:
    """The rows of raw blocks ``data`` (uint8 ``[N, blocks * bytes]``) of a
    Q4_0/Q4_1/Q8_0 tensor, packed."""
    rows = data.shape[0]
    blocks = torch.from_numpy(np.array(data, copy=True)).view(rows, -1, BLOCK_BYTES[type_name])
    scales = blocks[:, :, 0:2].contiguous().view(torch.float16).view(rows, -1)
    if type_name == "Q8_0":
        qweight = blocks[:, :, 2:].contiguous().view(torch.int8).view(rows, -1)
        return Packed("int8", qweight, scales.contiguous())
    if type_name == "Q4_1":
        mins = blocks[:, :, 2:4].contiguous().view(torch.float16).view(rows, -1)
        qs = blocks[:, :, 4:]
    else:
        mins = scales * -8
        qs = blocks[:, :, 2:]
    return Packed("int4", qs.reshape(rows, -1).contiguous(), scales.contiguous(), mins.contiguous())


def cached_packed_weights(
    path: Path, model: Any, cache: Path | None
) -> dict[str, tuple[Packed | None, str]]:
    """``packed_weights``, saved once as ``cache / PACKED_FILE`` (reading the
    file's metadata and mapping its names takes tens of seconds) and read
    back from there afterwards."""
    from safetensors.torch import load_file, save_file

    saved = None if cache is None else cache / PACKED_FILE
    if cache is not None:  # the name before: other loaders of the folder read it
        (cache / "gguf-packed.safetensors").unlink(missing_ok=True)
    if saved is not None and saved.exists():
        with safe_open(saved, framework="pt") as f:
            types = json.loads(f.metadata()["types"])
        tensors = load_file(saved)
        return {name: (_unflatten(tensors, name), t) for name, t in types.items()}
    weights = packed_weights(path, model)
    if saved is not None:
        flat = {
            f"{n}.{k}": v for n, (w, _) in weights.items() if w is not None for k, v in _flatten(w)
        }
        types = json.dumps({name: t for name, (_, t) in weights.items()})
        scratch = saved.with_suffix(f".partial-{os.getpid()}")
        save_file(flat, scratch, metadata={"types": types})
        scratch.replace(saved)
    return weights


def _flatten(w: Packed) -> list[tuple[str, torch.Tensor]]:
    parts = [("qweight", w.qweight), ("scales", w.scales)]
    return parts if w.mins is None else [*parts, ("mins", w.mins)]


def _unflatten(tensors: dict[str, torch.Tensor], name: str) -> Packed | None:
    qweight = tensors.get(f"{name}.qweight")
    if qweight is None:
        return None
    kind = "int4" if qweight.dtype == torch.uint8 else "int8"
    return Packed(kind, qweight, tensors[f"{name}.scales"], tensors.get(f"{name}.mins"))


def packed_weights(path: Path, model: Any) -> dict[str, tuple[Packed | None, str]]:
    """For each weight of ``model`` (its state-dict name) the GGUF file at
    ``path`` holds: its ``Packed`` form (None when no kernel takes its type)
    and its GGUF type name."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    out: dict[str, tuple[Packed | None, str]] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if tensor.name not in names:
            continue
        if type_name not in BLOCK_BYTES:
            out[names[tensor.name]] = (None, type_name)
            continue
        packed = decode_blocks(type_name, tensor.data)
        rows = np.arange(packed.shape[0], dtype=np.float32)[:, None]
        order = processor.process(weights=rows, name=tensor.name).weights[:, 0]
        out[names[tensor.name]] = (packed.rows(torch.from_numpy(order.astype(np.int64))), type_name)
    return out
