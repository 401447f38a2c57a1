"""``mstar-kv bench --startup``: how soon ``mstar-kv serve`` answers.

Three starts of ``mstar-kv serve --model M [ARGS]``, one after another:

1. *first*: on an empty cache folder (``MSTAR_KV_CACHE``: the GGUF converted,
   the kernels built, as on a fresh machine), or on the current one
   (``empty_cache=False``);
2. *second*: on the same folder, as every later start runs;
3. *port in use*: a third on the second's port while the second runs.

Per start, seconds from the process's start: when ``/health`` first answered
(503 ``starting``), when it said ready, and when a greedy chat of
``max_tokens`` tokens came back (sent once ready), with its answer; for the
third, when it exited, its exit code and its last line. The figures issue 35
set: a chat answered within 60 s at the first start and the second, a port
in use reported within 20 s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence

import httpx

from mstar.bench.serve import REQUEST_TIMEOUT_S, OwnServer, model_of

QUESTION = "What is the capital of France?"
EXIT_TIMEOUT_S = 120


def chat(server: OwnServer, max_tokens: int) -> tuple[float, str]:
    """Seconds from ``server``'s start to a greedy chat's answer, and the answer."""
    body = {"model": model_of(server.url), "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    if r.status_code != 200:
        raise RuntimeError(f"expected the chat answered, got {r.status_code}: {r.text[:300]}")
    return time.monotonic() - server.started, r.json()["choices"][0]["message"]["content"]


def start_row(name: str, server: OwnServer, max_tokens: int) -> dict:
    """``server``'s start (it is ready) to a chat's answer."""
    chat_s, answer = chat(server, max_tokens)
    return {"start": name, "health_s": server.answered_s, "ready_s": server.ready_s,
            "chat_s": chat_s, "answer": answer, "mode": server.mode}  # fmt: skip


def port_in_use(args: Sequence[str], env: dict[str, str], port: int) -> dict:
    """A start on ``port``, taken: how soon it exited, and what it said."""
    server = OwnServer(args, env=env, port=port)
    try:
        code = server.exited(EXIT_TIMEOUT_S)
    finally:
        server.__exit__()  # stopped, had it not exited
    exited_s = time.monotonic() - server.started
    said = next((line for line in reversed(server.lines) if line.strip()), "")
    return {"start": "port in use", "exit_s": exited_s, "exit_code": code, "said": said}


def run_startup_bench(
    model: str = "smollm2",
    server_args: Sequence[str] = (),
    empty_cache: bool = True,
    max_tokens: int = 16,
) -> dict:
    """The three starts; see the module docstring."""
    from mstar.cpu.info import cpu_info

    args = ["--model", model, *server_args]
    with tempfile.TemporaryDirectory(prefix="mstar-kv-cache-") as empty:
        env = {"MSTAR_KV_CACHE": empty} if empty_cache else {}
        first = "first (an empty cache)" if empty_cache else "first (the current cache)"
        with OwnServer(args, env=env) as server:
            rows = [start_row(first, server, max_tokens)]
        with OwnServer(args, env=env) as server:
            rows.append(start_row("second (the same cache)", server, max_tokens))
            rows.append(port_in_use(args, env, server.port))
    return {"model": model, "server_args": list(server_args), "empty_cache": empty_cache,
            "cpu": cpu_info().describe(), "rows": rows}  # fmt: skip


def format_startup(result: dict) -> str:
    """The starts as a table, the CPU and the servers' start-up line."""

    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} s"

    args = " ".join(result["server_args"])
    lines = [
        f"mstar-kv serve --model {result['model']} {args}".rstrip() + ": seconds from the"
        " process's start (targets: a chat within 60 s, a port in use within 20 s)",
        f"CPU: {result['cpu']}",
        f"{'start':<26}{'/health 503':>12}{'ready':>9}{'chat':>9}  answer / exit",
    ]
    for row in result["rows"]:
        if "exit_s" in row:
            tail = f"exit {row['exit_code']} at {s(row['exit_s'])}: {row['said']}"
            lines.append(f"{row['start']:<26}{'-':>12}{'-':>9}{'-':>9}  {tail}")
        else:
            answer = " ".join(row["answer"].split())[:60]
            lines.append(
                f"{row['start']:<26}{s(row['health_s']):>12}{s(row['ready_s']):>9}"
                f"{s(row['chat_s']):>9}  {answer!r}"
            )
    mode = next((row["mode"] for row in result["rows"] if row.get("mode")), None)
    if mode:
        lines.append(mode)
    return "\n".join(lines)


def run_startup(args: argparse.Namespace) -> int:
    """``bench --startup``: 0 when every start answered its chat and the
    third exited on the port in use."""
    from mstar.serve.options import UsageError

    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    server_args = [*(["--dtype", args.dtype] if args.dtype else []),
                   *(["--enforce-eager"] if args.enforce_eager else []),
                   "--quantization", args.quantization]  # fmt: skip
    result = run_startup_bench(
        model=args.bench_model, server_args=server_args,
        empty_cache=args.startup_cache == "empty", max_tokens=16 if args.quick else args.max_tokens,
    )  # fmt: skip
    print(format_startup(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["rows"][-1]["exit_code"] != 0 else 1
