"""``mstar-kv demo | generate | bench | serve``: the engine serving a model through the
plan layer, and its speed."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any

from mstar.cli import serve as serve_cli
from mstar.serve.options import (
    UsageError,
    add_speculative_options,
    add_speed_options,
    add_tensor_parallel_option,
    check_model_exists,
    checked_device,
    compile_now,
    float32_unless_checked,
    load_model,
    make_engine,
    mode_line,
    resolved_dtype,
    say,
    speculative_options,
)

USAGE_ERROR = 2
DESCRIPTION = (
    "mstar-kv: a paged-attention LLM inference engine. Commands: demo (continuous batching"
    " on SmolLM2), generate (one prompt, streamed), bench (benchmarks), serve (an"
    " OpenAI-compatible server). Each has its own --help."
)
# (page size, pages, token budget, requests) when not given: the real model's
# pool is small enough to force preemption; the random model's as well
DEMO_DEFAULTS = {"random": (8, 20, 32, 16), "real": (16, 24, 128, 8), "window": (4, 48, 32, 4)}


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported in one line (exit code 2)."""

    def error(self, message: str) -> Any:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="mstar-kv", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="continuous batching of chat prompts on SmolLM2")
    demo.add_argument(
        "--model", default="smollm2", help="smollm2 (default), random (a seeded tiny Llama), "
        "a GGUF file or a model folder",
    )  # fmt: skip
    demo.add_argument("--requests", type=int, help="number of requests (8; random: 16)")
    demo.add_argument("--max-new-tokens", type=int, help="per request (32; --window: 128)")
    demo.add_argument("--page-size", type=int, help="tokens per KV page (16; random: 8)")
    demo.add_argument("--pages", type=int, help="KV pages in the pool (24; random: 20)")
    demo.add_argument("--budget", type=int, help="tokens per step (128; random: 32)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu", help="cpu, or cuda (FlashInfer when installed)")
    demo.add_argument("--check", action="store_true", help="recompute every output with the model")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument("--no-prefix-cache", action="store_true", help="no KV reuse across requests")
    demo.add_argument(
        "--window", choices=("mistral", "gemma2"), help="a tiny seeded sliding-window model,"
        " served keeping every page and releasing those behind the window",
    )  # fmt: skip
    add_tensor_parallel_option(demo)
    add_speculative_options(demo)
    gen = sub.add_parser("generate", help="answer one prompt, streaming the text")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2", help="smollm2 (default), a GGUF file or folder")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat", action="store_true", help="the prompt as a user message (the default when the"
        " model has a chat template)",
    )  # fmt: skip
    mode.add_argument("--raw", action="store_true", help="plain completion of the prompt as is")
    gen.add_argument("--system", help="a system message before the prompt (chat)")
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("-n", type=int, default=1, help="samples (default 1)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    gen.add_argument("--device", default="cpu")
    add_tensor_parallel_option(gen)
    add_speculative_options(gen)
    bench = sub.add_parser("bench", help="plan and manager benchmarks, or --e2e on SmolLM2")
    bench.add_argument("--e2e", action="store_true", help="Engine vs HF generate on chat prompts")
    bench.add_argument(
        "--tp", action="store_true", help="tensor parallelism's per-step broadcast, TP=2 vs TP=1"
    )
    bench.add_argument(
        "--workload",
        choices=("chat", "mixed", "shared-prefix"),
        default="chat",
        help="with --e2e: 16 equal chat prompts (default), or mixed serving traffic; with"
        " --serve: shared-prefix, system prompts shared by many questions on --replicas",
    )
    bench.add_argument(
        "--prompts", type=int, metavar="N", help="with --workload mixed: its first N requests"
    )
    bench.add_argument(
        "--arrivals",
        choices=("both", "at-once", "staggered"),
        default="both",
        help="with --workload mixed: both arrival patterns (default) or one",
    )
    bench.add_argument(
        "--window", action="store_true", help="pages a long generation holds on windowed and"
        " hybrid models, with and without release",
    )  # fmt: skip
    bench.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    bench.add_argument("--plot", metavar="PATH.png", help="plot plan latency (needs matplotlib)")
    bench.add_argument("--quick", action="store_true", help="fewer configurations")
    bench.add_argument(
        "--roofline", action="store_true", help="decode steps at batch 1-128 against the"
        " machine's floor, float32 and bfloat16, eager and compiled",
    )  # fmt: skip
    add_speed_options(bench, dtype=None)
    serve_cli.add_bench_options(bench)
    add_speculative_options(bench, "with no other mode: n-gram drafts against none on SmolLM2")
    serve_cli.add_parser(sub)
    args = parser.parse_args(argv)
    commands = {"demo": run_demo, "generate": run_generate, "bench": run_bench}
    commands["serve"] = serve_cli.run
    try:
        return commands[args.command](args)
    except UsageError as err:
        print(f"mstar-kv {args.command}: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"mstar-kv {args.command}: interrupted", file=sys.stderr)
        return 130


def run_demo(args: argparse.Namespace) -> int:
    from mstar.cli.demo import chat_workload, check, random_workload, serve
    from mstar.cli.report import check_bar, demo_report, print_answers, progress_bar
    from mstar.models.seeded import build_model

    kind = "window" if args.window else "random" if args.model == "random" else "real"
    defaults = (*DEMO_DEFAULTS[kind], 128 if args.window else 32)
    names = ("page_size", "pages", "budget", "requests", "max_new_tokens")
    for name, default in zip(names, defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in names:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.window:
        from mstar.cli.demo_window import run_window_demo

        if args.model != "smollm2":
            raise UsageError(f"--window builds its own model: not with --model {args.model}")
        if args.tensor_parallel_size != 1:
            raise UsageError("--window serves one process: not with --tensor-parallel-size")

        return run_window_demo(
            args.window, requests=args.requests, max_new_tokens=args.max_new_tokens,
            pages=args.pages, page_size=args.page_size, budget=args.budget, seed=args.seed,
            device=checked_device(args.device), verify=args.check,
        )  # fmt: skip
    # --check is exact against HF in float32: auto keeps the float weights
    quantization = "none" if args.check and args.quantization == "auto" else args.quantization
    choice = resolved_dtype(args.dtype, args.device, args.check, args.model, quantization)
    dtype = choice.dtype
    if args.model == "random":
        reference, model = build_model(args.seed, checked_device(args.device))
        reference, model = reference.to(dtype), model.to(dtype)
        tokenizer = None
        workload = random_workload(model.config.vocab_size, args.requests, args.seed)
    else:
        model, tokenizer = load_model(
            args.model, args.device, dtype=dtype, quantization=quantization
        )
        reference = copy.deepcopy(model) if args.check else None
        workload = chat_workload(tokenizer, args.requests, args.max_new_tokens, args.seed)
    engine = make_engine(
        model, tokenizer, args.device,
        num_pages=args.pages, page_size=args.page_size, token_budget=args.budget,
        prefix_cache=False if args.no_prefix_cache else None, tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype, **speculative_options(args),
        enforce_eager=args.enforce_eager,
    )  # fmt: skip
    need = {
        r.id: engine.peak_pages(
            len(r.prompt), r.params, None if r.uncond is None else len(r.uncond)
        )
        for r in workload
    }
    biggest = max(need, key=need.__getitem__)
    if need[biggest] > args.pages:
        raise UsageError(
            f"--pages {args.pages} is too small: {biggest} alone needs {need[biggest]} pages"
        )
    total = sum(len(r.prompt) + r.params.max_new_tokens * r.params.n for r in workload)
    say(mode_line(choice, engine))
    with progress_bar(engine, total, disable=args.quiet) as update:
        done = serve(engine, workload, update)
    print_answers(workload, done)
    demo_report(engine, workload, done)
    if not args.check:
        return 0
    outputs = sum(len(done[r.id].outputs) for r in workload)
    with check_bar(outputs, disable=args.quiet) as advance:
        results = check(reference, workload, done, engine.eos_token_ids, advance)
    failed = [what for what, ok in results if not ok]
    for what in failed:
        print(f"MISMATCH {what}")
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def run_generate(args: argparse.Namespace) -> int:
    from mstar.engine import SamplingParams

    texts = {"the prompt": args.prompt, "--system": args.system or ""}
    texts.update((f"--stop {s!r}", s) for s in args.stop)
    for what, text in texts.items():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise UsageError(f"{what} is not valid UTF-8 text") from err
    if not args.prompt:
        raise UsageError("expected a non-empty prompt, got ''")
    if args.raw and args.system:
        raise UsageError("--system is a chat message: not with --raw")
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            n=args.n,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as err:
        raise UsageError(str(err)) from err
    size = args.tensor_parallel_size
    check_model_exists(args.model)

    # eager: the request is checked before any compile
    def build(dtype: Any, quantization: str, kv_cache_dtype: str | None) -> Any:
        model, tokenizer = load_model(args.model, args.device, size, dtype, quantization)
        return make_engine(
            model, tokenizer, args.device, page_size=16, tensor_parallel_size=size,
            kv_cache_dtype=kv_cache_dtype or args.kv_cache_dtype, **speculative_options(args),
        )  # fmt: skip

    choice = resolved_dtype(
        args.dtype, args.device, model=args.model, quantization=args.quantization
    )
    engine, choice = float32_unless_checked(build, choice, args.quantization, args.model)
    chat = not args.raw and engine.tokenizer.chat_template is not None
    if (args.chat or args.system) and not chat:
        raise UsageError(f"--model {args.model} has no chat template: use --raw")
    system = [{"role": "system", "content": args.system}] if args.system else []
    try:
        prompt = (
            engine.encode_chat([*system, {"role": "user", "content": args.prompt}])
            if chat
            else args.prompt
        )
        engine.intake.request("generate", prompt, params)  # checked, not queued
    except ValueError as err:
        raise UsageError(str(err)) from err
    if not args.enforce_eager and not engine.fused:  # the fused forward beats compiled HF
        compile_now(engine)
    completions = engine.stream(prompt, params)
    say(mode_line(choice, engine))
    start, last = time.perf_counter(), None
    for last in completions:
        if params.n == 1:  # the one sample's text as it grows
            print(last.outputs[0].delta, end="", flush=True)
    seconds = time.perf_counter() - start
    assert last is not None and last.finished, "a stream ends with its completion finished"
    if params.n == 1:
        print(flush=True)
    else:
        for out in last.outputs:
            print(f"[{out.index}] {out.text}", flush=True)
    tokens = sum(len(o.token_ids) for o in last.outputs)
    reasons = ", ".join(dict.fromkeys(o.finish_reason for o in last.outputs))
    print(f"({reasons}: {tokens} tokens, {tokens / seconds:.1f} tokens/s)", file=sys.stderr)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    if args.serve:
        return serve_cli.run_bench(args)
    if args.startup:
        from mstar.bench.startup import run_startup

        return run_startup(args)
    if args.window:
        from mstar.bench.window import format_window, run_window

        rows = run_window(new=1024 if args.quick else 4096)
        print(format_window(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    if args.tp:
        return run_bench_tp(args)
    if args.roofline:
        return run_bench_roofline(args)
    if args.speculative and not args.e2e:
        from mstar.bench.speculative import format_speculative, run_speculative

        result = run_speculative(k=args.num_speculative_tokens, quick=args.quick)
        print(format_speculative(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    if args.e2e:
        from rich.console import Console

        if args.workload == "shared-prefix":
            raise UsageError("--workload shared-prefix goes with --serve")

        from mstar.bench.e2e import format_e2e, run_e2e
        from mstar.bench.serving import format_mixed, run_mixed

        run, show = (run_mixed, format_mixed) if args.workload == "mixed" else (run_e2e, format_e2e)
        options = {}
        if args.workload == "mixed":
            if args.prompts is not None and args.prompts < 2:
                raise UsageError(f"--prompts {args.prompts}: expected at least 2")
            options = {"prompts": args.prompts, "arrivals": args.arrivals.replace("-", " ")}
        elif args.prompts is not None or args.arrivals != "both":
            raise UsageError("--prompts and --arrivals go with --workload mixed")
        with Console(stderr=True).status("starting") as status:
            result = run(quick=args.quick, stage=status.update, **options)
        print(show(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        tables = result["patterns"].values() if "patterns" in result else [result["rows"]]
        return 0 if all(r["exact"] == r["prompts"] for rows in tables for r in rows) else 1

    from mstar.bench import attention as bench_attention
    from mstar.bench import format_table
    from mstar.bench import manager as bench_manager
    from mstar.bench import plan as bench_plan
    from mstar.bench import prefix as bench_prefix

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
        rows = bench_plan.run() + bench_prefix.run() + bench_manager.run() + bench_attention.run()
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=2)
    if args.plot:
        from mstar.cli.report import plot_latency

        plot_latency(rows, args.plot)
    return 0


def run_bench_roofline(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mstar.bench.roofline import format_roofline, run_roofline

    dtypes = (resolved_dtype(args.dtype, "cpu").dtype,) if args.dtype else None
    options: dict = {"dtypes": dtypes} if dtypes else {}
    if args.quantization != "none":  # float32 beside the quantized weights
        options["quantizations"] = ("none", args.quantization)
    with Console(stderr=True).status("starting") as status:
        result = run_roofline(
            batches=(1, 32) if args.quick else (1, 8, 32, 128),
            modes=(False,) if args.enforce_eager else (False, True),
            stage=status.update,
            **options,
        )
    Console(width=130).print(format_roofline(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def run_bench_tp(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mstar.bench.tp import format_tp, run

    with Console(stderr=True).status("starting") as status:
        rows = run(batches=(1, 32) if args.quick else (1, 8, 32, 128), stage=status.update)
    print(format_tp(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
