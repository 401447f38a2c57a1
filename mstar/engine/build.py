"""Building an engine: its arguments checked, a named model loaded
(``Engine.from_pretrained``), its KV pages and cache, its EOS ids."""

from __future__ import annotations

import copy
import functools
import os
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mstar.cpu.quant import without_int8_rows
from mstar.cpu.quant.arena import trim_heap
from mstar.engine.resources.groups import KVGroups, group_size
from mstar.engine.resources.kv.cache import KVCache, cache_serves
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.kv.ring import PinnedIndexRing
from mstar.engine.sampling.params import SamplingParams
from mstar.engine.verify import (
    ModeCheck,
    ModeMismatch,
    Reference,
    Tolerance,
    check_mode,
    check_params,
    check_prompts,
    float32_reference,
    is_packed,
    record_check,
    record_key,
    recorded_check,
)
from mstar.models.compiled import compile_forward, compile_refusal, restore_eager
from mstar.models.device import checked_device, flashinfer_or_none
from mstar.models.dtypes import resolve_dtype
from mstar.models.llama.step import FUSED_ATTRIBUTE
from mstar.models.loader import asks_packed
from mstar.models.tp import TensorParallel, check_size, load_sharded, shard

Built = TypeVar("Built")
WARM_UP_ID = "mstar-compile-warm-up"  # the request compiled_or_why compiles the forward on


def check_options(
    tokenizer: Any,
    num_pages: object,
    page_size: object,
    token_budget: object,
    prefix_cache: object,
    compile: object,
    kv_cache_memory: object = None,
) -> None:
    """``TypeError``/``ValueError`` naming the first bad one of ``Engine``'s
    arguments checked before anything is built."""
    options = {
        "page_size": page_size,
        "token_budget": token_budget,
        "num_pages": num_pages,
        "kv_cache_memory": kv_cache_memory,
    }
    for name, value in options.items():
        if value is None and name in ("num_pages", "kv_cache_memory"):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected {name} an int, got {value!r}")
        if value < 1:
            raise ValueError(f"expected {name} >= 1, got {value!r}")
    if num_pages is not None and kv_cache_memory is not None:
        raise ValueError(
            f"expected num_pages or kv_cache_memory, not both, got {num_pages} and {kv_cache_memory}"
        )
    if not isinstance(compile, bool):
        raise TypeError(f"expected compile a bool, got {compile!r}")
    if prefix_cache is not None and not isinstance(prefix_cache, bool):
        raise TypeError(f"expected prefix_cache a bool or None, got {prefix_cache!r}")
    if tokenizer is not None and not hasattr(tokenizer, "backend_tokenizer"):
        raise TypeError(
            "expected tokenizer a Hugging Face fast tokenizer (with .backend_tokenizer)"
            f" or None, got {type(tokenizer).__name__}"
        )


def kv_cache_dtype_of(
    value: object, param: torch.Tensor, tp: TensorParallel | None, flashinfer: Any
) -> torch.dtype:
    """``Engine``'s ``kv_cache_dtype`` resolved: ``"auto"`` (the model's
    dtype), or a dtype (a torch dtype or its name) that is the model's or,
    under float32 activations on the CPU, bfloat16 or float16 (keys and
    values rounded into the cache, read back as float32: half the bytes a
    key); anything else a ``ValueError`` (``TypeError`` for no dtype)."""
    if value == "auto":
        return param.dtype
    if isinstance(value, str):
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"expected kv_cache_dtype 'auto' or a dtype's name, got {value!r}")
    elif isinstance(value, torch.dtype):
        dtype = value
    else:
        raise TypeError(f"expected kv_cache_dtype 'auto' or a dtype, got {value!r}")
    if dtype == param.dtype:
        return dtype
    name = str(dtype).removeprefix("torch.")
    if not cache_serves(dtype, param.dtype):
        raise ValueError(
            f"expected kv_cache_dtype 'auto', the model's {param.dtype} or, under float32, bfloat16"
            f" or float16, got {name}"
        )
    where = {
        "on CUDA": param.device.type == "cuda",
        "with FlashInfer": flashinfer is not None,
        "under tensor parallelism": tp is not None,
    }
    for what, refused in where.items():
        if refused:
            raise ValueError(f"expected kv_cache_dtype 'auto' {what}, got {name}")
    return dtype


