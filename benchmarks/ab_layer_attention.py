"""The layer ops' attention of this tree against a git ref's, in one process.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_layer_attention.py REF [--rows 1 32]
        [--keys 61 401] [--rounds 30] [--engine] [--kv-cache-dtype bfloat16]

The ref's ``layer_ops.cpp`` is built beside this tree's under another op
namespace (a ref whose ops share the kernels' threads gets a team of its
own). Per layer call: SmolLM2's attention shape (9 query heads, 3 KV heads
of 64, pages of 16 slots), 30 layers' caches with each row's pages
shuffled, the two builds in alternating turns; us a layer (the median) and
the keys and values read per second. ``--engine``: SmolLM2 Q4_1 decode steps
at each ``--rows`` (in ``--dtype auto``'s arithmetic for packed weights),
the step's attention through either build on alternating steps; ms a step (the median
of 60 each). Decode rows (one query each): a ref from before the op served prefill
calls it ``decode_attention``, without the rows' query counts.
``--kv-cache-dtype bfloat16``: the caches held in bfloat16 (a ref from
before 91c62d2 reads float32 only); GB/s counts their bytes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import numpy as np
import torch

from mstar.cpu.build import build
from mstar.cpu.layer_ops import layer_ops_or_why
from mstar.cpu.quant.kernels import headers

HEADS, KV_HEADS, DIM, PAGE, LAYERS = 9, 3, 64, 16, 30


def build_ref(ref: str) -> object:
    """``ref``'s layer ops (where that version kept them, with their
    attention's header where it had one), registered as
    ``torch.ops.mstar_layer_ref``, with this tree's kernel headers beside
    them (a version that shares the kernels' threads gets a team of its
    own: the two teams' waiting threads then share the cores)."""
    for path in ("mstar/cpu/csrc/layer_ops.cpp", "mstar/integrations/layer_ops.cpp"):
        shown = subprocess.run(["git", "show", f"{ref}:{path}"], capture_output=True, text=True)
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"no layer_ops.cpp at {ref}")
    text = shown.stdout
    for macro in ("TORCH_LIBRARY(", "TORCH_LIBRARY_IMPL("):
        text = text.replace(f"{macro}mstar_layer,", f"{macro}mstar_layer_ref,")
    # its attention, where the version kept it in a header of its own
    attention = subprocess.run(
        ["git", "show", f"{ref}:{path.rsplit('/', 1)[0]}/layer_attention.h"],
        capture_output=True, text=True,
    )  # fmt: skip
    parts = headers() | (
        {"layer_attention.h": attention.stdout} if attention.returncode == 0 else {}
    )
    build("mstar_layer_ref", text, "layer_ops", headers=parts)
    return torch.ops.mstar_layer_ref


def attend(ops: object, cache: torch.Tensor, args: tuple, rest: tuple) -> torch.Tensor:
    """One layer's call of ``ops``' attention on decode rows (``rest`` as
    ``attention`` takes it after the layer; an older tree's
    ``decode_attention`` without the query counts)."""
    if hasattr(ops, "attention"):
        return ops.attention(*args, cache, *rest)
    return ops.decode_attention(*args, cache, *rest[:3], *rest[4:])


