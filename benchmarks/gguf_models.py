"""Our engine beside llama.cpp on the same GGUF files: load, memory, prefill
and decode speed, one markdown table.

    python benchmarks/gguf_models.py --files A.gguf [B.gguf ...]
        [--llama-bench PATH] [--threads 2] [--folder DIR]
        [--write 1b:Q4_K_M,1b:Q4_0,8b:Q4_K_M] [--no-ours] [--turns 3] [--paired 20]

``--write SIZE:MIX,...`` first writes files with random valid blocks
(``tests/gguf_files.py``) under ``--folder`` and adds them to the files:
SIZE a Llama's ``tiny`` (hidden 256, 2 layers), ``1b`` (2048, 16 layers,
32/8 heads, FFN 8192), ``3b`` (3072, 28, 24/8, 8192), ``8b`` (4096, 32,
32/8, 14336); ``qwen2-1.5b`` (Qwen2.5-1.5B's 1536, 28, 12/2, 8960, q/k/v
biases) or ``qwen3-1.7b`` (Qwen3-1.7B's 2048, 28, 16/8, 6144, q/k norms);
vocab 49152; MIX ``Q4_K_M`` (llama.cpp's mix), ``Q5_K_M`` (the same on
Q5_K), ``Q4_0`` (the head Q6_K, as
llama-quantize makes it), ``Q8_0``, ``Q6_K`` or ``F16``. The weights'
standard deviation is ``--std`` (default 0.02, a real 1B's scale: the
types' own ~0.05-0.08 make a 16-layer random model chaotic, so bfloat16's
rounding grows past the start-up check's bound, which then refuses it).

Each file gets one row per engine and a ratio row (ours / llama.cpp):

- *size*: the file's GiB.
- *load 1st / 2nd*: seconds. Ours: ``Engine.from_pretrained(file,
  dtype="auto", quantization="auto")`` in a child process, first with the
  file's entries removed from the cache folder (``MSTAR_KV_CACHE``, under
  ``--folder``; on a fresh folder the first file's first load also builds
  the kernels), then again on that cache. llama.cpp: the wall time of
  ``llama-bench -p 0 -n 1 -r 1`` (the load, a warm-up token and one token).
- *peak RSS*: GiB, the process's high-water mark (ours: ``VmHWM`` of the
  first load / of the measuring child; llama.cpp: ``ru_maxrss`` of the
  ``llama-bench -p 512 -n 64`` run).
- *RSS started*: ours, GiB resident once loaded (``VmRSS``).
- *pp512*: prefill of a 512-token prompt, tok/s (ours: one request, a token
  budget of 512 so one forward, best of ``--rounds``, default 5; llama.cpp:
  pp512, the best of llama-bench's 5 repetitions: the same tries each, and
  on a shared machine the mean mixes in runs that waited for a core).
- *tg64*: decode of one request, tok/s (ours: 64 steps after a 32-token
  prompt and 2 warm-up steps, best of ``--rounds``; llama.cpp: tg64, the
  best of its 5).
- *8 at once*: ours, decode tok/s of 8 requests together (64 steps after
  32-token prompts, best of ``--rounds``); llama-bench has no such test.
- *read GB/s*: the machine's floor in our run, the best of three read
  probes (``mstar.bench.roofline.read_probe``: one sum of 512 MiB) after
  the speed runs.

``--turns N``: the speed runs (ours, then llama-bench's pp512/tg64) take N
turns per file, alternating, and each column is the median of the turns
(peak RSS: the highest); below the table, each file's per-turn ratios of
pp512 and tg64 (this machine's memory rate moves 10-30% from minute to
minute, so one turn of each can land on either side of a tie).

``--paired N``: after the table, decode alone once more in N pairs a file,
in one child of ours: one of our 64-token rounds (``tg64``'s), then
``llama-bench -p 0 -n 64 -r 1`` (its load, warm-up and one tg64), in turn;
printed: each engine's median, and per pair ours / llama.cpp (its median and
range, and in how many pairs ours is ahead). The pairs lie seconds apart,
so the memory rate's drift, which the turns' minutes let in, mostly cancels.

llama.cpp runs in this process's environment less ``OMP_WAIT_POLICY`` and
``OMP_NUM_THREADS`` (its own default: threads that spin, ``-t`` of them);
ours runs each measurement in a child with ``OMP_WAIT_POLICY=PASSIVE``, torch on
``--threads`` threads. Prefix caching is off in ours (each round's prompt
is computed, as llama-bench's are).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).parents[1] / "tests"
GiB = 2**30
FLAGS = re.compile(r"^(avx512\w*|avx2|fma|f16c)$")
SIZES = {  # hidden, layers, heads, kv heads, FFN, vocab
    "tiny": (256, 2, 4, 2, 512, 288),
    "1b": (2048, 16, 32, 8, 8192, 49152),
    "3b": (3072, 28, 24, 8, 8192, 49152),
    "8b": (4096, 32, 32, 8, 14336, 49152),
    "qwen2-1.5b": (1536, 28, 12, 2, 8960, 49152),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144, 49152),
}
COLUMNS = ("size GiB", "load 1st s", "load 2nd s", "peak RSS GiB", "RSS started GiB",
           "pp512 tok/s", "tg64 tok/s", "8 at once tok/s", "read GB/s")  # fmt: skip
TURNED = ("pp512 tok/s", "tg64 tok/s")  # the columns whose per-turn ratios are printed
OURS_ONLY = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")  # set for ours; llama-bench runs without them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=Path, nargs="*", default=[])
    parser.add_argument("--write", default="", help="SIZE:MIX,... files to write first")
    parser.add_argument("--std", type=float, default=0.02, help="written weights' std")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mstar-gguf-bench"))
    parser.add_argument("--llama-bench", default=shutil.which("llama-bench"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="ours: best of (llama-bench's -r 5)")
    parser.add_argument(
        "--turns", type=int, default=1, help="speed runs a file, alternating (0: none)"
    )
    parser.add_argument("--no-ours", action="store_true", help="llama.cpp's rows only")
    parser.add_argument("--paired", type=int, default=0, help="decode alone: N pairs a file")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paired and (not args.llama_bench or args.no_ours):
        parser.error(
            "--paired needs llama-bench (--llama-bench PATH or on PATH) and ours (no --no-ours)"
        )
    if args.child is not None:
        if args.paired:
            print(json.dumps(paired_here(args.child, args.llama_bench, args.threads, args.paired)))
        else:
            print(json.dumps(measure_here(args.child, args.threads, args.rounds, args.load_only)))
        return
    files = [
        *args.files,
        *(written(spec, args.folder, args.std) for spec in args.write.split(",") if spec),
    ]
    print(cpu_line() + f"{args.threads} threads; load average {os.getloadavg()[0]:.1f}\n")
    rows, turned, paired = [], [], []
    for path in files:
        if args.paired:
            paired.append(pairs_line(path, paired_run(path, args)))
        if not args.turns:
            continue
        ours, peer = in_turns(path, args)
        rows += [(path.name, "ours", ours)] if not args.no_ours else []
        rows += [(path.name, "llama.cpp", peer)] if args.llama_bench else []
        if ours and peer:
            rows.append((path.name, "ours / llama.cpp", ratios(ours, peer)))
            turned.append(f"{path.name}: " + per_turn(ours, peer))
    if rows:
        print(markdown(rows))
    if args.turns > 1 and turned:
        print("\nours / llama.cpp in each turn:\n" + "\n".join(turned))
    if paired:
        print(f"\ndecode alone in {args.paired} pairs (ours' round, then llama-bench's):\n"
              + "\n".join(paired))  # fmt: skip
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


def cpu_line() -> str:
    """The CPU's model name and its avx512*/avx2/fma/f16c flags (lscpu)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = [f for f in fields.get("Flags", "").split() if FLAGS.match(f)]
    return f"CPU: {fields.get('Model name', '?').strip()}; flags: {' '.join(flags)}\n"


