"""``mstar-kv demo | bench``: the plan layer serving a model, and its speed."""

from __future__ import annotations

import argparse
import json
import sys

USAGE_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar-kv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="continuous batching on a seeded random Llama")
    demo.add_argument("--requests", type=int, default=16, help="number of requests (default 16)")
    demo.add_argument("--page-size", type=int, default=8, help="tokens per KV page (default 8)")
    demo.add_argument("--pages", type=int, default=20, help="KV pages in the pool (default 20)")
    demo.add_argument("--budget", type=int, default=32, help="tokens per step (default 32)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu", help="cpu, or cuda (FlashInfer when installed)")
    demo.add_argument(
        "--check", action="store_true", help="recompute every request with the model alone"
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    bench = sub.add_parser("bench", help="plan and manager benchmarks against their baselines")
    bench.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    bench.add_argument("--plot", metavar="PATH.png", help="plot plan latency (needs matplotlib)")
    bench.add_argument("--quick", action="store_true", help="fewer configurations")
    args = parser.parse_args(argv)
    try:
        return run_demo(args) if args.command == "demo" else run_bench(args)
    except UsageError as err:
        print(f"mstar-kv {args.command}: error: {err}", file=sys.stderr)
        return USAGE_ERROR


class UsageError(Exception):
    """An impossible option: reported in one line, exit code 2."""


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from mstar.demo import Server, build_model, check, make_workload, peak_pages, serve
    from mstar.report import demo_report, progress_bar

    for name in ("requests", "page_size", "pages", "budget"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available")
    reference, model = build_model(args.seed, args.device)
    requests = make_workload(args.requests, model.config.vocab_size, args.seed)
    biggest = max(requests, key=lambda r: peak_pages(r, args.page_size))
    need = peak_pages(biggest, args.page_size)
    if args.pages < need:
        raise UsageError(
            f"--pages {args.pages} is too small: {biggest.id} alone needs {need} pages"
        )
    flashinfer = None
    if args.device.startswith("cuda"):
        try:
            from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention

            flashinfer = FlashInferPagedAttention(device=args.device)
        except RuntimeError:
            flashinfer = None  # no flashinfer installed: the PyTorch paged attention
    server = Server(
        model,
        requests,
        num_pages=args.pages,
        page_size=args.page_size,
        token_budget=args.budget,
        flashinfer=flashinfer,
    )
    with progress_bar(server, disable=args.quiet) as update:
        stats = serve(server, update)
    demo_report(server, stats)
    if not args.check:
        return 0
    results = check(reference, requests)
    failed = [what for what, ok in results if not ok]
    for what in failed:
        print(f"MISMATCH {what}")
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def run_bench(args: argparse.Namespace) -> int:
    from mstar.bench import format_table
    from mstar.bench import manager as bench_manager
    from mstar.bench import plan as bench_plan

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise UsageError("--plot needs matplotlib: pip install 'mstar-kv[plot]'") from err
    if args.quick:
        rows = bench_plan.run(batches=(1, 32), pages=(10,)) + bench_manager.run(
            batches=(1, 32), contexts=(1024,)
        )
    else:
        rows = bench_plan.run() + bench_manager.run()
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=2)
    if args.plot:
        from mstar.report import plot_latency

        plot_latency(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