def half_kv_cache(engine: Any) -> str | None:
    """``"bfloat16 KV cache"`` (or float16) when ``engine``'s cache holds
    another dtype than its activations (``kv_cache_dtype``), else None."""
    if engine.cache.dtype == engine.dtype:
        return None
    return f"{str(engine.cache.dtype).removeprefix('torch.')} KV cache"


def stops_workers_on_error(init: Callable[..., None]) -> Callable[..., None]:
    """A constructor that, when it raises, first stops the tensor-parallel
    workers it started (``self.tp``)."""

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            if getattr(self, "tp", None) is not None:
                self.tp.close()
            raise

    return checked


def from_pretrained(
    make: Callable[..., Built],
    name: object,
    device: str | torch.device,
    dtype: str | torch.dtype,
    kwargs: dict[str, Any],
    quantization: str = "none",
) -> Built:
    """``make(model, tokenizer, **kwargs)`` on the model ``name`` names,
    loaded in ``dtype`` on ``device``, quantized as ``quantization`` says
    (``mstar.cpu.quant``; refused up front where it cannot apply) (each rank's shard only with
    ``tensor_parallel_size > 1``; FlashInfer attached on CUDA unless
    ``kwargs`` say). Workers started for it stop when ``make`` raises. A
    half-precision or quantized mode that disagrees with eager float32
    (``ModeMismatch``) is served in float32 instead (``float32_unless_checked``),
    with a warning saying why."""
    if not isinstance(name, str | os.PathLike):
        raise TypeError(f"expected name a str or a path, got {name!r}")
    device = checked_device(device)
    packed = asks_packed(os.fspath(name), quantization)
    dtype = resolve_dtype(dtype, device, packed).dtype

    def load(d: torch.dtype, q: str, kv: str | None) -> Built:
        asked = dict(kwargs) if kv is None else {**kwargs, "kv_cache_dtype": kv}
        return _loaded(make, os.fspath(name), device, d, asked, q)

    built, refused = float32_unless_checked(load, dtype, quantization, packed)
    if refused is not None:
        warnings.warn(f"{refused[0]}; serving {refused[1]} instead", stacklevel=3)
    return built


T = TypeVar("T")


def float32_unless_checked(
    load: Callable[[torch.dtype, str, str | None], T],
    dtype: torch.dtype,
    quantization: str,
    packed: bool,
) -> tuple[T, tuple[ModeMismatch, str] | None]:
    """``(load(dtype, quantization, None), None)``, or, when that mode
    disagrees with eager float32 (``ModeMismatch``), float32 instead and
    ``(the mismatch, what is served)``: the same packed weights in float32
    arithmetic where a half-precision dtype multiplied them (``packed``;
    checked at the exact bound), else float32 float weights over a float32
    KV cache. ``load``'s third argument: the KV cache's dtype, None as
    asked (``"auto"``: the weights', for that last, exact mode)."""
    try:
        return load(dtype, quantization, None), None
    except ModeMismatch as err:
        if packed and dtype != torch.float32:
            try:
                return load(torch.float32, quantization, None), (
                    err,
                    "float32 arithmetic on the packed weights",
                )
            except ModeMismatch:
                pass
        return load(torch.float32, "none", "auto"), (err, "float32 weights")


def _loaded(
    make: Callable[..., Built], name: str, device: torch.device, dtype: torch.dtype,
    kwargs: dict[str, Any], quantization: str,
) -> Built:  # fmt: skip
    from mstar.models.loader import load

    size = check_size(kwargs.get("tensor_parallel_size", 1))
    if size > 1:
        from mstar.cpu.quant import resolve_quantization

        resolve_quantization(quantization, gguf=False, device=device, tensor_parallel_size=size)
        model, tokenizer = load_sharded(name, size, device, dtype)
    else:
        model, tokenizer = load(name, dtype=dtype, quantization=quantization, device=device)
        model = model.to(device)
    try:
        if device.type == "cuda" and "flashinfer" not in kwargs:
            kwargs["flashinfer"] = flashinfer_or_none(str(device), model)
        return make(model, tokenizer, **kwargs)
    except BaseException:
        if size > 1:
            shard(model, size).close()  # the group load_sharded started
        raise


