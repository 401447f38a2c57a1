"""Pages a long generation holds on sliding-window models, with and without
releasing the pages behind the window (issue 19): ``mstar-kv bench --window``.

One stream through the plan layer (no model: pages are what is measured):
the prompt in 256-token chunks, then one decode step per new token. A
window-only model (Mistral-like: every layer windowed) goes through one
``KVManager``; hybrids (Gemma 2-like, 1 windowed layer per full one; Gemma
3-like, 5 per full one) through ``KVGroups``, a manager per group of layers
on one shared pool. The baseline, in the same run, keeps every page (one
manager, as with the prefix cache on). KV memory counts a page once per
layer it covers.

Capacity: how many such requests, stepped together, run to the end at once
in the memory of ``MEMORY_PAGES`` pages over every layer (``fitting``:
measured, from the one stream's peaks as a first guess): keeping every page;
with per-group pools (each window's layers with a pool of its own of
``MEMORY_PAGES`` pages, the layout before the shared pool: the fullest group
bounds it); and with the groups' one shared pool of ``MEMORY_PAGES x layers /
k`` pages of ``k`` layers (the sum of the groups' peaks bounds it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from mstar.engine.intake import Intake
from mstar.engine.resources.groups import KVGroups
from mstar.engine.resources.kv.errors import AllocationFailed
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.step import KVStep, Segment
from mstar.engine.sampling.params import SamplingParams

PAGE = 16
CHUNK = 256
# name: (windowed layers, full layers)
MODELS = {"Mistral-like": (1, 0), "Gemma 2-like (1:1)": (1, 1), "Gemma 3-like (5:1)": (5, 1)}
MEMORY_PAGES = 4096  # the pool the capacity columns share: 64k tokens on every layer
KEEP_ALL = ((None, (0,)),)  # one manager keeping every page


def spans(prompt: int, new: int) -> list[int]:
    """Each step's tokens: the prompt in chunks, then one per decode step."""
    return [min(CHUNK, prompt - i) for i in range(0, prompt, CHUNK)] + [1] * (new - 1)


