"""What the CLI shows: the demo's live progress, its answers and final table,
and the benchmark plot."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from mstar.bench import Row
from mstar.cli.demo import DemoRequest
from mstar.engine import Completion, Engine


@contextmanager
def progress_bar(
    engine: Engine, total: int, disable: bool = False
) -> Iterator[Callable[[Engine, int], None]]:
    """A live bar of steps, with the pool's use; yields the per-step update."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=disable, transient=False) as progress:
        task = progress.add_task("serving", total=total)

        def update(e: Engine, step_index: int) -> None:
            used = e.mgr.num_pages - e.mgr.num_free_pages
            progress.update(
                task,
                completed=e.stats.decode_tokens + e.stats.prefill_tokens,
                total=max(total, e.stats.decode_tokens + e.stats.prefill_tokens),
                description=f"step {step_index:4d}  pages {used:3d}/{e.mgr.num_pages}",
            )

        yield update


@contextmanager
def check_bar(total: int, disable: bool = False) -> Iterator[Callable[[], None]]:
    """A live bar of the outputs ``demo --check`` has recomputed; yields the per-output update."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("checking"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=disable, transient=False) as progress:
        task = progress.add_task("checking", total=total)
        yield lambda: progress.advance(task)


def print_answers(workload: list[DemoRequest], done: dict[str, Completion]) -> None:
    """Each request's question (when it has one) and its decoded samples."""
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    for r in workload:
        kind = " (guided)" if r.uncond is not None else ""
        if r.params.n > 1:
            kind = f" (n={r.params.n}, temperature {r.params.temperature})"
        console.print(f"[bold]{r.id}[/bold]{kind}: {escape(r.question or '')}")
        for out in done[r.id].outputs:
            body = out.text if out.text is not None else " ".join(map(str, out.token_ids))
            mark = f"  [{out.index}] " if r.params.n > 1 else "  "
            console.print(f"{mark}{escape(body.strip())}  [dim]({out.finish_reason})[/dim]")


def demo_report(engine: Engine, workload: list[DemoRequest], done: dict[str, Completion]) -> None:
    """The final table: workload, step mix, plan latency and share, pages."""
    from rich.console import Console
    from rich.table import Table

    stats = engine.stats
    forked = sum(r.params.n > 1 for r in workload)
    guided = sum(r.uncond is not None for r in workload)
    generated = sum(len(o.token_ids) for c in done.values() for o in c.outputs)
    p50, p99 = np.percentile(stats.plan_us, [50, 99]) if stats.plan_us else (0.0, 0.0)
    share = stats.plan_s / stats.step_s if stats.step_s else 0.0
    table = Table(title="mstar-kv demo", show_header=False)
    rows = [
        ("requests", f"{len(workload)} ({forked} with n > 1, {guided} guided)"),
        ("tokens", f"{stats.prefill_tokens + stats.decode_tokens} fed, {generated} generated"),
        ("steps", f"{stats.steps} ({stats.decode_steps} decode-only, {stats.mixed_steps} mixed)"),
        ("prefill / decode tokens", f"{stats.prefill_tokens} / {stats.decode_tokens}"),
        ("plan latency per step", f"p50 {p50:.0f} µs, p99 {p99:.0f} µs"),
        ("plan layer share of step", f"{100 * share:.1f}% of {stats.step_s:.1f} s"),
        ("generated tokens/s", f"{generated / stats.step_s:.1f}" if stats.step_s else "-"),
        ("peak pages used", f"{stats.peak_pages} of {engine.mgr.num_pages}"),
        ("pages saved by sharing", f"{stats.peak_shared} (peak)"),
        ("prefix cache", _prefix_hits(engine)),
        ("sliding windows", windows_note(engine)),
        ("refused admissions", str(stats.refused)),
        ("preemptions", str(stats.preemptions)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def windows_note(engine: Engine) -> str:
    """Whether the engine releases the pages behind the model's windows."""
    from mstar.engine.resources.groups import KVGroups
    from mstar.models.hf import kv_spec

    mgr = engine.mgr
    if isinstance(mgr, KVGroups):
        groups = zip(mgr.windows, mgr.layers)
        return (
            "KV groups: "
            + "; ".join(
                f"{f'window {w}' if w else 'full'} on layers {', '.join(map(str, layers))}"
                for w, layers in groups
            )
            + ", the windowed ones release the pages behind their window to the groups'"
            + f" one pool of {mgr.num_pages} pages of {mgr.size} layers"
        )
    if mgr.window is not None:
        return f"window {mgr.window}: pages behind it released"
    if any(w for w, _ in kv_spec(engine.model).groups):
        if engine.prefix_cache:
            return "every page kept (the prefix cache is on: no release)"
        return "every page kept (tensor parallelism: one cache over every layer)"
    return "none"


def _prefix_hits(engine: Engine) -> str:
    if not engine.prefix_cache:
        return "off"
    stats = engine.mgr.prefix_stats()
    asked, hit = stats["tokens_queried"], stats["tokens_hit"]
    rate = f"{100 * hit / asked:.0f}%" if asked else "-"
    return f"{hit} of {asked} prompt tokens from cache ({rate}), {stats['pages_evicted']} pages evicted"


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
