"""``mstar-kv serve`` and ``mstar-kv bench --serve``: their options and runs.
Imports nothing heavy until a command runs."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

DEFAULT_MAX_WAITING = 256


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, unless it is None or False or
    the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default is None or action.default is False or "default" in help_text.lower():
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers: Any) -> None:
    """Register ``serve`` on ``mstar-kv``'s subparsers."""
    from mstar.serve.options import (
        add_speculative_options,
        add_tensor_parallel_option,
        memory_size,
    )

    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible server over the engine",
        description="An OpenAI-compatible server over the engine (docs/serving.md).",
        formatter_class=DefaultsShown,
    )  # fmt: skip
    p.add_argument(
        "--model", default="smollm2",
        help="smollm2 (default), random (a seeded tiny Llama, token ids only), a GGUF file or a folder",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: any)")
    p.add_argument("--port", type=int, default=8000, help="the port to bind")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--pages", type=int, help="KV pages in the pool (default: a memory share)")
    pool.add_argument(
        "--kv-cache-memory", type=memory_size, metavar="SIZE",
        help="memory for the KV pool, e.g. 4GiB (default: a quarter of the free memory, at most"
        " 1 GiB on the CPU)",
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    # 512, not the Python API's 256: 32 chats at once got their first token ~20% sooner
    # (p50) at the same tokens/s (docs/performance.md)
    p.add_argument("--budget", type=int, default=512, help="tokens per step (default 512)")
    p.add_argument(
        "--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
        help=f"requests without a first token before 503 (default {DEFAULT_MAX_WAITING})",
    )  # fmt: skip
    p.add_argument("--no-prefix-cache", action="store_true", help="no KV reuse across requests")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (FlashInfer when installed)")
    p.add_argument("--seed", type=int, default=0, help="the random model's seed")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to finish at shutdown")
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model's)")
    p.add_argument(
        "--verbose", action="store_true",
        help="the start-up line in full (the dtype's and quantization's reasons)",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", default="auto",
        choices=("auto", "hermes", "llama3_json", "mistral", "pythonic"),
        help="how chat tool calls are written and read (default auto: the chat template's)",
    )  # fmt: skip
    add_tensor_parallel_option(p)
    add_speculative_options(p)
    add_network_options(p)
    add_replica_options(p)
    from mstar.serve.kv_tiers import add_tier_options

    add_tier_options(p)


def add_network_options(p: argparse.ArgumentParser) -> None:
    """``serve``'s options for a server on a network: keys, TLS, CORS, limits."""
    from mstar.serve.access import DEFAULT_MAX_BODY_BYTES, KEY_ENV

    g = p.add_argument_group("on a network (docs/serving.md)")
    g.add_argument(
        "--api-key", action="append", metavar="KEY",
        help="every /v1 route asks for 'Authorization: Bearer KEY' (repeatable; also"
        f" ${KEY_ENV}, comma-separated); each key's cached KV is its own",
    )  # fmt: skip
    g.add_argument("--protect-metrics", action="store_true", help="/metrics asks for a key too")
    g.add_argument(
        "--shared-prefix-cache", action="store_true",
        help="requests of different keys reuse each other's cached KV",
    )  # fmt: skip
    g.add_argument("--ssl-keyfile", help="serve HTTPS: the private key (PEM)")
    g.add_argument("--ssl-certfile", help="serve HTTPS: the certificate chain (PEM)")
    g.add_argument(
        "--allowed-origins", action="append", metavar="ORIGIN",
        help="browser origins answered with CORS headers (repeatable or comma-separated;"
        " * for any; default none)",
    )  # fmt: skip
    g.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
        help="a larger request body gets 413",
    )  # fmt: skip
    g.add_argument(
        "--max-model-len", type=int,
        help="the most tokens (prompt and completion) a request may span (default: the model's)",
    )  # fmt: skip


def access_of(args: argparse.Namespace) -> Any:
    """The ``Access`` of ``serve``'s options (``$MSTAR_KV_API_KEY`` read now);
    ``UsageError`` for a bad one. Sets ``args.api_key`` to the keys found."""
    from mstar.serve.access import Access, api_keys
    from mstar.serve.options import UsageError

    try:
        args.api_key = api_keys(args.api_key, os.environ)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.max_body_bytes < 1:
        raise UsageError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    return Access(
        api_keys=args.api_key, protect_metrics=args.protect_metrics,
        shared_prefix_cache=args.shared_prefix_cache, max_body_bytes=args.max_body_bytes,
    )  # fmt: skip


def origins(args: argparse.Namespace) -> list[str]:
    """``--allowed-origins``'s origins, each flag's comma-separated ones in order."""
    found = [o.strip() for flag in args.allowed_origins or () for o in flag.split(",")]
    return [o for o in found if o]


