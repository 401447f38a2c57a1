"""A compiled forward: the model's forward under ``torch.compile``.

Paged attention and the cache write are one custom op per layer
(``torch.ops.mstar.paged_attention``, see ``mstar.models.hf_attention``),
opaque to the graph, which holds everything else: embeddings, norms, rotary, the
linear layers (their weights frozen into the graph on the CPU, prepacked for
oneDNN; in bfloat16 q/k/v and gate/up concatenated into one GEMM each) and
the head. Token counts are dynamic: a step of one token is
padded to two (and one kept logit row to two) so every step runs one graph,
never recompiled mid-run; the engine compiles it at start-up, on a
warm-up request (``mstar.engine.build.compiled_or_why``). Inductor's caches live under ``cache_root() / "inductor"``,
so a later process reuses the generated kernels.

On CUDA the forward compiles with ``mode="reduce-overhead"``: CUDA graphs,
captured around the attention op (tagged ``cudagraph_unsafe``, so inductor
partitions the graph there, as vLLM's piecewise graphs do), one per token
count, which is padded to a power of two (``cuda_bucket``) so a handful of
graphs serve every decode batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile_forward", "compile_refusal", "restore_eager"]

# Smallest token count (and kept-logit count) a compiled step runs: shapes of 1
# would be specialized into graphs of their own.
MIN_TOKENS = 2


def configure_caches() -> None:
    """Point inductor's on-disk caches at mstar-kv's cache folder, unless
    ``TORCHINDUCTOR_CACHE_DIR`` names another (inductor fills it in with its
    default on first use)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from mstar.cpu.cachedir import cache_root

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")


def compile_refusal(model: Any, tensor_parallel: bool) -> str | None:
    """Why ``model`` runs eager (None: it compiles)."""
    if tensor_parallel:
        return "tensor parallelism runs eager"
    if not hasattr(model, "forward"):
        return f"{type(model).__name__} has no forward"
    return None


def compile_forward(model: Any, *, freezing: bool = True) -> None:
    """Replace ``model.forward`` with a compiled one taking the same
    arguments (``input_ids [1, T]``, ``position_ids [1, T]``,
    ``logits_to_keep`` an index tensor or absent). ``freezing`` folds the
    weights into the graph as constants (oneDNN-prepacked on the CPU): the
    model's parameters must not change afterwards."""
    configure_caches()
    import torch._inductor.config as inductor_config

    inductor_config.freezing = freezing
    param = next(model.parameters())
    # q/k/v and gate/up as one GEMM each (7% of a bfloat16 decode step here); float32
    # keeps one GEMM per layer, as its exactness against HF was checked
    inductor_config.cpp.enable_concat_linear = param.dtype != torch.float32
    cuda = param.device.type == "cuda"
    eager = model.forward
    compiled = torch.compile(eager, dynamic=True, mode="reduce-overhead" if cuda else None)
    model.forward = _padded(compiled, cuda_bucket if cuda else cpu_bucket)
    model._mstar_eager_forward = eager


def restore_eager(model: Any) -> None:
    """Undo ``compile_forward``: ``model`` runs its own (eager) forward again."""
    del model.forward, model._mstar_eager_forward


def cpu_bucket(n: int) -> int:
    return max(n, MIN_TOKENS)


def cuda_bucket(n: int) -> int:
    """The next power of two (at least ``MIN_TOKENS``): one CUDA graph each."""
    return max(MIN_TOKENS, 1 << (n - 1).bit_length())


def _padded(compiled: Callable[..., Any], bucket: Callable[[int], int]) -> Callable[..., Any]:
    """``compiled`` with its token axis (and kept logits) padded to
    ``bucket(n)``, the output cut back. Padding tokens are id 0 at position
    0; the attention op computes only the step's own."""

    def forward(input_ids: torch.Tensor, **kwargs: Any) -> Any:
        # fresh tensors: a view's guards would also check its base, which a padded input lacks
        input_ids, kwargs["position_ids"] = input_ids.clone(), kwargs["position_ids"].clone()
        tokens = input_ids.shape[1]
        if bucket(tokens) != tokens:
            extra = bucket(tokens) - tokens
            input_ids = torch.nn.functional.pad(input_ids, (0, extra))
            kwargs["position_ids"] = torch.nn.functional.pad(kwargs["position_ids"], (0, extra))
        keep = kwargs.get("logits_to_keep")
        kept = None if keep is None else keep.shape[0]
        if kept is not None and bucket(kept) != kept:
            kwargs["logits_to_keep"] = torch.cat([keep, keep.new_zeros(bucket(kept) - kept)])
        output = compiled(input_ids, **kwargs)
        rows = tokens if kept is None else kept
        if output.logits.shape[1] != rows:
            output.logits = output.logits[:, :rows]
        return output

    return forward
