"""A token embedding kept in its GGUF file's blocks, rows dequantized as looked up.

A GGUF file holds its token embedding as rows of blocks (Q4_0, Q8_0, Q4_K,
Q6_K, F16, ...): a few hundred MB where the float32 table is 0.4-2 GB.
``QuantizedEmbedding`` holds those rows as they stand (uint8 ``[vocab,
bytes a row]``) and dequantizes only the rows a step looks up, with gguf-py's
``dequantize`` (what transformers' conversion runs on the whole table), so
each row is the float32 model's row bit for bit; where the kernels are
built, their ``gguf_rows`` computes the same values in C++ for the types
people's files hold (F16, BF16, Q4_0-Q8_0, Q4_K-Q6_K): a decode step's row
in microseconds, where gguf-py's numpy takes a few hundred with cold caches.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["QuantizedEmbedding"]


class QuantizedEmbedding(torch.nn.Module):
    """An ``nn.Embedding`` (no ``max_norm``) over GGUF rows: ``blocks``
    uint8 ``[vocab, bytes a row]`` of the GGUF type ``type_name`` (any type
    gguf-py dequantizes but F32, which needs no blocks). ``forward(ids)``
    gives float32 ``[*ids.shape, embedding_dim]``, each row gguf-py's
    dequantization of that row. It has no ``weight``: ``dequantize()`` is
    the whole float32 table (a copy, for a head that needs one)."""

    def __init__(self, blocks: torch.Tensor, type_name: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        super().__init__()
        kind = GGMLQuantizationType.__members__.get(type_name)
        if kind is None or kind == GGMLQuantizationType.F32:
            raise ValueError(f"expected a GGUF type other than F32, got {type_name!r}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2:
            raise ValueError(
                f"expected blocks uint8 [vocab, bytes a row], got {blocks.dtype} {list(blocks.shape)}"
            )
        per_block, size = GGML_QUANT_SIZES[kind]
        if blocks.shape[1] % size:
            raise ValueError(
                f"expected {type_name} rows of whole {size}-byte blocks, got {blocks.shape[1]} bytes"
            )
        self.register_buffer("blocks", blocks)
        self.type_name = type_name
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = blocks.shape[1] // size * per_block
        self._native: bool | None = None  # whether the kernels' gguf_rows takes it (at first use)

    @torch.compiler.disable  # numpy inside: a compiled forward calls it as it stands
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of ``input_ids`` (any shape), each dequantized as
        the float32 table holds it; ``IndexError`` for an id out of range,
        ``TypeError`` for ids not integers (a float or bool tensor would be
        rounded or taken as a mask)."""
        if (
            input_ids.dtype.is_floating_point
            or input_ids.dtype.is_complex
            or input_ids.dtype == torch.bool
        ):
            raise TypeError(f"expected integer token ids, got {input_ids.dtype}")
        if self.native():
            ids = input_ids.to(self.blocks.device)
            return torch.ops.mstar_quant.gguf_rows(self.blocks, ids, self.type_name)
        return self._numpy_rows(input_ids)

    def _numpy_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``forward`` through gguf-py's numpy dequantization."""
        from gguf import GGMLQuantizationType, dequantize

        ids = input_ids.reshape(-1).to(self.blocks.device)
        if not ids.numel():  # (gguf-py's dequantize takes no empty rows)
            return torch.empty(*input_ids.shape, self.embedding_dim, device=self.blocks.device)
        if int(ids.min()) < 0:  # indexing would count from the end
            raise IndexError(f"expected token ids from 0, got {int(ids.min())}")
        rows = self.blocks[ids]
        floats = dequantize(rows.numpy(), GGMLQuantizationType[self.type_name])
        return torch.from_numpy(floats).view(*input_ids.shape, self.embedding_dim)

    def native(self) -> bool:
        """Whether the kernels' ``gguf_rows`` looks its rows up (built, its
        type one they take, the blocks on the CPU), decided at the first call."""
        if self._native is None:
            from mstar.cpu.quant.kernels import kernel_or_why

            self._native = (
                self.blocks.device.type == "cpu"
                and self.blocks.is_contiguous()
                and kernel_or_why() is None
                and torch.ops.mstar_quant.gguf_rows_take(self.type_name)
            )
        return self._native

    def dequantize(self) -> torch.Tensor:
        """The whole float32 table ``[vocab, embedding_dim]``, a new tensor."""
        return self(torch.arange(self.num_embeddings))

    def __getattr__(self, name: str) -> Any:
        if name == "weight":
            raise AttributeError(
                f"QuantizedEmbedding holds {self.type_name} blocks, not a float weight:"
                " call it on token ids for their rows, or dequantize() for the whole table"
            )
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name}"