def kv_managers(
    spec: Any,
    num_pages: int,
    page_size: int,
    param: torch.Tensor,
    prefix_cache: bool,
    tp: TensorParallel | None,
    flashinfer: Any,
    dtype: torch.dtype,
) -> tuple[KVManager | KVGroups, KVCache]:
    """The engine's pages and cache. A windowed model's streams release the
    pages behind its windows, unless the prefix cache keeps them (the two do
    not combine yet); a hybrid one's (windowed and full layers) then has a
    manager per KV group of ``k`` layers, on one pool of the memory of
    ``num_pages`` pages over every layer (not under tensor parallelism: its
    workers hold one cache over every layer). The cache holds ``dtype``
    (``kv_cache_dtype``). On CUDA the plan's index arrays leave from pinned
    memory, so their copies are asynchronous."""
    cuda = param.device.type == "cuda"
    if not prefix_cache and len(spec.groups) > 1 and tp is None:
        groups = KVGroups(
            spec.groups,
            num_pages * spec.num_layers // group_size(spec.groups),
            page_size,
            cache=spec.cache_kwargs(),
            dtype=dtype,
            device=param.device,
            rings=cuda,
        )
        return groups, groups.cache
    cache = KVCache(
        num_pages=num_pages,
        page_size=page_size,
        dtype=dtype,
        device=param.device,
        **spec.cache_kwargs(),
    )
    mgr = KVManager(
        num_pages,
        page_size,
        cache=cache if tp is None else tp.attach(cache, flashinfer),
        prefix_cache=prefix_cache,
        ring=PinnedIndexRing() if cuda else None,
        window=None if prefix_cache else spec.window,
    )
    return mgr, cache


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the model's generation config, else its config, else the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


def checked_forward(engine: Any, compile: bool) -> tuple[str | None, ModeCheck | None]:
    """Compile ``engine``'s forward when asked, then check its mode against
    eager float32 (``mstar.engine.verify``): ``(compiled, check)``, as
    ``Engine.compiled`` and ``Engine.mode_check`` hold them. A compiled
    forward that disagrees falls back to eager (``compiled`` says why); an
    eager one with int8 rows (``PackedLinear.int8_rows``) that disagrees is
    checked again with them outside the attention (``without_int8_rows(model,
    "self_attn")``: the MLP and the head; a random Qwen3-shaped file passes
    so, its ``v_proj`` too sensitive to the rounding), then without them
    (bfloat16 panels from the lanes), with a warning; one that still
    disagrees raises ``ModeMismatch`` (the caller serves float32 instead).
    Eager float32 weights over a float32 KV cache are the reference itself,
    and tensor parallel shards are not checked: ``check`` None. A
    half-precision KV cache is part of the mode (not exact). A check run before (passed or
    failed) on the same model files, code, CPU and settings is read from its
    record (``verify.record_key``: a 1B model's second load spared ~50 s).
    What the check freed goes back to the OS (``trim_heap``: 3.2 GB on a
    3B-shaped model)."""
    try:
        return _checked_forward(engine, compile)
    finally:
        trim_heap()


