"""Draw docs/performance.png from the serving table in docs/performance.md.

    python benchmarks/plot_performance.py [--out docs/performance.png]

It measures nothing: the figures below are copied from that table (output
tokens/s, the least and most over the runs each row names; one run gives
one figure). Each bar runs to the least, its lighter top to the most.
Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SERVERS = ("mstar-kv serve", "vLLM CPU", "llama.cpp")
COLORS = ("#1f77b4", "#d62728", "#2ca02c")

# family: (label, {server: ((burst low, high), (serial low, high))});
# docs/performance.md, "Serving speed" (llama.cpp: its 32-slot and 1-slot servers together)
TABLE = {
    "Zen 4": (
        "Zen 4\n12-04/05, 20 runs",
        {
            "mstar-kv serve": ((441.8, 714.6), (111.3, 224.8)),
            "vLLM CPU": ((267.1, 316.1), (29.1, 42.0)),
            "llama.cpp": ((98.6, 187.0), (89.4, 138.7)),
        },
    ),
    "Zen 5": (
        "Zen 5\n12-03, 6 runs",
        {
            "mstar-kv serve": ((748.4, 846.1), (178.5, 204.5)),
            "vLLM CPU": ((464.8, 494.8), (67.4, 68.2)),
            "llama.cpp": ((176.0, 196.3), (117.1, 157.1)),
        },
    ),
    "Zen 1": (
        "Zen 1\n12-03, 1 run",
        {
            "mstar-kv serve": ((144.8, 144.8), (71.3, 71.3)),
            "vLLM CPU": ((56.0, 56.0), (11.0, 11.0)),
            "llama.cpp": ((60.8, 69.1), (56.1, 68.6)),
        },
    ),
    "Zen 3": (
        "Zen 3\n12-02, 1 run",
        {
            "mstar-kv serve": ((180.6, 180.6), (45.0, 45.0)),
            "vLLM CPU": ((83.1, 83.1), (14.8, 14.8)),
            "llama.cpp": ((80.3, 80.3), (82.5, 82.5)),
        },
    ),
    "Xeon AMX": (
        "Xeon, AMX\n12-06, 6 runs",
        {
            "mstar-kv serve": ((510.2, 616.8), (138.7, 222.7)),
            "vLLM CPU": ((341.1, 392.8), (27.9, 28.9)),
            "llama.cpp": ((89.9, 162.6), (83.3, 97.5)),
        },
    ),
}
PANELS = ("32 requests at once", "one request at a time")


def draw(out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.26
    families = list(TABLE)
    for panel, (ax, title) in enumerate(zip(axes, PANELS)):
        for s, (server, color) in enumerate(zip(SERVERS, COLORS)):
            xs = [i + (s - 1) * width for i in range(len(families))]
            lows = [TABLE[f][1][server][panel][0] for f in families]
            highs = [TABLE[f][1][server][panel][1] for f in families]
            ax.bar(xs, lows, width, color=color, label=server)
            ax.bar(xs, [h - lo for lo, h in zip(lows, highs)], width, bottom=lows,
                   color=color, alpha=0.35)  # fmt: skip
        ax.set_xticks(range(len(families)), [TABLE[f][0] for f in families], fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("output tokens/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(frameon=False)
    fig.suptitle(
        "SmolLM2-135M (Q4_1 GGUF) on 2-vCPU VMs (AMD EPYC, Intel Xeon) (2026), 64 tokens a request;"
        " lighter: the range over runs",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=root / "docs" / "performance.png")
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
