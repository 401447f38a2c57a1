"""What the command line's options build, shared by ``mstar-kv``'s
subcommands, ``serve`` and its replicas: the usage error, the model and
engine options (device, dtype, compile, tensor parallelism, speculation),
the model and the engine they describe, and the start-up lines."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any

EAGER_ENV = "MSTAR_KV_ENFORCE_EAGER"  # set: the CLI's forward runs eager unless asked (tests)


class UsageError(Exception):
    """An impossible option: reported in one line, exit code 2."""


def add_tensor_parallel_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, metavar="N",
        help="shard the model over N processes (gloo on the CPU, NCCL on N GPUs; default 1)",
    )  # fmt: skip
    add_speed_options(parser)
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
        help="the KV cache's dtype: auto (the model's activations'), or bfloat16 / float16 under"
        " float32 activations on the CPU (half the cache's memory and of the bytes attention"
        " reads: 1.06-1.31x a decode step at 1k-4k tokens of context; checked at start-up"
        " against eager float32); default auto",
    )  # fmt: skip


def add_speed_options(parser: argparse.ArgumentParser, dtype: str | None = "auto") -> None:
    """``--dtype`` and ``--enforce-eager`` (see docs/performance.md)."""
    parser.add_argument(
        "--dtype", default=dtype, help="auto (packed weights: bfloat16 arithmetic where the"
        " kernels run, i.e. int16 decode activations, bfloat16 panels with AVX512-BF16; else"
        " bfloat16 on CUDA and on CPUs with a native bfloat16 matmul, else float32),"
        " float32 (exact against HF), bfloat16 or float16"
        + (f"; default {dtype}" if dtype else "; default: bench --roofline both, --serve auto"),
    )  # fmt: skip
    parser.add_argument(
        "--quantization", default="auto", choices=("auto", "none", "gguf", "int8", "int4", "bf16"),
        help="auto (a GGUF's own 4/8-bit weights where the CPU kernels serve them; float weights"
        " in bfloat16 arithmetic as bf16 where the CPU has AVX512-BF16; else none), none (float"
        " weights), gguf, int8 (per channel) or int4 (groups of 32) quantized at load, bf16"
        " (bfloat16 panels); default auto (docs/quantization.md)",
    )  # fmt: skip
    parser.add_argument(
        "--enforce-eager", action="store_true", default=bool(os.environ.get(EAGER_ENV)),
        help=f"run the forward eager, not compiled (default when ${EAGER_ENV} is set)",
    )  # fmt: skip


def resolved_dtype(
    value: str, device: str, exact: bool = False, model: str = "", quantization: str = "none"
) -> Any:
    """``--dtype`` as a ``DtypeChoice``; ``auto`` is float32 when ``exact``
    (a check against HF that claims exactness), and where ``quantization``
    asks for packed weights for ``model`` (``loader.asks_packed``)."""
    from mstar.models.dtypes import resolve_dtype
    from mstar.models.loader import asks_packed

    packed = asks_packed(model, quantization)
    try:
        choice = resolve_dtype(
            "float32" if exact and value == "auto" else value, checked_device(device), packed
        )
    except ValueError as err:
        raise UsageError(f"--dtype {value}: {err}") from err
    if exact and value == "auto":
        choice = dataclasses.replace(choice, reason="auto: --check is exact in float32")
    return choice


def mode_line(choice: Any, engine: Any, forward: str | None = None) -> str:
    """What the start-up line says of the dtype, the forward (``forward``,
    else ``engine.compiled``), the mode check, speculation and the
    quantization (last: its summary lists layers)."""
    from mstar.engine.build import half_kv_cache

    eager = (
        "eager, fused layers (faster than compiled)" if engine.fused else "eager (--enforce-eager)"
    )
    forward = forward or engine.compiled or eager
    weights = f"{choice.describe()} weights"
    if engine.dtype != choice.dtype:  # packed weights: the dtype is their arithmetic
        activations = str(engine.dtype).removeprefix("torch.")
        weights = f"{activations} activations, {choice.describe()} arithmetic on packed weights"
    parts = [weights, f"forward {forward}"]
    if engine.mode_check is not None:
        parts.append(f"checked: {engine.mode_check.describe()}")
    if (kv := half_kv_cache(engine)) is not None:
        parts.append(kv)
    if engine.spec is not None:
        parts.append(f"speculative ngram (up to {engine.spec.k} draft tokens)")
    quantization = getattr(engine.model, "mstar_quantization", None)
    return ", ".join(parts) + (f"; quantization {quantization}" if quantization else "")


UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def memory_size(text: str) -> int:
    """``--kv-cache-memory``'s value in bytes: a number with an optional unit
    (``4GiB``, ``512MiB``, ``1.5G``, ``2000000000``; a trailing ``B`` optional)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB or 512MiB, got {text!r}")
    size = int(float(match.group(1)) * UNITS[(match.group(2) or "").lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least one byte, got {text!r}")
    return size


def add_speculative_options(parser: argparse.ArgumentParser, what: str = "") -> None:
    parser.add_argument(
        "--speculative", nargs="?", const="ngram", choices=("ngram",),
        help=what or "speculative decoding: n-gram drafts from the prompt and output",
    )  # fmt: skip
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=4, metavar="K",
        help="with --speculative: most draft tokens a step (default 4)",
    )  # fmt: skip


def speculative_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Engine`` keywords of ``--speculative``/``--num-speculative-tokens``."""
    if args.speculative is None:
        return {}
    return {"speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}


def checked_device(device: str) -> Any:
    """``--device`` as a ``torch.device`` this machine has, or a usage error."""
    from mstar.models.device import checked_device

    try:
        return checked_device(device)
    except ValueError as err:
        raise UsageError(f"--device {device}: {err}") from err


def load_model(
    name: str,
    device: str,
    tensor_parallel_size: int = 1,
    dtype: Any = None,
    quantization: str = "none",
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` on ``device`` in ``dtype`` (a torch dtype; None:
    float32) quantized as ``quantization`` says, or a usage error naming what
    is missing or cannot apply; with
    ``tensor_parallel_size > 1`` this rank's shard of a group started for it
    (``make_engine`` serves it with the same size)."""
    import torch
    from transformers.utils import logging

    from mstar.models.loader import load
    from mstar.models.tp import load_sharded

    logging.disable_progress_bar()  # the weights' loading bar: noise in a CLI
    where = checked_device(device)
    dtype = torch.float32 if dtype is None else dtype
    if tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1 and quantization not in ("auto", "none"):
        raise UsageError(f"--quantization {quantization}: tensor parallelism shards float weights")
    try:
        if tensor_parallel_size > 1:
            return load_sharded(name, tensor_parallel_size, where, dtype)
        model, tokenizer = load(name, dtype=dtype, quantization=quantization, device=where)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise UsageError(f"--model {name}: {str(err).splitlines()[0]}") from err
    return model.to(where), tokenizer


def make_engine(
    model: Any, tokenizer: Any, device: str, *, enforce_eager: bool = True, **kwargs: Any
) -> Any:
    """An ``Engine``, compiled unless ``enforce_eager`` or it runs the fused
    forward (``engine.fused``: faster eager than HF's compiled forward, see
    docs/performance.md), with a progress line on stderr; or a usage error
    for options it refuses (a pool too big for memory)."""
    from mstar.engine import Engine
    from mstar.engine.verify import ModeMismatch
    from mstar.models.device import flashinfer_or_none
    from mstar.models.hf import runs_fused

    flashinfer = flashinfer_or_none(device, model) if device.startswith("cuda") else None
    # as Engine.fused will say: the fused forward beats compiled HF, so it is not compiled
    fused = flashinfer is None and kwargs.get("tensor_parallel_size", 1) == 1 and runs_fused(model)
    compile = not enforce_eager and not fused
    if compile:
        say("compiling the forward (cached for later runs)...")
    try:
        engine = Engine(model, tokenizer, flashinfer=flashinfer, compile=compile, **kwargs)
    except ModeMismatch:
        raise  # the caller serves float32 instead (float32_unless_checked)
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from err
    return engine


def compile_now(engine: Any) -> None:
    """Compile an eager ``engine``'s forward and check it (``Engine(compile=True)``'s
    start-up, later: once its options and first request are checked)."""
    from mstar.engine.build import checked_forward

    say("compiling the forward (cached for later runs)...")
    engine.compiled, engine.mode_check = checked_forward(engine, True)


def check_model_exists(name: str) -> None:
    """A usage error saying ``--model name`` is not found, before anything loads."""
    if name not in ("smollm2", "random") and not Path(name).exists():
        raise UsageError(f"--model {name}: not found (expected smollm2, a GGUF file or a folder)")


def say(line: str) -> None:
    """A start-up line on stderr."""
    print(f"mstar-kv: {line}", file=sys.stderr, flush=True)


def model_name(args: argparse.Namespace) -> str:
    """The model's name in the API."""
    return args.served_model_name or ("random" if args.model == "random" else Path(args.model).stem)


def build_engine(
    args: argparse.Namespace, enforce_eager: bool | None = None, compiling_later: bool = False
) -> tuple[Any, str]:
    """The engine ``serve``'s options describe (eager when ``enforce_eager``,
    default ``--enforce-eager``), and its dtype and forward (``mode_line``;
    ``compiling_later``: the caller compiles it in the background unless it
    runs the fused forward, ``engine.fused``)."""
    choice = resolved_dtype(
        args.dtype, args.device, model=args.model, quantization=args.quantization
    )
    eager = args.enforce_eager if enforce_eager is None else enforce_eager

    def build(dtype: Any, quantization: str, kv_cache_dtype: str | None) -> Any:
        if args.model == "random":
            from mstar.models.seeded import build_model

            model = build_model(args.seed, str(checked_device(args.device)))[1].to(dtype)
            tokenizer = None
        else:
            model, tokenizer = load_model(
                args.model, args.device, args.tensor_parallel_size, dtype, quantization
            )
        return make_engine(
            model, tokenizer, args.device, num_pages=args.pages, page_size=args.page_size,
            kv_cache_memory=getattr(args, "kv_cache_memory", None),
            token_budget=args.budget, prefix_cache=False if args.no_prefix_cache else None,
            tensor_parallel_size=args.tensor_parallel_size, enforce_eager=eager,
            kv_cache_dtype=kv_cache_dtype or args.kv_cache_dtype, **speculative_options(args),
        )  # fmt: skip

    engine, choice = float32_unless_checked(build, choice, args.quantization, args.model)
    cap_context(engine, getattr(args, "max_model_len", None))
    later = compiling_later and not engine.fused
    return engine, mode_line(
        choice, engine, "eager, compiling in the background" if later else None
    )


def cap_context(engine: Any, max_model_len: int | None) -> None:
    """``--max-model-len``: the most tokens (prompt and generated) a request
    may span, at most the model's own (``UsageError`` past it); None: the model's."""
    if max_model_len is None:
        return
    if max_model_len < 2:
        raise UsageError(f"--max-model-len must be >= 2, got {max_model_len}")
    own = engine.max_len
    if own is not None and max_model_len > own:
        raise UsageError(
            f"--max-model-len {max_model_len} is over the model's context of {own} tokens"
        )
    engine.limit_context(max_model_len)


def float32_unless_checked(
    build: Any, choice: Any, quantization: str, model: str
) -> tuple[Any, Any]:
    """``(build(choice.dtype, quantization, None), choice)``, or, when that mode
    disagrees with eager float32 (``ModeMismatch``), float32 as
    ``mstar.engine.build.float32_unless_checked`` picks it and a choice whose
    reason says why (``model``: its name, to tell packed weights)."""
    import torch

    from mstar.engine import build as engine_build
    from mstar.models.dtypes import DtypeChoice
    from mstar.models.loader import asks_packed

    packed = asks_packed(model, quantization)
    engine, refused = engine_build.float32_unless_checked(build, choice.dtype, quantization, packed)
    if refused is None:
        return engine, choice
    err, instead = refused
    say(f"{err}: serving {instead} instead")
    return engine, DtypeChoice(torch.float32, f"{choice.name} refused: {err}")
