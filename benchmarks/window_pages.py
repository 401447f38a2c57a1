"""Pages a long generation holds on sliding-window and hybrid models, with
and without releasing the pages behind the window (issue 19); the same
table as ``mstar-kv bench --window``.

    python benchmarks/window_pages.py [--prompt 512] [--new 4096] [--window 512]
"""

from __future__ import annotations

import argparse

from mstar.bench.window import format_window, run_window


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    print(format_window(run_window(args.prompt, args.new, args.window)))


if __name__ == "__main__":
    main()
