"""``mstar-kv bench --roofline``: decode steps against the machine's floor.

The floor of a decode step of ``B`` rows is ``max(weight bytes / read
bandwidth, 2 * B * linear parameters / peak GEMM rate)``: every linear
weight (the head included) is read once and multiplied by every row. Both
rates are measured in the same run (summing a large tensor; a 2048^3
matmul), in float32 and bfloat16; the machine's floor is the lower of the
two dtypes'. Each (dtype, eager or compiled) engine serves ``B`` decoding
requests of SmolLM2 and steps in turns with the others, so a busy moment
of the machine falls on all of them alike. ``host`` is the share of a step
spent outside the model's forward (planning, sampling, detokenizing,
completions).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.engine import Engine, SamplingParams
from mstar.engine.loader import load

PROMPT_TOKENS = 32
READ_BYTES = 1 << 29


@dataclass
class _Config:
    dtype: torch.dtype
    compiled: bool
    engine: Engine
    forward_s: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return (
            f"{str(self.dtype).removeprefix('torch.')} {'compiled' if self.compiled else 'eager'}"
        )


def machine_rates(repeats: int = 5) -> dict[str, float]:
    """Read bandwidth (bytes/s) and peak GEMM rate (FLOP/s) per dtype, best of ``repeats``."""
    big = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    rates = {"read_bytes_s": READ_BYTES / _best(big.sum, repeats)}
    del big
    n = 2048
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        seconds = _best(functools.partial(torch.mm, a, b), repeats)
        rates[f"gemm_flop_s_{str(dtype).removeprefix('torch.')}"] = 2 * n**3 / seconds
    return rates


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def linear_parameters(model: Any) -> int:
    """Parameters of the model's linear layers, the head included once
    (tied to the embedding or not)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


def floor_s(rates: dict[str, float], params: int, dtype: torch.dtype, rows: int) -> float:
    name = str(dtype).removeprefix("torch.")
    weights = params * torch.tensor([], dtype=dtype).element_size()
    return max(weights / rates["read_bytes_s"], 2 * rows * params / rates[f"gemm_flop_s_{name}"])


def run_roofline(
    batches: tuple[int, ...] = (1, 8, 32, 128),
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    modes: tuple[bool, ...] = (False, True),
    steps: int = 10,
    stage: Callable[[str], None] = lambda _: None,
) -> dict:
    """The table's rows (one per batch and config) and the machine's rates."""
    stage("measuring the machine's read bandwidth and peak GEMM")
    first = machine_rates()
    new_tokens = steps + 8  # a decoding request's budget: it outlives the timed steps
    pages = max(batches) * -(-(PROMPT_TOKENS + new_tokens) // 16) + 64
    configs, params = [], 0
    for dtype in dtypes:
        for compiled in modes:
            stage(f"loading SmolLM2 in {dtype}{', compiling' if compiled else ''}")
            model, tokenizer = load("smollm2", dtype=dtype)
            params = linear_parameters(model)
            engine = Engine(model, tokenizer, num_pages=pages, prefix_cache=False, compile=compiled)
            configs.append(_Config(dtype, compiled, engine))
            _time_forward(configs[-1])
    stage("measuring the machine's read bandwidth and peak GEMM again")
    # the better of two measurements: a busy moment of a shared machine lowers one
    rates = {k: max(v, first[k]) for k, v in machine_rates().items()}
    best_floor = {b: min(floor_s(rates, params, d, b) for d in dtypes) for b in batches}
    rows = []
    for batch in batches:
        stage(f"batch {batch}: prefill")
        for c in configs:
            _start(c.engine, batch, new_tokens)
        stage(f"batch {batch}: {steps} decode steps per config, in turns")
        times: dict[str, list[float]] = {c.name: [] for c in configs}
        for c in configs:
            c.forward_s.clear()
        for _ in range(steps):
            for c in configs:
                start = time.perf_counter()
                c.engine.step()
                times[c.name].append(time.perf_counter() - start)
        for c in configs:
            step = statistics.median(times[c.name])
            forward = statistics.median(c.forward_s)
            rows.append(
                {
                    "batch": batch,
                    "config": c.name,
                    "step_s": step,
                    "host_share": max(step - forward, 0.0) / step,
                    "floor_s": floor_s(rates, params, c.dtype, batch),
                    "machine_floor_s": best_floor[batch],
                    "x_floor": step / best_floor[batch],
                    "compiled": c.engine.compiled,
                }
            )
            for rid in list(c.engine._running):
                c.engine.abort(rid)
    return {"rates": rates, "linear_parameters": params, "rows": rows}


def _time_forward(config: _Config) -> None:
    """Record each forward's wall time (to tell the host's share of a step)."""
    forward = config.engine._forward_step

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        config.forward_s.append(time.perf_counter() - start)
        return out

    config.engine._forward_step = timed


def _start(engine: Engine, batch: int, new_tokens: int) -> None:
    """``batch`` requests, prefilled, each past its first decode step."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    until = engine.stats.prefill_tokens + batch * PROMPT_TOKENS
    for i in range(batch):
        engine.add_request([(7 * i + j) % vocab for j in range(PROMPT_TOKENS)], params)
    while engine.stats.prefill_tokens < until:
        engine.step()
    engine.step()


def format_roofline(result: dict) -> Any:
    """A rich table of the rows."""
    from rich.table import Table

    r = result["rates"]
    title = (
        f"decode steps of SmolLM2 ({result['linear_parameters'] / 1e6:.0f}M linear parameters)"
        f" vs the machine's floor: read {r['read_bytes_s'] / 1e9:.0f} GB/s, GEMM"
        f" {r['gemm_flop_s_float32'] / 1e9:.0f} (float32) / {r['gemm_flop_s_bfloat16'] / 1e9:.0f}"
        " (bfloat16) GFLOP/s"
    )
    table = Table(title=title, min_width=100)
    for col in ("batch", "config", "step ms", "floor ms (dtype)", "machine floor ms", "x floor",
                "host %"):  # fmt: skip
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for row in result["rows"]:
        table.add_row(
            str(row["batch"]), row["config"], f"{row['step_s'] * 1e3:.1f}",
            f"{row['floor_s'] * 1e3:.1f}", f"{row['machine_floor_s'] * 1e3:.1f}",
            f"{row['x_floor']:.1f}x", f"{row['host_share'] * 100:.0f}",
        )  # fmt: skip
    return table
