"""The packed linear kernels against a baseline build of them and float32 F.linear.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/quant_kernels.py [--baseline main]
        [--rows 1 4 32 256] [--shapes q k gate down head] [--rounds 5] [--threads N]
        [--stream]

The baseline is ``kernels.cpp`` as git ref ``--baseline`` has it (``none``:
no baseline), built in this process under its own op namespace
(``mstar_quant_base``) and build folder, so both run in one process, taking
turns: per shape and rows, each variant is timed over ``--rounds`` rounds
(each about 20 ms of calls), the variants alternating, and the best round
is printed: microseconds per call (wall, and the process's CPU time of all
its threads: on a shared machine the wall time mostly measures the others)
and GB/s (wall) of the weight bytes it reads
(int4: 0.625 bytes a weight with its scale and min; int8 in groups of 32:
1.0625; bfloat16 panels: 2; float32: 4). Where the CPU has AVX512-BF16,
this tree's bfloat16 panels of the int4 weights (``bf16 panels``, what 9+
rows multiply in ``--dtype bfloat16``/auto) run beside them; and on any CPU,
at the rows ``int16_rows`` says (int4: 1-8 with AVX512-VNNI, 1-4 on AVX2;
int8: 1), int4 and int8 on activations rounded to int16 (``int16 act.``,
what bfloat16 arithmetic takes there), and with AVX512-VNNI the same
weights as this tree's lanes (``int4 lanes``, ``int8 lanes``: what the
engine runs there). Random weights,
SmolLM2-135M's shapes (``head``: the tied vocabulary head, which the engine
runs as int8), and a Llama-3.2-1B's gate and down (``1b-gate``, ``1b-down``).
From ``int8_lane_rows()`` rows, the int4 lanes on activations rounded to
int8 (``int4 int8 rows``) and bfloat16 panels dequantized from them
(``int4 bf16 lanes``). ``--stream``: each variant cycles through distinct copies of
its weights, ``STREAM_BYTES`` of them in all (more than the L3 cache holds), so
every call reads its weights from memory, as a model's step does; without it
they stay in cache. Prints the CPU and the load before and after.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mstar.cpu.info import cpu_info
from mstar.cpu.quant.kernels import bf16_or_why, build_under, kernel_or_why
from mstar.cpu.quant.packed import LANES, PANEL, Packed, bf16_panels

SHAPES = {
    "q": (576, 576),
    "k": (192, 576),
    "gate": (1536, 576),
    "down": (576, 1536),
    "head": (49152, 576),
    "1b-gate": (8192, 2048),  # Llama-3.2-1B's gate (and up)
    "1b-down": (2048, 8192),
}
BYTES_PER_WEIGHT = {"int4": 0.625, "int8": 1.0625, "bf16": 2.0, "f32": 4.0}
STREAM_BYTES = 128 << 20  # the weights a --stream variant cycles through


def baseline_ops(ref: str) -> object | None:
    """``kernels.cpp`` and the headers it includes at git ref ``ref`` (none
    before they were split out), built under the namespace
    ``mstar_quant_base``: its ops (``torch.ops.mstar_quant_base``)."""
    if ref == "none":
        return None
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=root)
        return run.stdout

    # the sources' folder at ``ref``: csrc/ since the house moved, before that quant/ and quant/cpp/
    layouts = (("mstar/cpu/csrc/kernels.cpp", "mstar/cpu/csrc"),
               ("mstar/engine/quant/kernels.cpp", "mstar/engine/quant/cpp"))  # fmt: skip
    files = set(git("ls-tree", "-r", "--name-only", ref, "mstar/").split())
    relative, folder = next(layout for layout in layouts if layout[0] in files)
    listed = git("ls-tree", "--name-only", ref, f"{folder}/").split()  # nothing before the split
    parts = {Path(n).name: git("show", f"{ref}:{n}") for n in listed if n.endswith(".h")}
    return build_under("mstar_quant_base", git("show", f"{ref}:{relative}"), parts=parts)


def best_us(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, tuple[float, float]]:
    """Each call's best mean wall and process-CPU time per call (us) over ``rounds``
    rounds, in turns."""
    counts = {}
    for name, call in calls.items():
        call()
        start = time.perf_counter()
        call()
        counts[name] = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    wall = dict.fromkeys(calls, float("inf"))
    cpu = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(counts[name]):
                call()
            wall[name] = min(wall[name], (time.perf_counter() - start) / counts[name] * 1e6)
            cpu[name] = min(cpu[name], (time.process_time() - start_cpu) / counts[name] * 1e6)
    return {name: (wall[name], cpu[name]) for name in calls}


def variants(
    ops: dict[str, object], n: int, k: int, rows: int, stream: bool
) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)

    def copies(fmt: str) -> int:
        return -(-STREAM_BYTES // int(n * k * BYTES_PER_WEIGHT[fmt])) if stream else 1

    def cycled(args: list[tuple], call: Callable[..., object]) -> Callable[[], object]:
        turns = itertools.cycle(args)
        return lambda: call(*next(turns))

    int4 = [
        (
            torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
            (torch.rand(n, k // 32, generator=g) / 10).half(),
            (-torch.rand(n, k // 32, generator=g) / 2).half(),
        )
        for _ in range(copies("int4"))
    ]
    int8 = [
        (torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), scales)
        for _, scales, _ in itertools.islice(itertools.cycle(int4), copies("int8"))
    ]
    x = torch.randn(rows, k, generator=g)
    calls: dict[str, Callable[[], object]] = {}
    for label, op in ops.items():
        calls[f"int4 {label}"] = cycled(int4, lambda *w, op=op: op.int4_linear(x, *w))
        calls[f"int8 {label}"] = cycled(int8, lambda *w, op=op: op.int8_linear(x, *w))
    for label, op in ops.items():  # int16 activations, where the build has them
        if not hasattr(op, "int16_rows"):
            continue
        suffix = "" if label == "this tree" else f" {label}"
        if rows <= op.int16_rows(4):
            calls[f"int4 int16 act.{suffix}"] = cycled(
                int4, lambda *w, op=op: op.int4_linear_i16(x, *w)
            )
        if rows <= op.int16_rows(8):
            calls[f"int8 int16 act.{suffix}"] = cycled(
                int8, lambda *w, op=op: op.int8_linear_i16(x, *w)
            )
    ours = torch.ops.mstar_quant
    if ours.lanes_rows() and n % LANES == 0:  # this tree's lanes, at the rows they take
        lanes4 = [(Packed("int4", *w).lanes(),) for w in int4]
        if rows <= ours.lanes_rows():
            calls["int4 lanes"] = cycled(lanes4, lambda w: ours.lanes_i16(x, w))
            lanes8 = [(Packed("int8", *w).lanes(),) for w in int8]
            calls["int8 lanes"] = cycled(lanes8, lambda w: ours.lanes_i16(x, w))
        if rows >= ours.int8_lane_rows():  # what lanes held without panels take from 2 rows
            calls["int4 int8 rows"] = cycled(lanes4, lambda w: ours.lanes_i8(x, w))
        if bf16_or_why() is None and n % PANEL == 0:  # and what they took before
            calls["int4 bf16 lanes"] = cycled(lanes4, lambda w: ours.lanes_bf16(x, w))
    if bf16_or_why() is None and n % PANEL == 0:  # this tree's bfloat16 panels
        panels = [(bf16_panels(Packed("int4", *w)),) for w in int4[: copies("bf16")]]
        calls["bf16 panels"] = cycled(panels, lambda p: torch.ops.mstar_quant.bf16_linear(x, p))
    weights = [(torch.randn(n, k, generator=g),) for _ in range(copies("f32"))]
    calls["f32 F.linear"] = cycled(weights, lambda w: F.linear(x, w))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="git ref, or none")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its own)")
    parser.add_argument("--stream", action="store_true", help="weights from memory, not cache")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    why = kernel_or_why()
    if why is not None:
        raise SystemExit(f"the kernels do not run here: {why}")
    ops = {"this tree": torch.ops.mstar_quant}
    base = baseline_ops(args.baseline)
    if base is not None:
        ops[args.baseline] = base
    print(f"CPU: {cpu_info().describe()}; load {os.getloadavg()[0]:.2f}")
    print(f"{'shape':>14} {'rows':>4}  {'variant':<16} {'wall us':>9} {'GB/s':>6} {'cpu us':>9}")
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for rows in args.rows:
            calls = variants(ops, n, k, rows, args.stream)
            timings = best_us(calls, args.rounds)
            for name, (us, cpu_us) in timings.items():
                gbs = n * k * BYTES_PER_WEIGHT[name.split()[0]] / us / 1e3
                print(
                    f"{shape:>5} {n:>5}x{k:<4} {rows:>4}  {name:<16} {us:9.1f} {gbs:6.1f}"
                    f" {cpu_us:9.1f}"
                )
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
