"""The weights' dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``.

``auto`` takes bfloat16 where the hardware multiplies it natively (CUDA, and
CPUs with AVX512-BF16 or AMX, where a bfloat16 matmul runs ~4x a float32
one and a decode step streams half the bytes), float32 elsewhere (a CPU
without them emulates bfloat16 and runs slower than float32). Packed
weights (a GGUF file's own, or int8/int4 at load) on the CPU keep the model
in float32 (their kernels take float32 activations) and ``auto`` names their
arithmetic: bfloat16 wherever the kernels run (``mstar.cpu.quant``): with
AVX512-BF16 their many-row products, prefill and batched decode, multiply in
it; on any CPU they take decode rows' activations rounded to int16 (int4
1-8 rows with AVX512-VNNI, 1-4 on AVX2; int8 one: on Zen 1 1.0-1.6x the
float32 kernels, ~1e-4 of their result). On Zen 5 SmolLM2's own Q4_1 step ran 3x a bfloat16
model's at batch 1 (docs/performance.md). ``float32`` keeps them exact.

Float32 is the dtype the engine is exact in: token for token against the
model's own Hugging Face ``generate`` in float32. In bfloat16 the engine runs
the same model in bfloat16 (paged attention keeps its softmax and
accumulation in float32); it agrees with Hugging Face in bfloat16 to
rounding, not bit for bit (see docs/performance.md for the measured
agreement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DTYPE_CHOICES", "DtypeChoice", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved dtype and why it was chosen (for the start-up line)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def resolve_dtype(
    value: str | torch.dtype, device: torch.device | str = "cpu", packed: bool = False
) -> DtypeChoice:
    """``value`` (one of ``DTYPE_CHOICES`` or a floating ``torch.dtype``) as
    the dtype to load weights in on ``device``; ``ValueError`` naming it
    otherwise. ``packed``: packed weights are asked for (``loader.asks_packed``):
    ``auto`` is their arithmetic (see the module)."""
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(f"expected dtype a floating torch.dtype, got {value!r}")
        return DtypeChoice(value, "as asked")
    if not isinstance(value, str) or value not in DTYPE_CHOICES:
        raise ValueError(
            f"expected dtype one of {', '.join(DTYPE_CHOICES)} or a floating torch.dtype,"
            f" got {value!r}"
        )
    if value != "auto":
        return DtypeChoice(DTYPES[value], "as asked")
    if torch.device(device).type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto: CUDA")
    if packed and _packed_kernels_run():
        if _bf16_packed_runs():
            return DtypeChoice(
                torch.bfloat16,
                "auto: the CPU has AVX512-BF16: packed weights multiply many rows in it",
            )
        return DtypeChoice(
            torch.bfloat16,
            "auto: packed weights take decode rows' activations rounded to int16"
            " (no AVX512-BF16 here: more rows float32)",
        )
    native = native_cpu_bf16()
    if native:
        return DtypeChoice(torch.bfloat16, f"auto: the CPU has {native}")
    return DtypeChoice(torch.float32, "auto: the CPU has no native bfloat16 matmul")


def _packed_kernels_run() -> bool:
    from mstar.cpu.quant.kernels import kernel_or_why

    return kernel_or_why() is None


def _bf16_packed_runs() -> bool:
    from mstar.cpu.quant.kernels import bf16_or_why

    return bf16_or_why() is None


def native_cpu_bf16() -> str | None:
    """The CPU's native bfloat16 matmul instructions (``AMX`` or
    ``AVX512-BF16``), None when it has neither."""
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return None
