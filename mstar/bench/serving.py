"""A serving workload on SmolLM2 (``mstar-kv bench --e2e --workload mixed``):
chat prompts of varied length, half behind a long shared few-shot preamble,
each with its own ``max_new_tokens`` drawn from a wide seeded range, greedy
with EOS on; served all at once, then with staggered (seeded, exponential)
arrivals, through ``Engine``, HF ``generate`` on left-padded batches of a
fixed size, and HF continuous batching (its manager, prefix sharing on).

Tokens/s is generated tokens over the time from the first arrival to the
last token; TTFT is each request's first token less its arrival. Every
path's tokens are compared with HF ``generate`` on each prompt alone (the
oracle, untimed): a row of a padded batch runs to the batch's longest
``max_new_tokens`` and is cut to its own, which changes no greedy token.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mstar.bench.e2e import format_rows, hf_one

PREAMBLE = (
    "You answer questions for a science museum's help desk. Keep answers short, friendly"
    " and correct. Examples of good answers:\n"
    "Q: Why do leaves change color in autumn?\n"
    "A: As days shorten, trees stop making green chlorophyll, so the yellow and orange"
    " pigments that were there all along show through.\n"
    "Q: How far away is the Moon?\n"
    "A: About 384,000 kilometres on average, a little less than ten times around the Earth.\n"
    "Q: What makes thunder?\n"
    "A: Lightning heats the air so fast that it expands with a bang; that shock wave is thunder.\n"
    "Q: Why is sea water salty?\n"
    "A: Rain washes minerals out of rocks into rivers, and the rivers carry them to the sea,"
    " where the water evaporates and the salt stays behind.\n"
    "Now the visitor's question.\n"
)
ASIDES = (
    "Please keep it simple.",
    "I am asking for my daughter, who is nine.",
    "I read something about this on a plane last week and could not stop thinking about it.",
    "Answer in a few words if you can.",
    "My friend and I disagree about this, so a clear answer would settle a bet.",
    "Explain it the way a good teacher would, step by step, with one everyday example.",
)


@dataclass(frozen=True)
class Job:
    """One request: its prompt, its own token limit, its arrival (seconds)."""

    prompt: list[int]
    max_new_tokens: int
    arrival: float


@dataclass(frozen=True)
class Served:
    """What a path produced for the jobs, in job order, and when."""

    tokens: list[list[int]]
    ttft: list[float]  # seconds from arrival to first token
    seconds: float  # first arrival to last token


def _quiet(_: int) -> None:
    pass


def mixed_jobs(
    tokenizer: Any, num: int, new_tokens: tuple[int, int], seed: int, mean_gap: float
) -> list[Job]:
    """``num`` chat prompts: a question (0-3 asides added), every other one
    behind ``PREAMBLE``; ``max_new_tokens`` uniform in ``new_tokens``;
    arrivals ``mean_gap`` seconds apart on average (0: all at once)."""
    from mstar.cli.demo import CHAT_QUESTIONS
    from mstar.engine.prompts import chat_prompt

    rng, gaps = random.Random(seed), random.Random(seed + 1)  # the same prompts at any gap
    jobs, arrival = [], 0.0
    for i in range(num):
        text = " ".join(
            [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)], *rng.sample(ASIDES, rng.randint(0, 3))]
        )
        prompt = chat_prompt(tokenizer, PREAMBLE + text if i % 2 == 0 else text)
        jobs.append(Job(prompt, rng.randint(*new_tokens), arrival))
        arrival += gaps.expovariate(1 / mean_gap) if mean_gap > 0 else 0.0
    return jobs


def serve_engine(
    engine_for: Callable[[], Any], jobs: list[Job], finished: Callable[[int], None] = _quiet
) -> Served:
    """Jobs through ``Engine.step``, each added once its arrival has passed;
    ``finished`` hears how many are done after each step that ends one."""
    from mstar.engine import SamplingParams

    engine = engine_for()
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, list[int]] = {}
    ids: list[str] = []
    while len(done) < len(jobs):
        now = time.perf_counter() - start
        while len(ids) < len(jobs) and jobs[len(ids)].arrival <= now:
            job = jobs[len(ids)]
            ids.append(
                engine.add_request(job.prompt, SamplingParams(max_new_tokens=job.max_new_tokens))
            )
        if not engine.has_unfinished():
            time.sleep(max(0.0, jobs[len(ids)].arrival - now))
            continue
        for c in engine.step():  # a request fed a prompt chunk comes back without tokens
            if c.outputs[0].token_ids:
                first.setdefault(c.request_id, time.perf_counter() - start)
            if c.finished:
                done[c.request_id] = c.outputs[0].token_ids
                finished(len(done))
    end = time.perf_counter() - start
    return Served(
        [done[r] for r in ids],
        [first[r] - j.arrival for r, j in zip(ids, jobs)],
        end - jobs[0].arrival,
    )


class _FirstToken:
    """A ``generate`` streamer noting when the first new tokens came (its
    first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, _: torch.Tensor) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.no_grad()
