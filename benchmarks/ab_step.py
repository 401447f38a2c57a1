"""Before/after a decode step, the two trees in separate processes taking turns.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_step.py /work/main /work/wt/step \\
        [--rows 1 32] [--rounds 2] [--steps 8] [--compile] [--threads N]
        [--dtype auto] [--quantization auto]

Each round runs one process per tree (``PYTHONPATH=<tree>``, the trees in
turns), each measuring, per ``--rows``, an ``Engine`` on SmolLM2
(``Engine.from_pretrained`` with ``--dtype`` and ``--quantization``: float32
and none by default; ``auto`` both for what ``serve`` runs) with that many
requests decoding (32-token prompts): the median wall and process-CPU time
of ``--steps`` decode steps, and the model's linear layers alone at those
rows (``mstar.bench.roofline.linear_modules``, the head once, called in
turn), wall and CPU time. Prints each tree's best
round per rows (by CPU time: on a shared machine wall time mostly measures
the others) and the load. ``--threads``: torch's intra-op threads (default: torch's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, statistics, sys, time, torch
from mstar.engine import Engine, SamplingParams
from mstar.bench.roofline import linear_modules
rows_list, steps, compile_ = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
engine = Engine.from_pretrained("smollm2", dtype=sys.argv[4], quantization=sys.argv[5],
                                num_pages=max(rows_list) * 8 + 16, prefix_cache=False,
                                compile=compile_)
linears = linear_modules(engine.model)
out = {"compiled": engine.compiled}
for rows in rows_list:
    params = SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)
    for i in range(rows):
        engine.add_request([(7 * i + j) % 1000 for j in range(32)], params)
    while engine.stats.decode_steps < 2 + out.get("decodes", 0):
        engine.step()
    wall, cpu, alone = [], [], []
    xs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - t); cpu.append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            for m in linears:
                m(xs[m.in_features])
        alone.append((time.perf_counter() - t, time.process_time() - c))
    out[rows] = [statistics.median(wall), statistics.median(cpu),
                 statistics.median(a for a, _ in alone), statistics.median(c for _, c in alone)]
    for rid in list(engine._running):
        engine.abort(rid)
    out["decodes"] = engine.stats.decode_steps
print("RESULT" + json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()
    best: dict[str, dict[int, list[float]]] = {t: {} for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": tree}
            if args.threads:
                env["OMP_NUM_THREADS"] = str(args.threads)
            load = os.getloadavg()[0]
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(args.rows), str(args.steps),
                 "1" if args.compile else "0", args.dtype, args.quantization],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
            result = json.loads(line.removeprefix("RESULT"))
            print(f"round {r} {tree} ({result['compiled'] or 'eager'}), load {load:.1f}:", end="")
            for rows in args.rows:
                wall, cpu, alone, alone_cpu = result[str(rows)]
                print(f"  B={rows}: step {wall * 1e3:.1f} ms (cpu {cpu * 1e3:.1f}), linear"
                      f" alone {alone * 1e3:.1f} (cpu {alone_cpu * 1e3:.1f})", end="")  # fmt: skip
                if rows not in best[tree] or cpu < best[tree][rows][1]:
                    best[tree][rows] = [wall, cpu, alone, alone_cpu]
            print(flush=True)
    print("best round per tree (by the step's CPU time); step/linear in wall and in CPU time:")
    for rows in args.rows:
        for tree in args.trees:
            wall, cpu, alone, alone_cpu = best[tree][rows]
            print(f"  B={rows:<3d} {tree:20s} step {wall * 1e3:7.1f} ms  cpu {cpu * 1e3:7.1f} ms"
                  f"  linear alone {alone * 1e3:6.1f} ms  cpu {alone_cpu * 1e3:6.1f} ms"
                  f"  step/linear {wall / alone:.2f}x  cpu {cpu / alone_cpu:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