def server_config(args: argparse.Namespace, app: Any, port: int | None = None) -> Any:
    """The ``uvicorn.Config`` serving ``app`` as ``serve``'s options say
    (HTTPS with ``--ssl-keyfile``/``--ssl-certfile``) on ``port`` (default ``--port``)."""
    import uvicorn

    return uvicorn.Config(
        app, host=args.host, port=args.port if port is None else port,
        timeout_graceful_shutdown=args.grace,
        log_level="info", access_log=False, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )  # fmt: skip


def check_tls(args: argparse.Namespace) -> None:
    """``--ssl-keyfile`` and ``--ssl-certfile`` go together, name files, and
    are not for ``--replicas``: ``UsageError`` saying which."""
    from mstar.serve.options import UsageError

    given = [f for f in ("ssl_keyfile", "ssl_certfile") if getattr(args, f)]
    if not given:
        return
    if args.replicas is not None:
        raise UsageError("--ssl-keyfile/--ssl-certfile are not supported with --replicas")
    if len(given) == 1:
        raise UsageError("--ssl-keyfile and --ssl-certfile go together: got only one")
    for flag in given:
        path = getattr(args, flag)
        if not os.path.isfile(path):
            raise UsageError(f"--{flag.replace('_', '-')} {path}: no such file")
    tls_context(args)  # (a key that does not fit the certificate: said before anything loads)


def tls_context(args: argparse.Namespace) -> Any:
    """The server side's TLS of ``--ssl-certfile``/``--ssl-keyfile`` (None
    without them); ``UsageError`` when they do not load."""
    import ssl

    from mstar.serve.options import UsageError

    if not args.ssl_certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as err:
        raise UsageError(f"--ssl-certfile/--ssl-keyfile do not load: {err}") from None
    return context


def add_replica_options(p: argparse.ArgumentParser) -> None:
    """``serve --replicas N`` and the options of replicas on Ray Serve."""
    g = p.add_argument_group("replicas on Ray Serve (pip install 'mstar-kv[replicas]')")
    g.add_argument("--replicas", type=int, help="serve N engine replicas through Ray Serve")
    g.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    g.add_argument(
        "--router", default="prefix", choices=("prefix", "round-robin", "least-loaded"),
        help="how requests pick a replica (default prefix: the longest cached prefix)",
    )  # fmt: skip
    g.add_argument(
        "--balance-threshold", type=int, default=8,
        help="prefix router: past this gap in requests in flight, the least loaded (default 8)",
    )  # fmt: skip
    g.add_argument("--autoscaling-config", help="Ray Serve's autoscaling_config, as JSON")
    g.add_argument(
        "--replica-options", default="{}",
        help='Ray actor options of each replica, as JSON (e.g. {"num_gpus": 1})',
    )  # fmt: skip
    g.add_argument(
        "--kv-events-endpoint",
        help="publish KV-cache events (vLLM's format) on ZMQ: replica i on tcp://HOST:PORT+i",
    )  # fmt: skip
    g.add_argument(
        "--kv-events-replay-endpoint", help="the events' replay socket: replica i on PORT+i"
    )


def add_bench_options(bench: argparse.ArgumentParser) -> None:
    """``bench --serve`` and its options, on ``mstar-kv bench``'s parser."""
    bench.add_argument("--serve", action="store_true", help="load-test OpenAI-compatible servers")
    bench.add_argument(
        "--url", action="append", default=[],
        help="--serve: also measure this server (its /v1 base URL; repeatable)",
    )  # fmt: skip
    bench.add_argument("--no-self", action="store_true", help="--serve: only the --url servers")
    bench.add_argument("--requests", type=int, default=32, help="--serve: requests per rate")
    bench.add_argument("--max-tokens", type=int, default=64, help="--serve: per request")
    bench.add_argument(
        "--rates", default="burst,0.5",
        help="--serve: requests/s, comma-separated; burst: all at once, serial: one at a time"
    )  # fmt: skip
    bench.add_argument(
        "--replicas", type=int, default=2, help="--workload shared-prefix: on Ray Serve"
    )
    bench.add_argument(
        "--routers", default="prefix,round-robin", help="--workload shared-prefix: comma-separated"
    )  # fmt: skip
    bench.add_argument(
        "--systems", type=int, default=4, help="--workload shared-prefix: system prompts"
    )  # fmt: skip
    bench.add_argument(
        "--bench-model", default="smollm2", help="--workload shared-prefix, --startup"
    )  # fmt: skip
    bench.add_argument(
        "--bench-pages", type=int, default=512, help="--workload shared-prefix: pages a replica"
    )  # fmt: skip
    bench.add_argument(
        "--startup", action="store_true", help="how soon serve answers a chat: a first start"
        " on an empty cache, a second, and a third on a port in use",
    )  # fmt: skip
    bench.add_argument(
        "--startup-cache", choices=("empty", "current"), default="empty",
        help="--startup: the first start on an empty $MSTAR_KV_CACHE (default) or the current",
    )  # fmt: skip
    from mstar.serve.kv_tiers import add_restart_options

    add_restart_options(bench)