def held(prompt: int, new: int, groups: tuple) -> tuple[list[tuple[int, int]], KVGroups]:
    """(peak, final) pages the stream holds in each group of ``KVGroups``
    over ``groups``, and the groups."""
    layers = sum(len(g) for _, g in groups)  # groups of 1 layer at most
    mgr = KVGroups(groups, layers * (-(-(prompt + new) // PAGE) + 1), PAGE)
    peaks = [0] * len(mgr.managers)
    for span in spans(prompt, new):
        step = KVStep((Segment("r", "main", span),))
        mgr.admit(step)
        mgr.plan(step)
        peaks = [max(p, h) for p, h in zip(peaks, mgr.held_pages("r", "main"))]
        mgr.commit(step)
    return list(zip(peaks, mgr.held_pages("r", "main"))), mgr


def fits(managers: list[KVManager | KVGroups], count: int, steps: list[int]) -> bool:
    """Whether ``count`` streams, stepped together (``steps``: each step's
    tokens) through every one of ``managers``, run to the end."""
    for span in steps:
        step = KVStep(tuple(Segment(f"r{i}", "main", span) for i in range(count)))
        try:
            for mgr in managers:
                mgr.admit(step)
        except AllocationFailed:
            return False
        for mgr in managers:
            mgr.commit(step)
    return True


def per_group_pools(groups: tuple) -> list[KVManager]:
    """A manager per window, each with a pool of its own of ``MEMORY_PAGES``
    pages over its layers."""
    return [KVManager(MEMORY_PAGES, PAGE, window=window) for window, _ in groups]


def shared_pool(groups: tuple) -> list[KVGroups]:
    """``KVGroups`` on one pool of the memory of ``MEMORY_PAGES`` pages over
    every layer."""
    layers, k = sum(len(g) for _, g in groups), min(len(g) for _, g in groups)
    return [KVGroups(groups, MEMORY_PAGES * layers // k, PAGE)]


def fitting(layout: Callable[[], list], guess: int, steps: list[int]) -> int:
    """The most streams that run to the end together on a fresh ``layout()``,
    searched from ``guess``."""
    count = guess
    while count > 0 and not fits(layout(), count, steps):
        count -= 1
    while fits(layout(), count + 1, steps):
        count += 1
    return count


def run_window(prompt: int = 512, new: int = 4096, window: int = 512) -> list[dict]:
    """A row per model: pages held kept-all and released, per group, the KV
    memory at the peak (page-layers), the engine's admission bound (page-layers), and how
    many requests fit at once in ``MEMORY_PAGES`` pages over every layer."""
    keep_peak, keep_end = held(prompt, new, KEEP_ALL)[0][0]
    params = SamplingParams(max_new_tokens=new)
    steps = spans(prompt, new)
    keep_all = fitting(partial(per_group_pools, KEEP_ALL), MEMORY_PAGES // keep_peak, steps)
    rows = []
    for name, (windowed, full) in MODELS.items():
        groups = ((window, tuple(range(windowed))),)
        if full:
            groups += ((None, tuple(range(windowed, windowed + full))),)
        pages, mgr = held(prompt, new, groups)
        layers, peaks = windowed + full, [peak for peak, _ in pages]
        by_window = {w: max(p for p, g in zip(peaks, mgr.windows) if g == w) for w in mgr.windows}
        memory = sum(peak * len(g) for peak, g in zip(peaks, mgr.layers))
        rows.append(
            {
                "model": name,
                "prompt": prompt,
                "new": new,
                "window": window,
                "groups": len(mgr.managers),
                "keep_all_peak": keep_peak,
                "keep_all_end": keep_end,
                "windowed_peak": pages[0][0],
                "windowed_end": pages[0][1],
                "full_peak": by_window[None] if full else None,
                "memory_keep_all": keep_peak * layers,
                "memory_released": memory,
                "admission_keep_all": _intake((None,)).peak_pages(prompt, params) * layers,
                "admission": _intake(mgr.windows).peak_pages(prompt, params) * mgr.size,
                "fit_keep_all": keep_all,
                "fit_per_group": fitting(
                    partial(per_group_pools, groups),
                    MEMORY_PAGES // max(by_window.values()),
                    steps,
                ),
                "fit_shared": fitting(
                    partial(shared_pool, groups),
                    MEMORY_PAGES * layers // mgr.size // sum(peaks),
                    steps,
                ),
            }
        )
    return rows


def _intake(windows: tuple[int | None, ...]) -> Intake:
    """The engine's admission over managers of ``windows`` on one pool."""
    return Intake(None, 1, None, PAGE, 1 << 20, torch.device("cpu"), windows, CHUNK)


def format_window(rows: list[dict]) -> str:
    first = rows[0]
    lines = [
        f"one stream: {first['prompt']}-token prompt + {first['new']} new tokens,"
        f" window {first['window']}, pages of {PAGE}; requests fitting at once in the memory"
        f" of {MEMORY_PAGES} pages on every layer",
        "| model | KV groups | keep-all peak / end | windowed group peak / end | full group peak"
        " | KV memory at peak, page-layers (released / keep-all) | admission bound,"
        " page-layers (keep-all) | requests fitting: keep-all / per-group pools / shared pool |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        full = "-" if r["full_peak"] is None else str(r["full_peak"])
        ratio = r["memory_released"] / r["memory_keep_all"]
        lines.append(
            f"| {r['model']} | {r['groups']} | {r['keep_all_peak']} / {r['keep_all_end']}"
            f" | {r['windowed_peak']} / {r['windowed_end']} | {full}"
            f" | {r['memory_released']} / {r['memory_keep_all']} ({ratio:.2f}x)"
            f" | {r['admission']} ({r['admission_keep_all']})"
            f" | {r['fit_keep_all']} / {r['fit_per_group']} / {r['fit_shared']} |"
        )
    return "\n".join(lines)
