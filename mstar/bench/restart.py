"""``mstar-kv bench --serve --workload shared-prefix --restart``: a long shared
context asked cold, then from the KV tiers (docs/kv-tiers.md).

Three ``mstar-kv serve`` processes, one context of ``context`` tokens (the
workload's system prompts, tokenized, cut to length), greedy, streamed:

1. *cold*: a server with ``--kv-disk D --kv-remote S --kv-offload eager``
   computes the context (its pages go to the disk and to the store);
2. *replica (store)*: a second server with ``--kv-remote S`` alone, started
   beside the first, is asked the same context;
3. *restart (disk)*: the first server stopped, a new one with ``--kv-disk D``
   alone is asked it again.

Each server answers a short warm-up request first. Reported per phase: time
to first token, its ratio to the cold one, and whether the tokens equal the
cold run's. The store is the one at ``store`` or, without, a throwaway
``valkey-server``/``redis-server`` from PATH (the replica phase is skipped
when there is none).

With ``ray`` (``--ray-replicas``), phases 1 and 2 run on two Ray Serve
replicas of one ``mstar-kv serve --replicas 2 --router round-robin
--kv-disk D --kv-remote S --kv-offload eager``: each is warmed up, the
context goes to one (cold), then to the other (from the store; it copies
the pages to its own ``D/replica-RANK``); phase 3 restarts a single server
on that replica's disk folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

import httpx

from mstar.bench.replicas import system_prompt
from mstar.bench.serve import REQUEST_TIMEOUT_S, OwnServer

STORE_START_S = 10.0


def context_ids(model: str, tokens: int) -> list[int]:
    """``tokens`` token ids of the workload's system prompts, for ``model``."""
    from mstar.models.loader import tokenizer_of

    tokenizer = tokenizer_of(model)
    ids: list[int] = []
    k = 0
    while len(ids) < tokens:
        ids += tokenizer.encode(system_prompt(k) + "\n")
        k += 1
    return ids[:tokens]


def ask(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first token of a streamed greedy completion of
    ``prompt``, and its token ids."""
    from mstar.bench.serve import model_of

    body = {"model": model_of(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft, ids = None, []
    with (
        httpx.Client(timeout=REQUEST_TIMEOUT_S) as client,
        client.stream("POST", f"{url}/completions", json=body) as r,
    ):
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", ()):
                if choice.get("token_ids"):
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    ids += choice["token_ids"]
    if ttft is None:
        raise RuntimeError("expected tokens, got none")
    return ttft, ids


def page_size(server_args: Sequence[str]) -> int:
    """``--page-size`` in ``server_args``, else serve's default."""
    args = list(server_args)
    return int(args[args.index("--page-size") + 1]) if "--page-size" in args else 16


def tier_pages(server: OwnServer, tier: str, event: str) -> dict[str, float]:
    """``server``'s ``mstar_kv_tier_pages_total`` for ``tier`` and ``event``,
    by replica rank ("" for a server without replicas)."""
    text = httpx.get(f"{server.url[:-3]}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^mstar_kv_tier_pages_total{(.*)} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if got.get("tier") == tier and got.get("event") == event:
            out[got.get("replica", "")] = float(value)
    return out


def wait_pages(server: OwnServer, tier: str, event: str, pages: int, timeout: float = 300) -> str:
    """Wait until one of ``server``'s replicas counts ``pages`` pages ``event``
    (stored, promoted) in ``tier``; its rank."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [r for r, n in tier_pages(server, tier, event).items() if n >= pages]
        if done:
            return done[0]
        time.sleep(0.2)
    raise RuntimeError(f"expected {pages} pages {event} in the {tier} tier within {timeout} s")


@contextlib.contextmanager
def own_store() -> Iterator[str | None]:
    """A throwaway Valkey/Redis server's url (None without a binary on PATH)."""
    from mstar.serve import free_port

    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + STORE_START_S
        import socket

        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{binary} did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run_restart_bench(
    model: str = "smollm2",
    context: int = 4096,
    max_tokens: int = 16,
    pages: int = 512,
    store: str | None = None,
    server_args: Sequence[str] = (),
    ray: bool = False,
) -> dict:
    """The three phases; see the module docstring."""
    prompt = context_ids(model, context)
    common = ["--model", model, "--pages", str(pages), *server_args]
    rows = []

    def phase(name: str, server: OwnServer, cold: dict | None, warm: int = 1) -> dict:
        for _ in range(warm):  # shares no page with the context
            ask(server.url, [1, 2, 3], 2)
        ttft, ids = ask(server.url, prompt, max_tokens)
        row = {"phase": name, "ttft_s": ttft, "tokens": ids}
        if cold is not None:
            row["ratio"] = ttft / cold["ttft_s"]
            row["exact"] = ids == cold["tokens"]
        rows.append(row)
        return row

    with (
        tempfile.TemporaryDirectory(prefix="mstar-kv-disk-") as disk,
        contextlib.ExitStack() as stack,
    ):
        url = store or stack.enter_context(own_store())
        remote = ["--kv-remote", url] if url else []
        pages_of = context // page_size(server_args)
        replicas = ["--replicas", "2", "--router", "round-robin"] if ray and url else []
        first = OwnServer([*common, "--kv-disk", disk, *remote, "--kv-offload", "eager", *replicas])
        with first:
            name = "cold (Ray replica)" if replicas else "cold"
            cold = phase(name, first, None, warm=2 if replicas else 1)  # each replica warmed
            if url:
                wait_pages(first, "remote", "stored", pages_of)
            if replicas:  # round-robin: the other replica
                phase("replica (Ray, store)", first, cold, warm=0)
                loaded = (context - 1) // page_size(server_args)
                reader = wait_pages(first, "disk", "promoted", loaded)
                disk = os.path.join(disk, f"replica-{reader}")
            elif url:
                with OwnServer([*common, *remote]) as replica:
                    phase("replica (store)", replica, cold)
        with OwnServer([*common, "--kv-disk", disk]) as restarted:
            phase("restart (disk)", restarted, cold)
    return {"model": model, "context": context, "max_tokens": max_tokens, "ray": ray,
            "rows": rows}  # fmt: skip


def format_restart(result: dict) -> str:
    lines = [
        f"{result['model']}: a {result['context']}-token shared context, "
        f"{result['max_tokens']} tokens out",
        f"{'phase':<24} {'TTFT ms':>9} {'x cold':>7}  tokens = cold's",
    ]
    for row in result["rows"]:
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "1"
        exact = {True: "yes", False: "NO"}.get(row.get("exact"), "-")
        lines.append(f"{row['phase']:<24} {row['ttft_s'] * 1e3:>9.1f} {ratio:>7}  {exact}")
    return "\n".join(lines)


def run_restart(args: argparse.Namespace) -> int:
    """``bench --serve --workload shared-prefix --restart``: 0 when every
    phase's tokens equal the cold run's."""
    from mstar.serve.options import UsageError

    if args.context_tokens < 2 or args.max_tokens < 1 or args.bench_pages < 1:
        raise UsageError("--context-tokens must be >= 2, --max-tokens and --bench-pages >= 1")
    server_args = [*(["--dtype", args.dtype] if args.dtype else []),
                   *(["--enforce-eager"] if args.enforce_eager else [])]  # fmt: skip
    result = run_restart_bench(
        model=args.bench_model, context=args.context_tokens,
        max_tokens=16 if args.quick else args.max_tokens, pages=args.bench_pages,
        store=args.kv_store, server_args=server_args, ray=args.ray_replicas,
    )  # fmt: skip
    print(format_restart(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(row.get("exact", True) for row in result["rows"]) else 1
