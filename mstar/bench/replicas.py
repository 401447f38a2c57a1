"""``mstar-kv bench --serve --workload shared-prefix``: engine replicas on
Ray Serve, routed by cached prefix against round-robin (or by load).

The workload: a few long system prompts, each asked many questions (the
demo's), in shuffled order, streamed chat requests, greedy. Each router gets
fresh replicas on one local Ray instance and the same requests; reported per
router: the prefix cache's hit rate over the run (prompt tokens found cached,
summed over the replicas), prompt tokens computed, pages cached, output
tokens/s and time to first token (p50/p90/p99).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

import httpx

from mstar.bench.serve import REQUEST_TIMEOUT_S, arrivals, one_request, summarize
from mstar.cli.demo import CHAT_QUESTIONS

DOMAINS = ("a railway timetable office", "a hospital pharmacy", "a mountain weather station",
           "a public library's archive")  # fmt: skip
RULES = (
    "Answer in at most two sentences, plainly, without lists or headings.",
    "Never invent facts; when unsure, say what you would need to know.",
    "Use metric units and the 24-hour clock, and spell out abbreviations once.",
    "Be polite but brief, and do not repeat the question back to the user.",
    "If the question is outside your office's work, answer it anyway, briefly.",
    "Prefer concrete examples over general advice, one example at most.",
)
APP = "mstar-kv-bench"


def system_prompt(k: int) -> str:
    """The ``k``-th long system prompt (a few hundred tokens)."""
    domain = DOMAINS[k % len(DOMAINS)]
    rules = " ".join(f"Rule {i + 1} for {domain}: {r}" for i, r in enumerate(RULES))
    return f"You are the assistant of {domain} (desk {k}). {rules} " * 2


def shared_prefix_bodies(n: int, systems: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """``n`` streamed chat requests over ``systems`` system prompts, shuffled."""
    bodies = [
        {
            "messages": [
                {"role": "system", "content": system_prompt(i % systems)},
                {"role": "user", "content": CHAT_QUESTIONS[i // systems % len(CHAT_QUESTIONS)]},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(n)
    ]
    random.Random(seed).shuffle(bodies)
    return bodies


async def run_bodies(url: str, bodies: list[dict], rate: float) -> tuple[list, float]:
    """``bodies`` sent at ``rate``, after a warm-up sharing no prefix with them."""
    limits = httpx.Limits(max_connections=len(bodies) + 1)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        warm = {**bodies[0], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        await one_request(client, url, warm)
        start = time.perf_counter()

        async def at(when: float, body: dict):
            await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
            return await one_request(client, url, body)

        times = arrivals(len(bodies), rate)
        samples = await asyncio.gather(*(at(w, b) for w, b in zip(times, bodies)))
    return list(samples), time.perf_counter() - start


def replica_stats(url: str) -> list[dict]:
    return httpx.get(f"{url}/replicas", timeout=60).json()["data"]


def run_replicas_bench(
    *, model: str, replicas: int, routers: Sequence[str], requests: int, systems: int,
    max_tokens: int, rates: Sequence[float], pages: int | None,
) -> dict:  # fmt: skip
    """Each router on fresh replicas, at each rate; the rows."""
    import ray
    from ray import serve

    from mstar.serve import free_port
    from mstar.serve.replicas import ReplicaConfig, Scaling, build_app

    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}/v1"
        bodies = shared_prefix_bodies(requests, systems, max_tokens)
        for router in routers:
            for rate in rates:
                app = build_app(ReplicaConfig(model=model, pages=pages),
                                Scaling(replicas=replicas, router=router))  # fmt: skip
                serve.run(app, name=APP, route_prefix="/")
                name = httpx.get(f"{url}/models", timeout=60).json()["data"][0]["id"]
                before = replica_stats(url)
                samples, seconds = asyncio.run(
                    run_bodies(url, [{**b, "model": name} for b in bodies], rate)
                )
                rows.append({**summarize(router, rate, samples, seconds),
                             **_cache_delta(before, replica_stats(url))})  # fmt: skip
                serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"requests": requests, "systems": systems, "max_tokens": max_tokens,
            "replicas": replicas, "model": model, "rows": rows}  # fmt: skip


def _cache_delta(before: list[dict], after: list[dict]) -> dict:
    def total(stats: list[dict], key: str) -> int:
        return sum(s[key] for s in stats)

    queried = total(after, "tokens_queried") - total(before, "tokens_queried")
    hit = total(after, "tokens_hit") - total(before, "tokens_hit")
    return {
        "hit_rate": hit / max(1, queried),
        "tokens_computed": queried - hit,
        "pages_cached": total(after, "pages_cached") + total(after, "pages_evicted"),
    }


def format_replicas(result: dict) -> str:
    """One row per router and rate: hit rate, tokens computed, TTFT, throughput."""

    def ms(values) -> str:
        return "/".join("-" if v is None else f"{v * 1000:.0f}" for v in values)

    head = (
        f"{result['requests']} streamed chat requests over {result['systems']} system prompts"
        f" (shuffled), max {result['max_tokens']} tokens, greedy, {result['replicas']} replicas"
        f" of {result['model']} on Ray Serve; TTFT p50/p90/p99 in ms"
    )
    cols = ["router", "rate/s", "done", "prefix hit", "computed tok", "pages", "out tok/s",
            "TTFT ms"]  # fmt: skip
    table = [cols] + [
        [r["target"], str(r["rate"]), f"{r['completed']}/{r['requests']}",
         f"{r['hit_rate']:.1%}", str(r["tokens_computed"]), str(r["pages_cached"]),
         f"{r['tokens_per_s']:.1f}", ms(r["ttft_s"])]
        for r in result["rows"]
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(2, "  ".join("-" * w for w in widths))
    for r in result["rows"]:
        if r["errors"]:
            lines.append(f"{r['target']} @ {r['rate']}: errors {r['errors']}")
    return "\n".join(lines)