def run(args: argparse.Namespace) -> int:
    """``mstar-kv serve``: serve until SIGINT/SIGTERM, then exit 0."""
    from mstar.serve.options import UsageError, build_engine, check_model_exists
    from mstar.serve.startup import Starting, bind

    for name in ("port", "pages", "page_size", "budget", "max_waiting"):
        least, value = int(name != "port"), getattr(args, name)
        if value is not None and value < least:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    access = access_of(args)
    check_tls(args)
    if args.replicas is not None:
        try:
            from mstar.serve.replicas import run_replicas
        except ImportError as err:
            msg = f"--replicas needs pip install 'mstar-kv[replicas]' ({err.name} is missing)"
            raise UsageError(msg) from None
        return run_replicas(args)
    check_model_exists(args.model)
    attach_tiers = _tiers(args)  # checked before the model loads
    try:  # first: a port in use is reported before anything loads
        sock = bind(args.host, args.port)
    except OSError as err:
        raise UsageError(f"--port {args.port}: {args.host}:{args.port} {reason(err)}") from None
    with contextlib.closing(sock):
        with Starting(sock, tls_context(args)):  # 503 starting while the engine loads
            with serve_extra("serve"):
                import uvicorn  # noqa: F401

                import mstar.serve.app  # noqa: F401
            engine, mode = build_engine(args, enforce_eager=True, compiling_later=compiling(args))
            tiers = attach_tiers(engine) if attach_tiers else None
        return _serve(args, sock, engine, mode, tiers, access)


def compiling(args: argparse.Namespace) -> bool:
    """Whether ``serve`` compiles the forward behind the eager one."""
    return not args.enforce_eager and args.tensor_parallel_size == 1


def reason(err: OSError) -> str:
    """Why a port could not be bound, in a few words."""
    return "is in use" if err.errno == errno.EADDRINUSE else f"cannot be bound ({err.strerror})"


def _serve(
    args: argparse.Namespace, sock: Any, engine: Any, mode: str, tiers: Any, access: Any
) -> int:
    """Serve ``engine`` on the bound ``sock``: its eager forward at once,
    the compiled one swapped in when ready (``mstar.serve.startup``) unless
    ``--enforce-eager``."""
    from mstar.cli.report import windows_note
    from mstar.serve.app import GracefulServer, create_app
    from mstar.serve.kv_tiers import close_tiers
    from mstar.serve.options import model_name, say
    from mstar.serve.startup import compile_in_background

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mstar").setLevel(logging.INFO)  # a line per request
    name = model_name(args)
    app = create_app(
        engine, model_name=name, max_waiting=args.max_waiting,
        tool_call_parser=args.tool_call_parser, access=access, allowed_origins=origins(args),
    )  # fmt: skip
    print(startup_line(args, name, engine, mode, access), flush=True)
    if tiers is not None:
        print(f"KV tiers: {tiers.describe()}", flush=True)
    print(app.state.tools.describe(), flush=True)
    if (windows := windows_note(engine)) != "none":
        print(f"sliding windows: {windows}", flush=True)
    config = server_config(args, app)
    # uvicorn re-raises the signal it stopped on once it has shut down: let that be a no-op
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    later = compiling(args) and not engine.fused  # the fused forward stays: faster than compiled
    compile_thread = compile_in_background(engine, say) if later else None
    GracefulServer(config, app.state.engine).run(sockets=[sock])
    close_tiers(tiers)  # the pool's pages stored before any early exit below
    if compile_thread is not None and compile_thread.is_alive():
        # a compile in flight cannot be stopped, and a thread inside C++ at the
        # interpreter's exit aborts it: leave at once, the server is shut down
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def startup_line(args: argparse.Namespace, name: str, engine: Any, mode: str, access: Any) -> str:
    """``serve``'s first line: where it listens, then short ``key=value``
    facts (with ``--verbose``, the long form: every reason in words)."""
    scheme = "https" if args.ssl_certfile else "http"
    where = f"mstar-kv serve: {name} on {scheme}://{args.host}:{args.port}/v1"
    mgr, cache = engine.mgr, "on" if engine.prefix_cache else "off"
    if args.verbose:
        return (
            f"{where} ({args.device}, {mode}, {mgr.num_pages} KV pages of {mgr.page_size}"
            f" tokens ({engine.kv_cache_bytes / 2**30:.2f} GiB), {engine.budget} tokens/step,"
            f" prefix cache {cache}, max waiting {args.max_waiting})"
        )
    quantization = getattr(engine.model, "mstar_quantization", None)
    keyed = bool(access.api_keys) and not access.shared_prefix_cache
    facts = {
        "device": args.device,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "forward": "fused" if engine.fused else (engine.compiled or "eager").split(" (")[0],
        "quantization": str(quantization).split(" ")[0] if quantization else "none",
        "pages": f"{mgr.num_pages}x{mgr.page_size}",
        "kv": f"{engine.kv_cache_bytes / 2**30:.2f}GiB",
        "budget": engine.budget,
        "max_len": engine.max_len,
        "prefix_cache": "per-key" if cache == "on" and keyed else cache,
        "api_keys": len(access.api_keys),
        "max_waiting": args.max_waiting,
    }
    return f"{where} " + " ".join(f"{k}={v}" for k, v in facts.items()) + " (--verbose: in full)"


