"""``mstar-kv bench --serve``: load-test OpenAI-compatible servers, in the
spirit of vLLM's serving benchmark.

Each target gets, per rate, the same N streamed chat requests (the demo's
questions in turn, greedy, ``max_tokens`` each) arriving all at once
("burst"), one after another ("serial": each sent when the one before
ends) or as a Poisson process; reported: output tokens/s, time to first
token and time per output token (p50/p90/p99). Our own server runs as a
``mstar-kv serve`` process (its peak resident memory is read from /proc);
``urls`` add other servers (``http://host:port/v1``), measured in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from mstar.cli.demo import CHAT_QUESTIONS

BURST = math.inf
SERIAL = 0.0  # one request at a time
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 1800
SEED = 0


@dataclass
class Sample:
    """One request: seconds to its first content and to its end, tokens out."""

    ttft: float | None
    latency: float
    tokens: int
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.tokens - 1)


def parse_rates(text: str) -> list[float]:
    """``"burst,serial,0.5"`` -> ``[inf, 0.0, 0.5]``; ValueError for anything else."""
    rates = []
    for part in text.split(","):
        named = {"burst": BURST, "serial": SERIAL}
        rate = named[part.strip()] if part.strip() in named else float(part)
        if not (rate > 0 or part.strip() == "serial"):
            raise ValueError(f"expected 'burst', 'serial' or a rate > 0, got {part!r}")
        rates.append(rate)
    return rates


def rate_name(rate: float) -> str | float:
    return "burst" if rate == BURST else "serial" if rate == SERIAL else rate


def arrivals(n: int, rate: float, seed: int = SEED) -> list[float]:
    """Send times (s): all 0 for a burst, else a Poisson process at ``rate``/s."""
    if rate == BURST:
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Sample:
    """Stream one chat completion; the first non-empty content (or tool
    call, or token ids with ``return_token_ids``) is its first token. Sent
    again once when the connection drops before any answer (a kept-alive
    connection the server had closed: llama-server closes idle ones)."""
    t0 = time.perf_counter()
    sample = await _stream(client, url, body, t0)
    if sample.ttft is None and sample.error and sample.error.startswith("RemoteProtocolError"):
        sample = await _stream(client, url, body, t0)
    return sample


async def _stream(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> Sample:
    ttft, chunks, tokens = None, 0, None
    try:
        async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Sample(None, time.perf_counter() - t0, 0, f"{r.status_code} {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(ttft, time.perf_counter() - t0, chunks, str(chunk["error"]))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    delta, ids = choice.get("delta") or {}, choice.get("token_ids")
                    if delta.get("content") or delta.get("tool_calls") or ids:
                        ttft = time.perf_counter() - t0 if ttft is None else ttft
                        chunks += len(ids) if ids else 1
    except httpx.HTTPError as err:
        return Sample(ttft, time.perf_counter() - t0, chunks, repr(err))
    return Sample(ttft, time.perf_counter() - t0, chunks if tokens is None else tokens)


async def run_load(
    url: str, model: str, n: int, rate: float, max_tokens: int, tick: Callable[[], None],
    extra: dict | None = None,
) -> tuple[list[Sample], float]:  # fmt: skip
    """``n`` requests at ``rate`` (their bodies with ``extra``); their
    samples and the run's wall time."""
    bodies = [
        {
            "model": model,
            "messages": [{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        for i in range(n)
    ]
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await one_request(client, url, {**bodies[0], "max_tokens": 2})  # warm-up
        start = time.perf_counter()

        async def at(when: float, body: dict) -> Sample:
            await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
            sample = await one_request(client, url, body)
            tick()
            return sample

        if rate == SERIAL:
            samples = [await at(0.0, b) for b in bodies]
        else:
            samples = await asyncio.gather(*(at(w, b) for w, b in zip(arrivals(n, rate), bodies)))
    return list(samples), time.perf_counter() - start


def percentiles(values: Sequence[float]) -> list[float | None]:
    if not values:
        return [None, None, None]
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99)]


def summarize(target: str, rate: float, samples: list[Sample], seconds: float) -> dict:
    ok = [s for s in samples if s.error is None]
    tokens = sum(s.tokens for s in ok)
    return {
        "target": target,
        "rate": rate_name(rate),
        "requests": len(samples),
        "completed": len(ok),
        "errors": sorted({s.error for s in samples if s.error})[:3],
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "ttft_s": percentiles([s.ttft for s in ok if s.ttft is not None]),
        "tpot_s": percentiles([t for s in ok if (t := s.tpot) is not None]),
    }


class OwnServer:
    """``mstar-kv serve --model smollm2 [ARGS]`` as a child process on a free
    port (or ``port``), with ``env`` added to this process's environment; its
    output (stdout and stderr) read as it comes (``lines``), so a chatty
    server never blocks on a full pipe. Entering waits until ``/health``
    says 200, polling every ``POLL_S``, and notes when it first answered
    (``answered_s``, 503 while starting) and when it was ready (``ready_s``),
    seconds from the process's start."""

    POLL_S = 0.25

    def __init__(
        self, args: Sequence[str] = (), env: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        from mstar.serve import free_port

        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [sys.executable, "-m", "mstar.cli", "serve", "--model", "smollm2",
               "--port", str(self.port), "--verbose", *args]  # fmt: skip
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
        self.lines: list[str] = []
        self.answered_s: float | None = None
        self.ready_s: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def mode(self) -> str | None:
        """The server's start-up line (its dtype, forward and quantization)."""
        return next((x for x in self.lines if x.startswith("mstar-kv serve: ")), None)

    def __enter__(self) -> OwnServer:
        deadline = self.started + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                status = httpx.get(f"{self.url[:-3]}/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            now = time.monotonic() - self.started
            if status is not None and self.answered_s is None:
                self.answered_s = now
            if status == 200:
                self.ready_s = now
                return self
            time.sleep(self.POLL_S)  # a starting server's two cores are busy enough
        self.__exit__()
        self._reader.join(timeout=5)
        output = "\n".join(self.lines)[-2000:]
        raise RuntimeError(f"mstar-kv serve did not start: {output}")

    def exited(self, timeout: float) -> int:
        """Wait for the process to exit by itself, its output read to the end;
        its exit code (``TimeoutExpired`` after ``timeout`` seconds)."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    def peak_rss_bytes(self) -> int:
        """The process's peak resident memory (VmHWM)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
        return int(kb) * 1024

    def __exit__(self, *exc: Any) -> None:
        self.exit_code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def model_of(url: str) -> str:
    """The first model a server lists."""
    return httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]


def peer_of(url: str, transport: httpx.BaseTransport | None = None) -> str | None:
    """What the server at ``url`` (its ``/v1``) says it is, for the table:
    llama.cpp's ``/props`` (its build, slots and weights' type: one user's
    speed depends on its slots), vLLM's ``/version``, ``mstar-kv serve``'s
    ``/health``; None when none of them answers."""
    root = url.removesuffix("/v1")
    with httpx.Client(timeout=10, transport=transport) as http:
        props = _json_at(http, f"{root}/props")
        if "total_slots" in props:
            slots = props["total_slots"]
            return (
                f"llama.cpp server {props.get('build_info', '')}: {slots} slot"
                f"{'' if slots == 1 else 's'}, {props.get('model_ftype', 'unnamed')} weights"
            )
        version = _json_at(http, f"{root}/version")
        if "version" in version:
            return f"vLLM {version['version']}"
        health = _json_at(http, f"{root}/health")
        if "forward" in health:
            return f"mstar-kv serve ({health['forward']} forward)"
    return None


def _json_at(http: httpx.Client, url: str) -> dict:
    """The JSON object a GET of ``url`` answers with 200 ({} for anything else)."""
    try:
        response = http.get(url)
        body = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


STRUCTURED = "mstar-kv serve, json_schema"
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 80},
        "confidence": {"enum": ["low", "medium", "high"]},
    },
    "required": ["answer", "confidence"],
}
JSON_SCHEMA_BODY = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
    }
}
TOOLS = "mstar-kv serve, tools required"
# the same answer as a required tool call; token ids stream while the call is held back
TOOLS_BODY = {
    "tools": [{"type": "function", "function": {"name": "answer", "parameters": ANSWER_SCHEMA}}],
    "tool_choice": "required",
    "return_token_ids": True,
}
# our server's rows beside plain decoding: what a grammar costs per token
CONSTRAINED = ((STRUCTURED, JSON_SCHEMA_BODY), (TOOLS, TOOLS_BODY))