def decode_call(rows: int, keys: int) -> tuple[int, tuple, tuple]:
    """A layer call of ``rows`` decode rows of ``keys`` keys each, their
    pages shuffled: the pages a cache needs, the op's arguments before the
    layer (qkv, cos, sin) and after it."""
    per_row = -(-keys // PAGE)
    pages = rows * per_row + 8
    perm = np.random.default_rng(0).permutation(pages)
    indices = torch.from_numpy(perm[: rows * per_row].astype(np.int64))
    last = indices.view(rows, per_row)[:, (keys - 1) // PAGE] * 2 * PAGE + (keys - 1) % PAGE
    args = (
        torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM),  # qkv
        torch.randn(rows, DIM),  # cos
        torch.randn(rows, DIM),  # sin
    )
    rest = (
        last, last + PAGE,  # k_rows, v_rows
        torch.arange(rows, dtype=torch.int64),  # q_index
        torch.ones(rows, dtype=torch.int64),  # q_lens
        torch.arange(0, rows * per_row + 1, per_row, dtype=torch.int64),  # kv_indptr
        indices,
        torch.full((rows,), keys, dtype=torch.int64),  # kv_lens
        HEADS, DIM**-0.5,
    )  # fmt: skip
    return pages, args, rest


def op_turns(
    ops: dict[str, object], rows: int, keys: int, rounds: int, dtype: torch.dtype
) -> dict[str, float]:
    """Seconds a layer call of each op takes (the median of ``rounds``), over
    caches of ``dtype``."""
    pages, args, rest = decode_call(rows, keys)
    caches = [torch.randn(pages, 2, PAGE, KV_HEADS, DIM).to(dtype) for _ in range(LAYERS)]
    outs = [attend(op, caches[0], args, rest) for op in ops.values()]
    assert all(torch.allclose(outs[0], o, atol=1e-5) for o in outs[1:]), "the builds disagree"
    times: dict[str, list[float]] = {name: [] for name in ops}
    for turn in range(rounds):
        for name in list(ops)[:: 1 if turn % 2 else -1]:
            start = time.perf_counter()
            for cache in caches:
                attend(ops[name], cache, args, rest)
            times[name].append((time.perf_counter() - start) / LAYERS)
    return {name: statistics.median(t) for name, t in times.items()}


def engine_turns(ref_ops: object, rows: int) -> dict[str, float]:
    """Seconds an engine decode step takes at ``rows`` rows, the step's
    attention through this tree's build and the ref's on alternating steps."""
    from mstar.bench.roofline import _start
    from mstar.engine import Engine
    from mstar.models.dtypes import resolve_dtype
    from mstar.models.llama import attention as step_attention
    from mstar.models.loader import load

    dtype = resolve_dtype("auto", packed=True).dtype  # the default serving mode here
    model, tokenizer = load("smollm2", dtype=dtype, quantization="gguf")
    engine = Engine(model, tokenizer, num_pages=rows * 24 + 64, prefix_cache=False)
    _start(engine, rows, 200)
    use_ref = [False]
    fused = step_attention.StepAttention.fused

    def either(self, *args, **kwargs):
        if use_ref[0]:
            self._fused = lambda *a: attend(ref_ops, a[3], a[:3], a[4:])
        return fused(self, *args, **kwargs)

    step_attention.StepAttention.fused = either
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for turn in range(120):
            use_ref[0] = turn % 2 == 1
            start = time.perf_counter()
            engine.step()
            times[use_ref[0]].append(time.perf_counter() - start)
    finally:
        step_attention.StepAttention.fused = fused
    return {"this tree": statistics.median(times[False]), "ref": statistics.median(times[True])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", help="git ref")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--keys", type=int, nargs="+", default=[61, 401])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.kv_cache_dtype)
    if (why := layer_ops_or_why()) is not None:
        raise SystemExit(f"layer ops: {why}")
    ref_ops = build_ref(args.ref)
    ops = {"this tree": torch.ops.mstar_layer, args.ref: ref_ops}
    print(f"{'rows':>5} {'keys':>5}  " + "  ".join(f"{n:>22}" for n in ops) + "   ratio")
    for rows in args.rows:
        for keys in args.keys:
            t = op_turns(ops, rows, keys, args.rounds, dtype)
            gbs = rows * keys * KV_HEADS * DIM * dtype.itemsize * 2 / 1e9
            cells = "  ".join(f"{s * 1e6:9.1f} us {gbs / s:5.1f} GB/s" for s in t.values())
            print(f"{rows:>5} {keys:>5}  {cells}   {t[args.ref] / t['this tree']:.2f}x")
    if args.engine:
        for rows in args.rows:
            t = engine_turns(ref_ops, rows)
            print(
                f"engine step, {rows} rows: this tree {t['this tree'] * 1e3:.2f} ms,"
                f" {args.ref} {t['ref'] * 1e3:.2f} ms ({t['ref'] / t['this tree']:.2f}x)"
            )


if __name__ == "__main__":
    main()