def serve_padded(
    model: Any, jobs: list[Job], config: Any, batch: int, finished: Callable[[int], None] = _quiet
) -> Served:
    """Jobs in arrival order, ``batch`` at a time, each batch started once
    its last job has arrived and the batch before has finished, left-padded,
    run to its longest ``max_new_tokens``; each row cut to its own and at EOS
    (``finished`` hears how many are done after each batch)."""
    start = time.perf_counter()
    tokens: list[list[int]] = []
    ttft: list[float] = []
    for b in range(0, len(jobs), batch):
        group = jobs[b : b + batch]
        time.sleep(max(0.0, group[-1].arrival - (time.perf_counter() - start)))
        width = max(len(j.prompt) for j in group)
        pad = config.pad_token_id
        ids = torch.tensor([[pad] * (width - len(j.prompt)) + j.prompt for j in group])
        mask = torch.tensor([[0] * (width - len(j.prompt)) + [1] * len(j.prompt) for j in group])
        streamer = _FirstToken()
        out = model.generate(
            ids,
            attention_mask=mask,
            generation_config=_limited(config, max(j.max_new_tokens for j in group)),
            streamer=streamer,
        )
        for row, job in zip(out[:, width:].tolist(), group):
            row = row[: job.max_new_tokens]
            tokens.append(
                row[: row.index(config.eos_token_id) + 1] if config.eos_token_id in row else row
            )
            ttft.append(streamer.puts[1] - start - job.arrival)
        finished(len(tokens))
    return Served(tokens, ttft, time.perf_counter() - start - jobs[0].arrival)


def serve_hf_batching(
    model: Any,
    jobs: list[Job],
    config: Any,
    cb_config: Any,
    finished: Callable[[int], None] = _quiet,
) -> Served:
    """Jobs through HF's continuous batching manager, each added once its
    arrival has passed, with its own ``max_new_tokens`` (``finished`` hears
    how many are done as each ends)."""
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=cb_config
    )
    manager.start()
    try:
        start = time.perf_counter()
        for i, job in enumerate(jobs):
            time.sleep(max(0.0, job.arrival - (time.perf_counter() - start)))
            manager.add_request(
                job.prompt,
                request_id=str(i),
                max_new_tokens=job.max_new_tokens,
                record_timestamps=True,
            )
        results: dict[str, Any] = {}
        while len(results) < len(jobs):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("HF continuous batching returned no result within 600 s")
            if out.is_finished():
                results[out.request_id] = out
                finished(len(results))
        end = max(r.timestamps[-1] for r in results.values()) - start
    finally:
        manager.stop(block=True)
    outs = [results[str(i)] for i in range(len(jobs))]
    return Served(
        [list(o.generated_tokens) for o in outs],
        [o.timestamps[0] - start - j.arrival for o, j in zip(outs, jobs)],
        end - jobs[0].arrival,
    )


ARRIVALS = ("both", "at once", "staggered")