def run_serve_bench(
    urls: Sequence[str], rates: Sequence[float], *, requests: int, max_tokens: int,
    self_server: bool = True, server_args: Sequence[str] = (),
) -> dict:  # fmt: skip
    """Every target at every rate; the rows and each target's peak memory."""
    from rich.progress import Progress

    from mstar.cpu.info import cpu_info

    targets = (["mstar-kv serve"] if self_server else []) + list(urls)
    rows, memory, modes, peers = [], {}, {}, {}
    with Progress(transient=True) as progress:
        for target in targets:
            own = OwnServer(server_args) if target == "mstar-kv serve" else None
            with own or contextlib.nullcontext():
                url = own.url if own else target.rstrip("/")
                model = model_of(url)
                if own is None:
                    peers[target] = peer_of(url) or "did not say what it is"
                for rate in rates:
                    task = progress.add_task(f"{target} @ {rate}/s", total=requests)
                    samples, seconds = asyncio.run(
                        run_load(url, model, requests, rate, max_tokens,
                                 lambda t=task: progress.advance(t))
                    )  # fmt: skip
                    progress.remove_task(task)
                    rows.append(summarize(target, rate, samples, seconds))
                for row, body in CONSTRAINED if own else ():
                    task = progress.add_task(f"{row} @ {rates[0]}/s", total=requests)
                    samples, seconds = asyncio.run(
                        run_load(url, model, requests, rates[0], max_tokens,
                                 lambda t=task: progress.advance(t), body)
                    )  # fmt: skip
                    progress.remove_task(task)
                    rows.append(summarize(row, rates[0], samples, seconds))
                if own:
                    memory[target] = own.peak_rss_bytes()
                    modes[target] = own.mode
    return {
        "requests": requests,
        "max_tokens": max_tokens,
        "threads": os.cpu_count(),
        "cpu": cpu_info().describe(),
        "rows": rows,
        "peak_rss_bytes": memory,
        "modes": modes,
        "peers": peers,
    }


