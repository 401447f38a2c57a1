"""A Qwen2.5-0.5B-shaped Q4_0 GGUF decoded through the fused layers and
through HF's forward (the hook path, all a Qwen2 had before): one request's
decode speed, one process, in turns.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fused_archs.py [--folder DIR]
        [--arch qwen2] [--steps 8] [--rounds 3] [--keep]

Writes (once, under ``--folder``) a GGUF of Qwen2.5-0.5B's shape (hidden
896, 24 layers, 14/2 heads, FFN 4864; vocab 65536, not 151936: the most
``gguf_files``' byte-level vocabulary takes, the head's cost the same in both
paths) (``--arch qwen3`` the
same shape with q/k head norms instead of q/k/v biases), its Q4_0 layers
and a Q8_0 embedding and head (``tests/gguf_files.py``: random blocks), then
two engines on it (``quantization="gguf"``, eager): ``fused=True`` and
``fused=False``, decoding one request in turns (``gguf_models.decode_step``:
a 32-token prompt, two warm-up steps, ``--steps`` timed). Prints each
one's best round's median step as tok/s and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from gguf_files import LlamaShape, write_llama_gguf
from gguf_models import GiB, decode_step

SHAPE = LlamaShape(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=65536)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mstar-gguf-0.5b"))
    parser.add_argument("--arch", choices=("qwen2", "qwen3"), default="qwen2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    os.environ["MSTAR_KV_CACHE"] = str(args.folder / "cache")
    path = args.folder / f"{args.arch}-0.5b-shaped.Q4_0.gguf"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            types = {"token_embd": "Q8_0", "output": "Q8_0"} | dict.fromkeys(LINEARS, "Q4_0")
            partial = path.with_suffix(".partial")
            write_llama_gguf(partial, types, SHAPE, arch=args.arch).rename(path)
            print(f"wrote {path} ({path.stat().st_size / GiB:.2f} GiB)")
        measure(path, args.steps, args.rounds)
    finally:
        if not args.keep:
            shutil.rmtree(args.folder, ignore_errors=True)


def measure(path: Path, steps: int, rounds: int) -> None:
    from mstar.engine import Engine

    engines = {}
    for fused in (True, False):
        start = time.perf_counter()
        engine = Engine.from_pretrained(str(path), quantization="gguf", fused=fused)
        name = "fused" if engine.fused else "HF forward (hook path)"
        engines[name] = engine
        print(f"{name}: start-up {time.perf_counter() - start:.0f} s")
    print(engines["fused"].model.mstar_quantization)
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, engine in engines.items():
            step = decode_step(engine, steps)
            best[name] = min(best.get(name, step), step)
    load = os.getloadavg()
    for name, step in best.items():
        print(
            f"{name}: decode {1 / step:.2f} tok/s ({step * 1e3:.1f} ms a step, best round's median)"
        )
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
