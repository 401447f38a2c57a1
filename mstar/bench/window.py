"""Pages a long generation holds on sliding-window models, with and without
releasing the pages behind the window (issue 19): ``mstar-kv bench --window``.

One stream through the plan layer (no model: pages are what is measured):
the prompt in 256-token chunks, then one decode step per new token. A
window-only model (Mistral-like: every layer windowed) goes through one
``KVManager``; hybrids (Gemma 2-like, 1 windowed layer per full one; Gemma
3-like, 5 per full one) through ``KVGroups``, one manager per group. The
baseline, in the same run, keeps every page (one manager, as with the prefix
cache on). KV memory counts a page once per layer it covers.
"""

from __future__ import annotations

import torch

from mstar.engine.intake import Intake
from mstar.engine.resources.groups import KVGroups
from mstar.engine.resources.step import KVStep, Segment
from mstar.engine.sampling import SamplingParams

PAGE = 16
CHUNK = 256
# name: (windowed layers, full layers)
MODELS = {"Mistral-like": (1, 0), "Gemma 2-like (1:1)": (1, 1), "Gemma 3-like (5:1)": (5, 1)}


def held(prompt: int, new: int, groups: tuple) -> list[tuple[int, int]]:
    """(peak, final) pages the stream holds in each group."""
    mgr = KVGroups(groups, -(-(prompt + new) // PAGE) + 1, PAGE)
    spans = [min(CHUNK, prompt - i) for i in range(0, prompt, CHUNK)] + [1] * (new - 1)
    peaks = [0] * len(groups)
    for span in spans:
        step = KVStep((Segment("r", "main", span),))
        mgr.admit(step)
        mgr.plan(step)
        peaks = [max(p, h) for p, h in zip(peaks, mgr.held_pages("r", "main"))]
        mgr.commit(step)
    return list(zip(peaks, mgr.held_pages("r", "main")))


def run_window(prompt: int = 512, new: int = 4096, window: int = 512) -> list[dict]:
    """A row per model: pages held kept-all and released, per group, the KV
    memory at the peak (page-layers) and the engine's admission bound."""
    keep_peak, keep_end = held(prompt, new, ((None, (0,)),))[0]
    params = SamplingParams(max_new_tokens=new)
    rows = []
    for name, (windowed, full) in MODELS.items():
        groups = ((window, tuple(range(windowed))),)
        if full:
            groups += ((None, tuple(range(windowed, windowed + full))),)
        pages = held(prompt, new, groups)
        layers = windowed + full
        memory = sum(peak * len(g[1]) for (peak, _), g in zip(pages, groups))
        rows.append(
            {
                "model": name,
                "prompt": prompt,
                "new": new,
                "window": window,
                "keep_all_peak": keep_peak,
                "keep_all_end": keep_end,
                "windowed_peak": pages[0][0],
                "windowed_end": pages[0][1],
                "full_peak": pages[1][0] if full else None,
                "memory_keep_all": keep_peak * layers,
                "memory_released": memory,
                "admission_keep_all": _intake(None).peak_pages(prompt, params),
                "admission": _intake(None if full else window).peak_pages(prompt, params),
            }
        )
    return rows


def _intake(window: int | None) -> Intake:
    """The engine's admission: with a full group (``window`` None) it
    counts every page."""
    return Intake(None, 1, None, PAGE, 1 << 20, torch.device("cpu"), window, CHUNK)


def format_window(rows: list[dict]) -> str:
    first = rows[0]
    lines = [
        f"one stream: {first['prompt']}-token prompt + {first['new']} new tokens,"
        f" window {first['window']}, pages of {PAGE}",
        "| model | keep-all peak / end | windowed group peak / end | full group peak"
        " | KV memory at peak, page-layers (released / keep-all) | admission bound (keep-all) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        full = "-" if r["full_peak"] is None else str(r["full_peak"])
        ratio = r["memory_released"] / r["memory_keep_all"]
        lines.append(
            f"| {r['model']} | {r['keep_all_peak']} / {r['keep_all_end']}"
            f" | {r['windowed_peak']} / {r['windowed_end']} | {full}"
            f" | {r['memory_released']} / {r['memory_keep_all']} ({ratio:.2f}x)"
            f" | {r['admission']} ({r['admission_keep_all']}) |"
        )
    return "\n".join(lines)