def format_serve(result: dict) -> str:
    """The latency table, with ratios of the first target to each other."""

    def ms(values: list[float | None]) -> str:
        return "/".join("-" if v is None else f"{v * 1000:.0f}" for v in values)

    rows = result["rows"]
    first = {r["rate"]: r for r in rows if r["target"] == rows[0]["target"]} if rows else {}
    head = (
        f"{result['requests']} streamed chat requests, max {result['max_tokens']} tokens, greedy;"
        f" TTFT/TPOT p50/p90/p99 in ms; x: how many times better the first target"
        f" ({rows[0]['target'] if rows else ''}) does than this one; '{STRUCTURED}' and"
        f" '{TOOLS}': the same requests under a JSON schema and as a required tool call"
        " (a grammar's cost: its TPOT beside plain)"
    )
    cols = ["target", "rate/s", "done", "out tok/s", "TTFT ms", "TPOT ms", "tok/s x",
            "TTFT p50 x"]  # fmt: skip
    table = [cols]
    for r in rows:
        base = first.get(r["rate"])
        ratio = base["tokens_per_s"] / r["tokens_per_s"] if base and r["tokens_per_s"] else None
        t_base, t = (base or {}).get("ttft_s", [None])[0], r["ttft_s"][0]
        table.append(
            [r["target"], str(r["rate"]), f"{r['completed']}/{r['requests']}",
             f"{r['tokens_per_s']:.1f}", ms(r["ttft_s"]), ms(r["tpot_s"]),
             "-" if ratio is None else f"{ratio:.2f}x",
             "-" if not (t and t_base) else f"{t / t_base:.2f}x"]
        )  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    cpu = [f"CPU: {result['cpu']}"] if result.get("cpu") else []
    lines = [head, *cpu] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(len(cpu) + 2, "  ".join("-" * w for w in widths))
    for target, mode in result.get("modes", {}).items():
        lines.append(f"{target}: {mode or 'no start-up line'}")
    for target, peer in result.get("peers", {}).items():
        lines.append(f"{target}: {peer}")
    for target, rss in result["peak_rss_bytes"].items():
        lines.append(f"{target}: peak resident memory {rss / 2**30:.2f} GiB")
    for r in rows:
        if r["errors"]:
            lines.append(f"{r['target']} @ {r['rate']}: errors {r['errors']}")
    return "\n".join(lines)


def plot_serve(result: dict, path: str) -> None:
    """TTFT and TPOT (p50, p90 dashed) against the request rate, per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(
        {r["rate"] for r in result["rows"]},
        key=lambda x: math.inf if x == "burst" else -1.0 if x == "serial" else x,
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(
        axes, ("ttft_s", "tpot_s"), ("time to first token", "time per output token")
    ):
        for color, target in enumerate(dict.fromkeys(r["target"] for r in result["rows"])):
            rows = {r["rate"]: r for r in result["rows"] if r["target"] == target}
            xs = [i for i, rate in enumerate(rates) if rate in rows]
            for q, style in ((0, "-o"), (1, "--")):
                ys = [rows[rates[i]][key][q] for i in xs]
                ax.plot(xs, ys, style, color=f"C{color}", label=f"{target} p{(50, 90)[q]}")
        ax.set_xticks(range(len(rates)), [r if isinstance(r, str) else f"{r}/s" for r in rates])
        ax.set_xlabel("request rate")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['requests']} streamed chat requests, max {result['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
