"""Pages a long generation holds on a sliding-window model, with and without
releasing the pages behind the window (issue 19).

    python benchmarks/window_pages.py [--prompt 512] [--new 4096] [--window 512]

One stream through ``KVManager`` (no model: pages are what is measured): the
prompt in 256-token chunks, then one decode step per new token. Prints the
peak pages held by the stream, the pages it holds at the end, and the
engine's admission bound (``Intake.peak_pages``) for the same request.
"""

from __future__ import annotations

import argparse

import torch

from mstar.engine.intake import Intake
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.step import KVStep, Segment
from mstar.engine.sampling import SamplingParams

PAGE = 16
CHUNK = 256


def run(prompt: int, new: int, window: int | None) -> tuple[int, int]:
    """(peak, final) pages the stream holds."""
    mgr = KVManager(-(-(prompt + new) // PAGE) + 1, PAGE, window=window)
    spans = [min(CHUNK, prompt - i) for i in range(0, prompt, CHUNK)] + [1] * (new - 1)
    peak = 0
    for span in spans:
        step = KVStep((Segment("r", "main", span),))
        mgr.admit(step)
        mgr.plan(step)
        peak = max(peak, mgr.held_pages("r", "main"))
        mgr.commit(step)
    return peak, mgr.held_pages("r", "main")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.new)
    print(f"prompt {args.prompt}, {args.new} new tokens, window {args.window}, pages of {PAGE}")
    print("| KVManager | peak pages | pages at the end | Engine admission bound |")
    print("|---|---:|---:|---:|")
    for name, window in (("keeps every page", None), (f"window={args.window}", args.window)):
        peak, final = run(args.prompt, args.new, window)
        intake = Intake(None, 1, None, PAGE, 1 << 20, torch.device("cpu"), window, CHUNK)
        print(f"| {name} | {peak} | {final} | {intake.peak_pages(args.prompt, params)} |")


if __name__ == "__main__":
    main()
