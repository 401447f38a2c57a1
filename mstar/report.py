"""What the CLI shows: the demo's live progress and final table, and the
benchmark plot."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from mstar.bench import Row
from mstar.demo import Server, Stats


@contextmanager
def progress_bar(server: Server, disable: bool = False) -> Iterator[Callable[[Server], None]]:
    """A live bar of generated tokens; yields the per-step update."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    total = sum(r.max_new_tokens * r.n for r in server.requests)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, disable=disable, transient=False) as progress:
        task = progress.add_task("generating", total=total)

        def update(s: Server) -> None:
            done = sum(len(o) for r in s.requests for o in r.outputs.values())
            used = s.mgr.num_pages - s.mgr.num_free_pages
            progress.update(
                task,
                completed=done,
                description=f"step {s.step_index:4d}  pages {used:3d}/{s.mgr.num_pages}",
            )

        yield update


def demo_report(server: Server, stats: Stats) -> None:
    """The final table: workload, step mix, plan latency, pages."""
    from rich.console import Console
    from rich.table import Table

    reqs = server.requests
    forked = sum(r.n > 1 for r in reqs)
    guided = sum(r.uncond is not None for r in reqs)
    generated = sum(len(o) for r in reqs for o in r.outputs.values())
    p50, p99 = np.percentile(stats.plan_us, [50, 99]) if stats.plan_us else (0.0, 0.0)
    table = Table(title="mstar-kv demo", show_header=False)
    rows = [
        ("requests", f"{len(reqs)} ({forked} with continuations, {guided} guided)"),
        ("tokens", f"{stats.prefill_tokens + stats.decode_tokens} fed, {generated} generated"),
        ("steps", f"{stats.steps} ({stats.decode_steps} decode-only, {stats.mixed_steps} mixed)"),
        ("prefill / decode tokens", f"{stats.prefill_tokens} / {stats.decode_tokens}"),
        ("plan latency per step", f"p50 {p50:.0f} µs, p99 {p99:.0f} µs"),
        ("peak pages used", f"{stats.peak_pages} of {server.mgr.num_pages}"),
        ("pages saved by sharing", f"{stats.peak_shared} (peak)"),
        ("refused admissions", str(stats.refused)),
        ("preemptions", str(stats.preemptions)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def plot_latency(rows: list[Row], path: str) -> None:
    """Plan latency against batch size: the builder per pages/row, and a
    decode step through the manager per context length (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("build_paged_indptrs", "pages_per_row"), ("decode step", "context")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (bench, key) in zip(axes, panels):
        picked = [r for r in rows if r.bench == bench]
        for value in sorted({r.params[key] for r in picked}):
            line = sorted(
                (r.params["batch"], r.ours_us, r.baseline_us)
                for r in picked
                if r.params[key] == value
            )
            batch, ours, base = zip(*line)
            (drawn,) = ax.plot(batch, ours, "o-", label=f"{key}={value}")
            ax.plot(batch, base, "x--", color=drawn.get_color(), alpha=0.5)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="batch",
            ylabel="µs per call",
            title=f"{bench} (dashed: baseline)",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
