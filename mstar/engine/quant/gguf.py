"""A GGUF file's quantized tensors as packed weights, bit for bit.

Q4_0 and Q4_1 blocks (a float16 scale ``d``, Q4_1 also a float16 min ``m``,
and 32 four-bit values) are int4 groups of 32 as they stand: scale ``d``,
min ``m`` (Q4_0: ``-8 d``, exact in float16); Q8_0 blocks (``d`` and 32
int8 values) are int8 groups of 32. Every other type is not packed (the
model keeps its float32 dequantization). Rows come in the Hugging Face
model's order: the row permutation transformers' own tensor processor applies
on conversion (llama's q/k) is applied to the packed rows too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.engine.quant.packed import Packed

# bytes of one block of 32 weights
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def decode_blocks(type_name: str, data: np.ndarray) -> Packed:
    """The rows of raw blocks ``data`` (uint8 ``[N, blocks * bytes]``) of a
    Q4_0/Q4_1/Q8_0 tensor, packed."""
    rows = data.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(data)).view(rows, -1, BLOCK_BYTES[type_name])
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


def packed_weights(path: Path, model: Any) -> dict[str, Packed | str]:
    """For each weight of ``model`` (its state-dict name) the GGUF file at
    ``path`` holds: its ``Packed`` form, or its GGUF type name when no kernel
    takes that type."""
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
    out: dict[str, Packed | str] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if tensor.name not in names:
            continue
        if type_name not in BLOCK_BYTES:
            out[names[tensor.name]] = type_name
            continue
        packed = decode_blocks(type_name, tensor.data)
        rows = np.arange(packed.shape[0], dtype=np.float32)[:, None]
        order = processor.process(weights=rows, name=tensor.name).weights[:, 0]
        out[names[tensor.name]] = packed.rows(torch.from_numpy(order.astype(np.int64)))
    return out
