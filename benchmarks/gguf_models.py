"""A 1B-shaped Q4_K_M GGUF served before and after K-quants became bfloat16
panels: decode speed and memory, one process.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gguf_models.py [--folder DIR]
        [--steps 8] [--rounds 3] [--keep]

Writes (once, under ``--folder``) a Llama GGUF of 1B's shape (hidden 2048,
16 layers, 32/8 heads, FFN 8192, vocab 49152) in llama.cpp's Q4_K_M mix
(``tests/gguf_files.py``: random blocks, scales small and finite) and
converts it in a child process (the cache folder ``MSTAR_KV_CACHE`` under
``--folder``, so the converted float32 model goes with it). Then, in this
process: ``Engine.from_pretrained(file, quantization="gguf")`` (float32
activations) with the K-quant layers as bfloat16 panels (this tree), its
peak RSS (``resource.getrusage``: the start-up check's float32 reference
copy included) and its RSS once started (anonymous and files' pages); then
the same with the panels refused (``bf16_or_why`` patched: the layers keep
their float32 dequantization, as before this change), both engines' RSS;
then the two decode one request in turns, ``--rounds`` rounds of
``--steps`` decode steps each (after a 32-token prompt and two warm-up
steps). Prints the median step of
each engine's best round as tok/s, and the load average. ``--keep`` keeps
the files (4.7 GB converted), else they are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from gguf_files import LlamaShape, q4_k_m_types, write_llama_gguf

SHAPE_1B = LlamaShape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=49152)
FILE = "llama-1b-shaped.Q4_K_M.gguf"
GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mstar-gguf-1b"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    os.environ["MSTAR_KV_CACHE"] = str(args.folder / "cache")
    path = args.folder / FILE
    try:
        prepared(path)
        measure(path, args.steps, args.rounds)
    finally:
        if not args.keep:
            shutil.rmtree(args.folder, ignore_errors=True)


def prepared(path: Path) -> None:
    """The file written and converted (in a child: its memory is not this process')."""
    if not path.exists():
        start = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_llama_gguf(path.with_suffix(".partial"), q4_k_m_types, SHAPE_1B).rename(path)
        print(
            f"wrote {path} ({path.stat().st_size / GiB:.2f} GiB, {time.perf_counter() - start:.0f} s)"
        )
    start = time.perf_counter()
    code = "import sys; from mstar.models.loader import model_folder; model_folder(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    print(f"converted ({time.perf_counter() - start:.0f} s)")


def rss_gib(kind: str = "VmRSS") -> float:
    """This process' resident memory now (``RssAnon``: its own; ``RssFile``:
    files' pages it maps, e.g. the converted model's, reclaimable)."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith(f"{kind}:"))
    return kib / 2**20


def resident() -> str:
    return f"RSS {rss_gib():.2f} GiB (anonymous {rss_gib('RssAnon'):.2f}, files {rss_gib('RssFile'):.2f})"


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure(path: Path, steps: int, rounds: int) -> None:
    import mstar.cpu.quant as quant
    from mstar.engine import Engine

    print(f"before loading: {resident()}")
    start = time.perf_counter()
    panels = Engine.from_pretrained(str(path), quantization="gguf")
    print(f"panels: {panels.model.mstar_quantization}")
    print(
        f"  start-up {time.perf_counter() - start:.0f} s, peak RSS {peak_gib():.2f} GiB;"
        f" once started {resident()} ({panels.mode_check.describe()})"
    )
    real = quant.bf16_or_why
    quant.bf16_or_why = lambda: "refused here: as before the panels"
    try:
        start = time.perf_counter()
        float32 = Engine.from_pretrained(str(path), quantization="gguf")
    finally:
        quant.bf16_or_why = real
    print(f"float32: {float32.model.mstar_quantization}")
    print(
        f"  start-up {time.perf_counter() - start:.0f} s; both engines {resident()}"
        f" (peak of the process so far {peak_gib():.2f} GiB)"
    )
    engines = {"float32 (before)": float32, "bf16 panels": panels}
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, engine in engines.items():
            step = decode_step(engine, steps)
            best[name] = min(best.get(name, step), step)
    load = os.getloadavg()
    for name, step in best.items():
        print(
            f"{name}: decode {1 / step:.2f} tok/s ({step * 1e3:.0f} ms a step, best round's median)"
        )
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def decode_step(engine: object, steps: int) -> float:
    """The median wall time of ``steps`` decode steps of one request (a
    32-token prompt, two warm-up steps first)."""
    from mstar.engine import SamplingParams

    params = SamplingParams(max_new_tokens=steps + 4, ignore_eos=True)
    rid = engine.add_request([(7 * j) % 1000 for j in range(32)], params)
    start = engine.stats.decode_steps
    while engine.stats.decode_steps < start + 2:
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort(rid)
    return statistics.median(times)


if __name__ == "__main__":
    main()
