"""A GGUF file's quantized tensors as packed weights, bit for bit.

Q4_0 and Q4_1 blocks (a float16 scale ``d``, Q4_1 also a float16 min ``m``,
and 32 four-bit values) are int4 groups of 32 as they stand: scale ``d``,
min ``m`` (Q4_0: ``-8 d``, exact in float16); Q8_0 blocks (``d`` and 32
int8 values) are int8 groups of 32. Every other type is not packed here
(``quantize_model`` serves its float32 dequantization as bfloat16 panels
where it can); ``mstar.models.gguf`` reads the file and maps its tensors,
rows in the Hugging Face model's order, to the model.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.cpu.quant.packed import Packed

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