def run_mixed(
    *,
    quick: bool = False,
    rounds: int | None = None,
    prompts: int | None = None,
    arrivals: str = "both",
    stage: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Figures as a dict: per arrival pattern and path, its best round's
    seconds, tokens/s and TTFT (mean, p90), exact matches in every round,
    and each round's tokens/s ratio to the engine's in that round.
    ``rounds`` (default 3 with ``quick``, else 1) of every pattern and
    path, taken in turns. ``prompts`` serves the first that many of the
    workload's jobs (default all: 12 with ``quick``, else 64); ``arrivals``
    one pattern of ``ARRIVALS`` or both. ``stage`` hears what is running
    and how many requests it has finished."""
    rounds = (3 if quick else 1) if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"expected rounds >= 1, got {rounds}")
    if prompts is not None and prompts < 2:
        raise ValueError(f"expected prompts >= 2 or None, got {prompts}")
    if arrivals not in ARRIVALS:
        raise ValueError(f"expected arrivals among {ARRIVALS}, got {arrivals!r}")
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from mstar.engine import Engine, SamplingParams
    from mstar.models.loader import load

    stage("loading SmolLM2")
    model, tokenizer = load("smollm2")
    num, new_tokens, gap, batch = (12, (8, 32), 0.4, 6) if quick else (64, (16, 256), 0.3, 16)
    num = num if prompts is None else prompts
    eos = tokenizer.eos_token_id
    config = GenerationConfig(
        do_sample=False, eos_token_id=eos, pad_token_id=eos, max_new_tokens=new_tokens[1]
    )
    every = {"all at once": 0.0, f"staggered (mean gap {gap} s)": gap}
    patterns = {
        name: g
        for (name, g), which in zip(every.items(), ARRIVALS[1:])
        if arrivals in (which, "both")
    }
    workloads = {name: mixed_jobs(tokenizer, num, new_tokens, 0, g) for name, g in patterns.items()}
    jobs = next(iter(workloads.values()))  # the same prompts and limits in every pattern
    oracle = []
    for i, job in enumerate(jobs):
        stage(f"the oracle: HF generate on prompt {i + 1} of {num} alone")
        oracle.append(hf_one(model, job.prompt, _limited(config, job.max_new_tokens)))
    paged = copy.deepcopy(model)
    probe = Engine(paged, tokenizer)
    pages = sum(
        probe.peak_pages(len(j.prompt), SamplingParams(max_new_tokens=j.max_new_tokens))
        for j in jobs
    )
    cb_config = ContinuousBatchingConfig(  # sized like the engine's pool and budget
        page_size=probe.mgr.page_size, num_blocks=pages, max_batch_tokens=probe.budget
    )
    Serve = Callable[[list[Job], Callable[[int], None]], Served]
    paths: dict[str, Serve] = {
        "Engine.generate": lambda js, f: serve_engine(lambda: Engine(paged, tokenizer), js, f),
        f"HF generate (left-padded batches of {batch})": lambda js, f: serve_padded(
            model, js, config, batch, f
        ),
        "HF continuous batching": lambda js, f: serve_hf_batching(model, js, config, cb_config, f),
    }
    warm = [Job(j.prompt, 4, 0.0) for j in jobs[:4]]
    for name, serve in paths.items():
        stage(f"{name}: warm-up")
        serve(warm, _quiet)
    runs: dict[str, dict[str, list[Served]]] = {p: {n: [] for n in paths} for p in workloads}
    for r in range(rounds):  # in turns, so a change of load hits every path alike
        for pattern, pattern_jobs in workloads.items():
            for name, serve in paths.items():
                what = f"round {r + 1} of {rounds}, {pattern}: {name}"
                stage(what)
                runs[pattern][name].append(
                    serve(pattern_jobs, lambda k, w=what: stage(f"{w}, {k} of {num} done"))
                )
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "rounds": rounds}
    result["patterns"] = {pattern: _rows(by_path, oracle) for pattern, by_path in runs.items()}
    prompt_lens = [len(j.prompt) for j in jobs]
    result["workload"] = (
        f"{num} chat prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens (half behind a"
        f" {len(tokenizer(PREAMBLE)['input_ids'])}-token preamble), max_new_tokens"
        f" {new_tokens[0]}-{new_tokens[1]}, greedy, EOS on"
    )
    return result


def _rows(by_path: dict[str, list[Served]], oracle: list[list[int]]) -> list[dict[str, Any]]:
    """A row per path (the engine's first): its fastest round's figures,
    the jobs exact in every round, and ``ratio_range``: the least and most
    of the engine's tokens/s over this path's, round by round."""
    speeds = {
        name: [sum(map(len, s.tokens)) / s.seconds for s in served]
        for name, served in by_path.items()
    }
    ours = next(iter(speeds.values()))
    rows = []
    for name, served in by_path.items():
        best = min(served, key=lambda s: s.seconds)
        generated = sum(map(len, best.tokens))
        ratios = [o / t for o, t in zip(ours, speeds[name])]
        rows.append(
            {
                "path": name,
                "seconds": best.seconds,
                "tokens": generated,
                "tokens_per_s": generated / best.seconds,
                "ttft_mean": statistics.fmean(best.ttft),
                "ttft_p90": statistics.quantiles(best.ttft, n=10)[-1],
                "prompts": len(oracle),
                "exact": min(sum(t == w for t, w in zip(s.tokens, oracle)) for s in served),
                "ratio_range": (min(ratios), max(ratios)),
            }
        )
    return rows


def format_mixed(result: dict[str, Any]) -> str:
    """One table per arrival pattern: tokens/s, TTFT, ours against each path."""
    rounds = result.get("rounds", 1)
    lines = [
        f"{result['workload']} ({result['threads']} threads); exact: == HF generate alone"
        + (f"; best of {rounds} rounds in turns, per round: ours / this" if rounds > 1 else "")
    ]
    for pattern, rows in result["patterns"].items():
        lines += ["", pattern]
        lines.append(
            format_rows(
                rows,
                ("ttft mean s", lambda r: f"{r['ttft_mean']:.2f}"),
                ("ttft p90 s", lambda r: f"{r['ttft_p90']:.2f}"),
                *([("per round", _range)] if rounds > 1 else []),
            )
        )
    return "\n".join(lines)


def _range(row: dict[str, Any]) -> str:
    low, high = row["ratio_range"]
    return f"{low:.2f}-{high:.2f}x"


def _limited(config: Any, max_new_tokens: int) -> Any:
    """``config`` with its own ``max_new_tokens``."""
    limited = copy.copy(config)
    limited.max_new_tokens = max_new_tokens
    return limited