def _checked_forward(engine: Any, compile: bool) -> tuple[str | None, ModeCheck | None]:
    weights = weights_mode(engine.model)
    exact = float32_arithmetic(engine.model)
    if (kv := half_kv_cache(engine)) is not None:
        weights, exact = ", ".join(filter(None, (weights, kv))), False
    if engine.tp is not None or (weights is None and not compile):
        return (compiled_or_why(engine) if compile else None), None
    reference: list[Reference] = []  # made once, where no record spares the check

    def check(forward: str) -> ModeCheck:
        prompts = check_prompts(engine, check_params())  # cut to what the pool holds
        settings = f"{weights}|{forward}|exact={exact}|{engine.mgr.page_size}|{prompts}"
        key = record_key(engine.model, settings)
        if (found := recorded_check(key)) is not None:
            return found
        reference[:] = reference or [float32_reference(engine.model)]
        result = check_mode(engine, reference[0], Tolerance.of(exact=exact))
        record_check(key, result)
        return result

    compiled = compiled_or_why(engine) if compile else None
    if compiled is not None and compiled.startswith("compiled"):
        found = check(compiled)
        if found.ok:
            return compiled, found
        restore_eager(engine.model)
        what = f"compiled {weights or 'float32'}"
        compiled = f"eager: {what} disagrees with eager float32 ({found.failure})"
    if weights is None:
        return compiled, None
    found = check("eager")
    refused = f"{weights} disagrees with eager float32: {found.failure}"
    for under in ("self_attn", None):  # the next modes: int8 rows outside the attention, then none
        if found.ok or not without_int8_rows(engine.model, under):
            continue
        vars(engine.model).pop(FUSED_ATTRIBUTE, None)  # its joined layers rebuilt without them
        weights = weights_mode(engine.model)
        found = check(f"eager|int8 rows but {under}")
        if found.ok:
            warnings.warn(f"{refused}; serving {weights} instead", stacklevel=5)
    if not found.ok:
        raise ModeMismatch(f"{weights} disagrees with eager float32: {found.failure}")
    return compiled, found


def weights_mode(model: Any) -> str | None:
    """What ``model``'s weights are when not plain float32 (their dtype,
    packed layers' kinds, or the quantization its config names), None when
    they are."""
    quantized = getattr(model.config, "quantization_config", None)
    if quantized is not None:
        method = getattr(quantized, "quant_method", None) or (
            quantized.get("quant_method") if isinstance(quantized, dict) else None
        )
        return f"quantized ({method or 'unknown'})"
    dtypes = {p.dtype for p in model.parameters()} - {torch.float32}
    kinds = {_packed_kind(m) for m in model.modules() if is_packed(m)}
    names = sorted(str(d).removeprefix("torch.") for d in dtypes) + sorted(kinds)
    return ", ".join(names) or None


def _packed_kind(module: Any) -> str:
    arithmetic = getattr(module, "arithmetic", "float32")
    kind = f"packed {getattr(module, 'kind', '')}".strip()
    return kind if arithmetic == "float32" else f"{kind} ({arithmetic} arithmetic)"


def float32_arithmetic(model: Any) -> bool:
    """Whether ``model`` computes in float32 throughout (float32 weights, or
    packed ones on float32 activations, whose reference is their own
    dequantized weights): held to the exact tolerance, as a reordered sum."""
    quantized = getattr(model.config, "quantization_config", None) is not None
    packed_float32 = all(
        getattr(m, "arithmetic", "float32") == "float32" for m in model.modules() if is_packed(m)
    )
    return (
        not quantized
        and packed_float32
        and all(p.dtype == torch.float32 for p in model.parameters())
    )


def compiled_or_why(engine: Any) -> str:
    """Compile ``engine``'s forward and run a warm-up request through it
    (the compile happens there), leaving the engine's counters as they were.
    Returns ``"compiled (N s)"``, or ``"eager: why"`` when the model cannot be
    compiled (its eager forward restored, nothing else changed)."""
    model = engine.model
    reason = compile_refusal(model, engine.tp is not None)
    if reason is not None:
        return f"eager: {reason}"
    start = time.perf_counter()
    stats = copy.deepcopy(engine.stats)
    compile_forward(model, freezing=True)
    try:
        # three prompt tokens: the step's token and logit counts differ at the first trace
        engine.add_request([0, 1, 2], SamplingParams(max_new_tokens=2, ignore_eos=True),
                           request_id=WARM_UP_ID)  # fmt: skip
        while engine.has_unfinished():
            engine.step()
    except Exception as failed:  # any failure to compile: serve eager, never wrong
        restore_eager(model)
        err = failed.__cause__ or failed  # the engine's StepFailed names the step's error
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return f"eager: the forward does not compile ({type(err).__name__}: {first})"
    finally:
        engine.stats = stats
    return f"compiled ({time.perf_counter() - start:.0f} s)"
