"""Before/after: the same serving steps through the KVManager of a checkout.

    git worktree add /tmp/before a495f14
    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_manager.py /tmp/before
    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_manager.py .

Only the public API (KVManager, KVStep, Segment), so any version runs it.
Medians of steps each timed alone, µs: steady decode, churn (2 leave, 2 join),
mixed (decode + a 512-token prefill), warm and cold (48 MiB written between
steps), 256 x 32k steady beside one np.copyto of its indices, and batch 1.
"""

import sys
import time
from pathlib import Path

root = str(Path(sys.argv[1]).resolve())
sys.path.insert(0, root)

import numpy as np  # noqa: E402

from mstar.engine.resources.kv.manager import KVManager  # noqa: E402
from mstar.engine.resources.step import KVStep, Segment  # noqa: E402

PS = 16
EVICT = np.zeros(48 << 20, np.uint8)


def step(m, segs):
    s = KVStep(segs)
    m.admit(s)
    p = m.plan(s)
    m.commit(s)
    return p


def prefilled(batch, ctx, spare):
    m = KVManager(batch * (ctx // PS + 300) + spare, PS)
    names = [f"r{i}" for i in range(batch)]
    step(m, tuple(Segment(r, "main", ctx + i % PS) for i, r in enumerate(names)))
    return m, names


def median_us(prepare, n, cold):
    times = []
    for i in range(n):
        timed = prepare(i)
        if cold:
            EVICT[::64] = i & 255
        t0 = time.perf_counter()
        timed()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main() -> None:
    out = {}
    for cold in (False, True):
        tag = "cold" if cold else "warm"
        m, names = prefilled(256, 4096, 0)
        segs = tuple(Segment(r, "main", 1) for r in names)
        out[f"steady {tag}"] = median_us(lambda i, m=m, s=segs: lambda: step(m, s), 200, cold)
        m, names = prefilled(256, 4096, 200 * 2 * 260)

        def churn(i, m=m, names=names):
            for r in names[:2]:
                m.release(r)
            del names[:2]
            new = [f"j{i}.{j}" for j in range(2)]
            step(m, tuple(Segment(r, "main", 4096) for r in new))
            names.extend(new)
            s = tuple(Segment(r, "main", 1) for r in names)
            return lambda: step(m, s)

        out[f"churn {tag}"] = median_us(churn, 200, cold)
        m, names = prefilled(256, 4096, 64)
        last = []

        def mixed(i, m=m, names=names, last=last):
            for r in last:
                m.release(r)
            last[:] = [f"m{i}"]
            s = (*(Segment(r, "main", 1) for r in names), Segment(last[0], "main", 512))
            return lambda: step(m, s)

        out[f"mixed {tag}"] = median_us(mixed, 200, cold)
    m, names = prefilled(256, 32768, 0)
    segs = tuple(Segment(r, "main", 1) for r in names)
    indices = step(m, segs)["main"].cpu_indptrs.paged_kv_indices.numpy()
    target = np.empty_like(indices)
    out["steady 256x32k"] = median_us(lambda i: lambda: step(m, segs), 300, False)
    out["copyto 256x32k"] = median_us(lambda i: lambda: np.copyto(target, indices), 300, False)
    m, names = prefilled(1, 1024, 0)
    segs = tuple(Segment(r, "main", 1) for r in names)
    out["batch 1"] = median_us(lambda i: lambda: step(m, segs), 2000, False)
    print(root, " ".join(f"{k}={v:.1f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
