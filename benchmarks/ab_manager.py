"""Before/after: the same serving steps through two checkouts' KVManager, in one process.

    git worktree add /tmp/before a495f14
    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_manager.py /tmp/before [AFTER_ROOT=.] [--quick]

Each checkout's ``mstar`` is copied to a temp dir as ``mstar_before`` / ``mstar_after``
(its ``mstar`` imports rewritten), so both load side by side. Each case builds one
manager per checkout and alternates their steps in one loop (before, after, before,
...), each step (admit + plan + commit) timed alone, over a few rounds of fresh
managers (200 steps each, so rows stay near their length); the table gives medians, µs.
Only the public API (KVManager, KVStep, Segment), so any version runs it.

Page size 16, rows staggered (row i prefilled with ctx + i % 16 tokens). Cases: batch
1 x 4k and 32 x 4k decode; 256 x 4k decode on one reused Segment tuple and on fresh Segments each
step; 256 x 32k decode beside one np.copyto of its step's indices (timed alone); churn
(2 rows leave, 2 join with an untimed prefill, then the decode); mixed (decode + a new
512-token prefill row); steady, churn and mixed cold (48 MiB written before each);
churn anywhere at 32 and 256 rows, warm and cold (batch // 32 rows leave at random
places, untimed, and as many newcomers join with a 64-token prompt prefilled in the
decode step); the steady decode with the prefix cache on and off, in turns, fresh
steps each time: on with the new tokens one array on the step (``KVStep.tokens``, as the engine
makes its steps; a checkout without it gets them on its Segments) and with each
Segment carrying its token, off with neither (medians, and ``runs_mean``: the
recording of decode steps, batched ``PS`` at a time, spread over them); and
``match_prefix`` of 4096 tokens with 3504 cached; the steady decode with the prefix cache
on and KV tiers configured but idle (a disk tier below the pool, where the checkout has
``kv/tiers``) beside the same without. The last lines give the ratios the targets name,
for each checkout.
``--quick`` runs ~5x fewer steps (~40 s; the full run ~3 min). Comparing a checkout
with itself gives ratios within a few % of 1.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

PS = 16
EVICT = np.zeros(48 << 20, np.uint8)
# `from mstar.x` / `import mstar` / lazy-import strings like "mstar.engine.request"
_MSTAR = re.compile(r"""(\bfrom\s+|\bimport\s+|["'])mstar(?=[.\s])""")


class Api(NamedTuple):
    KVManager: Any
    KVStep: Any
    Segment: Any


def load(root: Path, name: str, tmp: Path) -> Api:
    """Import ``root``'s mstar package as ``name`` (a rewritten copy under ``tmp``)."""
    dst = tmp / name
    shutil.copytree(root / "mstar", dst, ignore=shutil.ignore_patterns("__pycache__"))
    for f in dst.rglob("*.py"):
        f.write_text(_MSTAR.sub(rf"\g<1>{name}", f.read_text()))
    manager = importlib.import_module(f"{name}.engine.resources.kv.manager")
    step = importlib.import_module(f"{name}.engine.resources.step")
    return Api(manager.KVManager, step.KVStep, step.Segment)


def clock(fn: Callable[[], Any], cold: bool = False) -> tuple[float, Any]:
    if cold:
        EVICT[::64] += 1
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def step(api: Api, m: Any, segs: tuple) -> Any:
    return run(m, api.KVStep(segs))


def run(m: Any, s: Any) -> Any:
    m.admit(s)
    p = m.plan(s)
    m.commit(s)
    return p


def decode(api: Api, names: list[str]) -> tuple:
    return tuple(api.Segment(r, "main", 1) for r in names)


def prefilled(api: Api, batch: int, ctx: int, spare: int = 0) -> tuple[Any, list[str]]:
    m = api.KVManager(batch * (ctx // PS + 300) + spare, PS)
    names = [f"r{i}" for i in range(batch)]
    step(api, m, tuple(api.Segment(r, "main", ctx + i % PS) for i, r in enumerate(names)))
    return m, names


# A case builds one checkout's manager and returns its i-th iteration: untimed setup,
# then clock() around each timed part; it returns the parts' seconds.
Iteration = Callable[[int], tuple[float, ...]]
Case = Callable[[Api, int], Iteration]


def steady(batch: int, ctx: int, cold: bool = False, fresh: bool = False) -> Case:
    def case(api: Api, n: int) -> Iteration:
        m, names = prefilled(api, batch, ctx)
        segs = decode(api, names)

        def it(i: int) -> tuple[float, ...]:
            s = decode(api, names) if fresh else segs
            return (clock(lambda: step(api, m, s), cold)[0],)

        return it

    return case


def with_copyto(api: Api, n: int) -> Iteration:
    m, names = prefilled(api, 256, 32768)
    segs = decode(api, names)
    target = np.empty(256 * (32768 // PS + 300), np.int32)

    def it(i: int) -> tuple[float, ...]:
        t_step, plan = clock(lambda: step(api, m, segs))
        idx = plan["main"].cpu_indptrs.paged_kv_indices.numpy()
        dst = target[: len(idx)]
        return t_step, clock(lambda: np.copyto(dst, idx))[0]

    return it


def churn(cold: bool = False) -> Case:
    def case(api: Api, n: int) -> Iteration:
        m, names = prefilled(api, 256, 4096, n * 2 * 260)

        def it(i: int) -> tuple[float, ...]:
            for r in names[:2]:
                m.release(r)
            del names[:2]
            new = [f"j{i}.{j}" for j in range(2)]
            step(api, m, tuple(api.Segment(r, "main", 4096) for r in new))
            names.extend(new)
            s = decode(api, names)
            return (clock(lambda: step(api, m, s), cold)[0],)

        return it

    return case


def churn_anywhere(batch: int, cold: bool = False) -> Case:
    """``batch // 32`` rows leave at random places (untimed), then the decode
    rows and as many newcomers' 64-token prefill rows in one step."""

    def case(api: Api, n: int) -> Iteration:
        m, names = prefilled(api, batch, 4096, n * max(1, batch // 32) * 8)
        rng = np.random.default_rng(0)  # the same rows leave on both sides
        leave = max(1, batch // 32)

        def it(i: int) -> tuple[float, ...]:
            for j in sorted(rng.choice(len(names), leave, replace=False).tolist(), reverse=True):
                m.release(names.pop(j))
            new = [f"n{i}.{j}" for j in range(leave)]
            s = (*decode(api, names), *(api.Segment(r, "main", 64) for r in new))
            names.extend(new)
            return (clock(lambda: step(api, m, s), cold)[0],)

        return it

    return case


def mixed(cold: bool = False) -> Case:
    def case(api: Api, n: int) -> Iteration:
        m, names = prefilled(api, 256, 4096, 64)
        rows = decode(api, names)

        def it(i: int) -> tuple[float, ...]:
            if i:
                m.release(f"m{i - 1}")
            s = (*rows, api.Segment(f"m{i}", "main", 512))
            return (clock(lambda: step(api, m, s), cold)[0],)

        return it

    return case


def prefix_decode(tokens: str) -> Case:
    """The steady 256 x 4k decode on fresh steps, the prefix cache on (the
    tokens on the step, ``tokens="step"``, or on each Segment, ``"segment"``)
    and off (no tokens), a step of each in turn: parts (on, off)."""

    def case(api: Api, n: int) -> Iteration:
        on, off = _prefix_decode(api, tokens), _prefix_decode(api, "off")
        return lambda i: on(i) + off(i)

    return case


def tiers_idle(api: Api, n: int) -> Iteration:
    """The steady 256 x 4k decode, the prefix cache on, tokens on the step,
    with KV tiers configured but idle (a disk tier below the pool; a
    checkout without ``kv/tiers`` runs it without) and without, a step of
    each in turn: parts (with, without)."""
    with_tiers, without = _prefix_decode(api, "step", tiers=True), _prefix_decode(api, "step")
    return lambda i: with_tiers(i) + without(i)


def _idle_tiers(api: Api, m: Any) -> None:
    """A disk tier (a temp dir) below ``m``'s pool, when the checkout has them."""
    pkg = api.KVManager.__module__.split(".")[0]
    try:
        tiers = importlib.import_module(f"{pkg}.engine.resources.kv.tiers")
    except ImportError:
        return
    cache = importlib.import_module(f"{pkg}.engine.resources.kv.cache").KVCache
    store = tiers.DiskStore(tempfile.mkdtemp(prefix="ab_tiers_"), 1 << 30)
    pool = m._pages
    pool.tiers = tiers.KVTiers(pool, cache(1, m.num_pages, PS, 1, 1), bytes(16), [store])


def _prefix_decode(api: Api, tokens: str, tiers: bool = False) -> Iteration:
    m = api.KVManager(256 * (4096 // PS + 300), PS, prefix_cache=tokens != "off")
    if tiers:
        _idle_tiers(api, m)
    rng = np.random.default_rng(0)
    names = [f"r{i}" for i in range(256)]
    lens = [4096 + i % PS for i in range(256)]
    step(
        api,
        m,
        tuple(api.Segment(r, "main", k, rng.integers(0, 50_000, k)) for r, k in zip(names, lens)),
    )
    on_step = tokens == "step" and "tokens" in api.KVStep.__dataclass_fields__

    def it(i: int) -> tuple[float, ...]:
        if on_step:
            s = api.KVStep(tuple(api.Segment(r, "main", 1) for r in names), tokens=np.full(256, i))
        else:
            t = None if tokens == "off" else [i]
            s = api.KVStep(tuple(api.Segment(r, "main", 1, t) for r in names))
        return (clock(lambda: run(m, s))[0],)

    return it


def match_prefix(api: Api, n: int) -> Iteration:
    tokens = np.random.default_rng(1).integers(0, 50_000, 4096)
    m = api.KVManager(2 * 4096 // PS, PS, prefix_cache=True)
    step(api, m, (api.Segment("warm", "main", 3504, tokens[:3504]),))
    m.release("warm")

    def it(i: int) -> tuple[float, ...]:
        if i:
            m.release(f"q{i - 1}")
        return (clock(lambda: m.match_prefix(f"q{i}", "main", tokens))[0],)

    return it


def runs_mean(samples: np.ndarray, axis: int = 0) -> np.ndarray:
    """The median over runs of ``PS`` steps (rounds hold whole runs) of each
    run's mean: a decode step's prefix recording, done ``PS`` steps at a
    time, spread over them; load spikes kept out."""
    return np.median(samples.reshape(-1, PS, *samples.shape[1:]).mean(axis=1), axis=axis)


def compare(case: Case, apis: list[Api], n: int, rounds: int, stat=np.median) -> np.ndarray:
    """Medians (or ``stat``: several give one array each), µs, [checkout, part]. Each
    round builds fresh managers (so rows stay near their stated length) and alternates
    the checkouts' iterations in one loop."""
    samples = []
    for _ in range(rounds):
        gc.collect()
        its = [case(api, n) for api in apis]
        samples += [[it(i) for it in its] for i in range(n)]
    if isinstance(stat, tuple):
        return tuple(f(np.array(samples), axis=0) * 1e6 for f in stat)
    return stat(np.array(samples), axis=0) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path, nargs="?", default=Path("."))
    ap.add_argument("--quick", action="store_true", help="~5x fewer steps")
    args = ap.parse_args()
    k = 5 if args.quick else 1
    cheap, warm, cold = 40 // k, 20 // k, 10 // k  # rounds (fresh managers) per case
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ab_manager_") as tmp:
        sys.path.insert(0, tmp)
        roots = [args.before.resolve(), args.after.resolve()]
        apis = [load(r, f"mstar_{s}", Path(tmp)) for r, s in zip(roots, ("before", "after"))]
        print(f"before: {roots[0]}\nafter:  {roots[1]}\n")
        rows["batch 1 x 4k"] = compare(steady(1, 4096), apis, 1000, warm)[:, 0]
        rows["batch 32 x 4k"] = compare(steady(32, 4096), apis, 300, warm)[:, 0]
        rows["steady 256 x 4k"] = compare(steady(256, 4096), apis, 200, cheap)[:, 0]
        fresh = steady(256, 4096, fresh=True)
        rows["steady 256 x 4k, fresh Segments"] = compare(fresh, apis, 200, cheap)[:, 0]
        both = compare(with_copyto, apis, 300, warm)
        rows["steady 256 x 32k"], rows["copyto 256 x 32k"] = both[:, 0], both[:, 1]
        rows["churn"] = compare(churn(), apis, 200, warm)[:, 0]
        rows["mixed"] = compare(mixed(), apis, 200, warm)[:, 0]
        rows["steady cold"] = compare(steady(256, 4096, cold=True), apis, 200, cold)[:, 0]
        rows["churn cold"] = compare(churn(cold=True), apis, 200, cold)[:, 0]
        rows["mixed cold"] = compare(mixed(cold=True), apis, 200, cold)[:, 0]
        rows["churn anywhere 32"] = compare(churn_anywhere(32), apis, 200, warm)[:, 0]
        rows["churn anywhere 256"] = compare(churn_anywhere(256), apis, 200, warm)[:, 0]
        rows["churn anywhere 256 cold"] = compare(churn_anywhere(256, True), apis, 200, cold)[:, 0]
        prefix = {}  # (tokens, stat) -> [checkout, (on, off)]
        for tokens in ("step", "segment"):
            cases = compare(prefix_decode(tokens), apis, 12 * PS, warm, (np.median, runs_mean))
            for stat, parts in zip(("median", "mean of 16"), cases):
                prefix[tokens, stat] = parts
                rows[f"prefix on, {tokens} tokens, {stat}"] = parts[:, 0]
                rows[f"prefix off, beside {tokens} tokens, {stat}"] = parts[:, 1]
        rows["match_prefix 4k"] = compare(match_prefix, apis, 200, warm)[:, 0]
        idle = compare(tiers_idle, apis, 12 * PS, warm, runs_mean)
        rows["prefix on, tiers idle, mean of 16"] = idle[:, 0]
        rows["prefix on, no tiers beside them, mean of 16"] = idle[:, 1]
    print("| step | before µs | after µs | after/before |\n|---|---:|---:|---:|")
    for name, (b, a) in rows.items():
        print(f"| {name} | {b:.1f} | {a:.1f} | {a / b:.2f} |")
    r = both[:, 0] / both[:, 1]
    print(f"\n256 x 32k step/copyto: before {r[0]:.2f}x, after {r[1]:.2f}x")
    for name, ref in (
        ("churn anywhere 256", "steady 256 x 4k, fresh Segments"),
        ("churn anywhere 256 cold", "steady cold"),
    ):
        r = rows[name] / rows[ref]
        print(f"{name} / {ref}: before {r[0]:.2f}x, after {r[1]:.2f}x")
    for (tokens, stat), parts in prefix.items():
        r = parts[:, 0] / parts[:, 1]
        print(f"prefix on/off, {tokens} tokens, {stat}: before {r[0]:.2f}x, after {r[1]:.2f}x")
    # the step with tiers idle against the same step of the checkout without (the ratio
    # within one checkout leans on which manager steps first: compare it with before's)
    r = idle[:, 0] / idle[:, 1]
    print(f"tiers idle / none beside, mean of 16: before {r[0]:.2f}x, after {r[1]:.2f}x")
    print(f"tiers idle, after / before, mean of 16: {idle[1, 0] / idle[0, 0]:.2f}x")


if __name__ == "__main__":
    main()