def _tiers(args: argparse.Namespace) -> Any:
    """None without ``--kv-disk``/``--kv-remote``, else what puts their
    tiers below an engine's pool; ``UsageError`` for a bad option."""
    from mstar.serve.kv_tiers import tier_options
    from mstar.serve.options import UsageError

    try:
        options = tier_options(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    if options is None:
        return None

    def attach_to(engine: Any) -> Any:
        from mstar.engine.resources.kv.tiers import attach

        try:
            return attach(engine, **options)
        except (ValueError, ImportError) as err:
            raise UsageError(str(err)) from err

    return attach_to


@contextlib.contextmanager
def serve_extra(command: str) -> Iterator[None]:
    """Imports under it that fail for a missing package raise ``UsageError``
    naming it and the extra that brings it."""
    from mstar.serve.options import UsageError

    try:
        yield
    except ImportError as err:
        missing = err.name or str(err)
        raise UsageError(
            f"{command} needs the serve extra ({missing} is not installed):"
            " pip install 'mstar-kv[serve]'"
        ) from None


def run_bench(args: argparse.Namespace) -> int:
    """``mstar-kv bench --serve``."""
    import json

    from mstar.serve.options import UsageError

    with serve_extra("bench --serve"):
        from mstar.bench.serve import format_serve, parse_rates, plot_serve, run_serve_bench

    try:
        rates = parse_rates(args.rates)
    except ValueError as err:
        raise UsageError(f"--rates: {err}") from err
    if args.no_self and not args.url:
        raise UsageError("--no-self needs at least one --url")
    if args.requests < 1 or args.max_tokens < 1:
        raise UsageError("--requests and --max-tokens must be >= 1")
    if args.workload == "shared-prefix":
        return _run_shared_prefix(args, rates)
    if args.workload != "chat":
        raise UsageError(f"--workload {args.workload} goes with --e2e, not --serve")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise UsageError("--plot needs matplotlib: pip install 'mstar-kv[plot]'") from err
    result = run_serve_bench(
        args.url, rates, requests=8 if args.quick else args.requests,
        max_tokens=16 if args.quick else args.max_tokens, self_server=not args.no_self,
        server_args=[*(["--dtype", args.dtype] if args.dtype else []),
                     *(["--enforce-eager"] if args.enforce_eager else []),
                     "--quantization", args.quantization],
    )  # fmt: skip
    print(format_serve(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot_serve(result, args.plot)
    return 0 if all(r["completed"] == r["requests"] for r in result["rows"]) else 1


def _run_shared_prefix(args: argparse.Namespace, rates: list[float]) -> int:
    """``bench --serve --workload shared-prefix``: routers side by side."""
    import json

    from mstar.serve.options import UsageError

    if args.restart:
        from mstar.bench.restart import run_restart

        return run_restart(args)
    routers = [r.strip() for r in args.routers.split(",")]
    if bad := [r for r in routers if r not in ("prefix", "round-robin", "least-loaded")]:
        raise UsageError(f"--routers: expected prefix, round-robin or least-loaded, got {bad[0]!r}")
    if args.replicas < 1 or args.systems < 1 or args.bench_pages < 1:
        raise UsageError("--replicas, --systems and --bench-pages must be >= 1")
    try:
        from mstar.bench.replicas import format_replicas, run_replicas_bench
    except ImportError as err:
        msg = f"--workload shared-prefix needs pip install 'mstar-kv[replicas]': {err}"
        raise UsageError(msg) from err
    result = run_replicas_bench(
        model=args.bench_model, replicas=args.replicas, routers=routers,
        requests=8 if args.quick else args.requests, systems=args.systems,
        max_tokens=16 if args.quick else args.max_tokens, rates=rates, pages=args.bench_pages,
    )  # fmt: skip
    print(format_replicas(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r["completed"] == r["requests"] for r in result["rows"]) else 1