def written(spec: str, folder: Path, std: float) -> Path:
    """The file ``SIZE:MIX`` names under ``folder``, its weights of
    standard deviation ``std``, written unless there."""
    sys.path.insert(0, str(TESTS))
    from gguf_files import LlamaShape, q4_k_m_types, write_llama_gguf

    size, mix = spec.split(":")
    arch, _, _ = size.rpartition("-")
    path = folder / f"{'llama-' * (not arch)}{size}-shaped.{mix}.gguf"
    if not path.exists():
        mixes = {
            "Q4_K_M": q4_k_m_types,
            "Q5_K_M": lambda n, i, k: q4_k_m_types(n, i, k).replace("Q4_K", "Q5_K"),
            "Q4_0": lambda n, i, k: "Q6_K" if n == "output" else "Q4_0",
        }
        types = mixes.get(mix, lambda n, i, k: mix)
        start = time.perf_counter()
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        shape = LlamaShape(*SIZES[size])
        write_llama_gguf(partial, types, shape, arch=arch or "llama", std=std).rename(path)
        print(f"wrote {path} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return path


# --- ours -------------------------------------------------------------------------------


def in_turns(path: Path, args: argparse.Namespace) -> tuple[dict | None, dict | None]:
    """Ours and llama.cpp's rows on ``path``: the loads, then ``--turns``
    speed runs of each, alternating; each row's turns (a list, None where
    that engine is off or failed)."""
    cache = args.folder / "cache"
    first = None if args.no_ours else our_first_load(path, cache, args)
    loads = None if args.llama_bench is None else llama_loads(path, args.llama_bench, args)
    ours, peer = [], []
    for _ in range(args.turns):
        if first is not None:
            ours.append(our_row(path, first, cache, args))
        if loads is not None:
            peer.append(llama_row(path, loads, args.llama_bench, args))
    return median_row(ours), median_row(peer)


def median_row(turns: list[dict | None]) -> dict | None:
    """One row of ``turns``: each column's median (peak RSS: the highest),
    and the turns themselves under ``turns``; None if any failed or none ran."""
    if not turns or None in turns:
        return None
    row = dict(turns[0], turns=turns)
    for column in (*TURNED, "8 at once tok/s", "read GB/s", "load 2nd s"):
        values = [t[column] for t in turns if t.get(column) is not None]
        row[column] = statistics.median(values) if values else None
    peaks = [t["peak RSS GiB"] for t in turns]
    row["peak RSS GiB"] = max(peaks, key=lambda p: max(p) if isinstance(p, tuple) else p)
    return row


def our_first_load(path: Path, cache: Path, args: argparse.Namespace) -> dict | None:
    """Ours loading ``path`` with the file's cache entries removed, in a child."""
    from mstar.cpu.cachedir import file_key

    for stale in cache.glob(f"{file_key(path)}*"):
        shutil.rmtree(stale, ignore_errors=True)
    return child(path, cache, args, "--load-only")


def our_row(path: Path, first: dict, cache: Path, args: argparse.Namespace) -> dict | None:
    """Ours on ``path`` after its ``first`` load: a load and the speed runs, in a child."""
    run = child(path, cache, args)
    if run is None:
        return None
    return {"size GiB": path.stat().st_size / GiB, "load 1st s": first["load_s"],
            "load 2nd s": run["load_s"], "peak RSS GiB": (first["peak_gib"], run["peak_gib"]),
            "RSS started GiB": run["rss_gib"], "pp512 tok/s": run["prefill"],
            "tg64 tok/s": run["decode"], "8 at once tok/s": run["decode8"],
            "read GB/s": run["read_gbs"]}  # fmt: skip


def child(path: Path, cache: Path, args: argparse.Namespace, *extra: str) -> dict | None:
    """``measure_here`` in a child (OMP_WAIT_POLICY=PASSIVE); None if it failed."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "MSTAR_KV_CACHE": str(cache),
           "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
    command = [sys.executable, __file__, "--child", str(path), "--threads", str(args.threads),
               "--rounds", str(args.rounds), *extra]  # fmt: skip
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(f"ours on {path.name} failed (exit {done.returncode})", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_here(path: Path, threads: int, rounds: int, load_only: bool) -> dict:
    """Load ``path`` in this process and, unless ``load_only``, time it."""
    from mstar.bench.roofline import read_probe

    start = time.perf_counter()
    engine = load_engine(path, threads)
    out = {"load_s": time.perf_counter() - start, "rss_gib": status_gib("VmRSS")}
    print(f"{path.name}: {engine.model.mstar_quantization}", file=sys.stderr)
    if not load_only:
        out["prefill"] = max(prefill_rate(engine, 512, r) for r in range(rounds))
        out["decode"] = max(decode_rate(engine, 1, 64) for _ in range(rounds))
        out["decode8"] = max(decode_rate(engine, 8, 64) for _ in range(rounds))
    out["peak_gib"] = status_gib("VmHWM")  # before the probe's 512 MiB
    if not load_only:
        probe = read_probe()
        out["read_gbs"] = max(probe() for _ in range(3)) / 1e9
    return out


def load_engine(path: Path, threads: int) -> object:
    """Ours on ``path`` as every measurement here loads it (torch on ``threads``
    threads, one 512-token forward a prefill, no prefix cache)."""
    import torch

    from mstar.engine import Engine

    torch.set_num_threads(threads)
    return Engine.from_pretrained(
        str(path), dtype="auto", quantization="auto", token_budget=512, prefix_cache=False
    )


def paired_run(path: Path, args: argparse.Namespace) -> dict | None:
    """``paired_here`` on ``path`` in a child (None if it failed)."""
    extra = ("--paired", str(args.paired), "--llama-bench", args.llama_bench)
    return child(path, args.folder / "cache", args, *extra)


def paired_here(path: Path, binary: str, threads: int, pairs: int) -> dict:
    """Load ``path`` here, then ``pairs`` times one of our ``tg64`` rounds
    and one ``llama-bench`` tg64 on the same file: their tok/s, pair by pair."""
    engine = load_engine(path, threads)
    decode_rate(engine, 1, 64)  # a warm-up round, as llama-bench's own
    ours, peer = [], []
    for _ in range(pairs):
        ours.append(decode_rate(engine, 1, 64))
        found, _, _ = llama_bench(binary, path, threads, 0, 64, "-r", "1")
        peer.append(None if found is None else max(found[0]["samples_ts"]))
    return {"ours": ours, "peer": peer}


def pairs_line(path: Path, run: dict | None) -> str:
    """One file's paired decode: the medians, and ours / llama.cpp per pair."""
    if run is None or None in run["peer"]:
        return f"{path.name}: failed"
    ratio = [a / b for a, b in zip(run["ours"], run["peer"], strict=True)]
    ahead = sum(r > 1 for r in ratio)
    return (
        f"{path.name}: ours {statistics.median(run['ours']):.2f} tok/s, llama.cpp "
        f"{statistics.median(run['peer']):.2f}; ours / llama.cpp median {statistics.median(ratio):.2f}"
        f" ({min(ratio):.2f}-{max(ratio):.2f}), ours ahead in {ahead} of {len(ratio)}"
    )


def status_gib(field: str) -> float:
    """``field`` of /proc/self/status (VmRSS, VmHWM) in GiB."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))
    return kib / 2**20


def prompt(engine: object, length: int, seed: int) -> list[int]:
    vocab = engine.model.config.vocab_size
    return [(7 * j + 13 * seed + 1) % vocab for j in range(length)]


def prefill_rate(engine: object, length: int, seed: int) -> float:
    """tok/s of one ``length``-token prompt's prefill (one token sampled)."""
    from mstar.engine import SamplingParams

    until = engine.stats.prefill_tokens + length
    start = time.perf_counter()
    engine.add_request(prompt(engine, length, seed), SamplingParams(max_new_tokens=1))
    while engine.stats.prefill_tokens < until:
        engine.step()
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return length / seconds


def decode_rate(engine: object, batch: int, steps: int) -> float:
    """tok/s of ``steps`` decode steps of ``batch`` requests (32-token
    prompts, prefilled, 2 warm-up steps first)."""
    from mstar.engine import SamplingParams

    params = SamplingParams(max_new_tokens=steps + 4, ignore_eos=True)
    ids = [engine.add_request(prompt(engine, 32, i), params) for i in range(batch)]
    warm = engine.stats.decode_steps + 2
    while engine.stats.decode_steps < warm:
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    for rid in ids:
        engine.abort(rid)
    return batch * steps / seconds


# --- llama.cpp ----------------------------------------------------------------------------


def llama_loads(path: Path, binary: str, args: argparse.Namespace) -> list[float] | None:
    """Two short llama-bench runs on ``path``: their wall seconds (None if one failed)."""
    loads = [llama_bench(binary, path, args.threads, 0, 1, "-r", "1")[1] for _ in range(2)]
    return None if None in loads else loads


def llama_row(path: Path, loads: list[float], binary: str, args: argparse.Namespace) -> dict | None:
    """llama-bench's pp512/tg64 on ``path``, with its two ``loads``."""
    found, _, peak = llama_bench(binary, path, args.threads, 512, 64)
    if found is None:
        return None
    rate = {(r["n_prompt"], r["n_gen"]): max(r["samples_ts"]) for r in found}
    return {"size GiB": path.stat().st_size / GiB, "load 1st s": loads[0],
            "load 2nd s": loads[1], "peak RSS GiB": peak, "pp512 tok/s": rate.get((512, 0)),
            "tg64 tok/s": rate.get((0, 64))}  # fmt: skip


def llama_bench(
    binary: str, path: Path, threads: int, prompt_len: int, gen: int, *extra: str
) -> tuple[list | None, float | None, float]:
    """(llama-bench's JSON results, wall seconds, peak RSS GiB); Nones if it failed."""
    command = [binary, "-m", str(path), "-t", str(threads), "-p", str(prompt_len),
               "-n", str(gen), "-o", "json", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in OURS_ONLY}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds, peak = time.perf_counter() - start, usage.ru_maxrss / 2**20
        if proc.returncode != 0:
            err.seek(0)
            tail = "\n".join(err.read().strip().splitlines()[-5:])
            print(
                f"llama-bench on {path.name} failed ({proc.returncode}):\n{tail}", file=sys.stderr
            )
            return None, None, peak
    return json.loads(out), seconds, peak


# --- the table ---------------------------------------------------------------------------


def ratios(ours: dict, peer: dict) -> dict:
    """ours / llama.cpp per column both have (our peak: the higher of the two)."""
    out = {}
    for column in COLUMNS:
        a, b = ours.get(column), peer.get(column)
        a = max(a) if isinstance(a, tuple) else a
        if a is not None and b:
            out[column] = a / b
    return out


def per_turn(ours: dict, peer: dict) -> str:
    """The ratios of ``TURNED`` in each turn both engines ran."""
    pairs = list(zip(ours["turns"], peer["turns"], strict=False))
    return "; ".join(
        f"{column.split()[0]} " + " ".join(f"{a[column] / b[column]:.2f}" for a, b in pairs)
        for column in TURNED
    )


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return " / ".join(cell(v) for v in value)
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def markdown(rows: list[tuple[str, str, dict | None]]) -> str:
    lines = ["| file | engine | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for name, engine, row in rows:
        values = ["failed"] * len(COLUMNS) if row is None else [cell(row.get(c)) for c in COLUMNS]
        lines.append(f"| {name} | {engine} | " + " | ".join(values) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
