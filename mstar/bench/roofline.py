"""``mstar-kv bench --roofline``: decode steps against the machine's floor.

The floor of a decode step of ``B`` rows is ``max(weight bytes / read
bandwidth, 2 * B * linear parameters / peak GEMM rate)``: every linear
weight (the head included) is read once and multiplied by every row. Both
rates are measured in the same run (summing a large tensor; a 2048^3
matmul, 512^3 for an emulated bfloat16), in each dtype the run serves:
float32 and bfloat16 by default; on a CPU without a native bfloat16 matmul,
bfloat16 only as packed weights' arithmetic (an emulated bfloat16 engine at
batch 32 takes minutes a step), rated as float32; the machine's floor is
the lower of the dtypes'. Each (dtype, eager
or compiled) engine serves ``B`` decoding requests of SmolLM2 and steps in
turns with the others, so a busy moment of the machine falls on all of
them alike. A turn is six steps: the first timed as ``cold`` (it follows
the other engines' steps), three more untimed, then two timed as ``step``:
a serving loop's steps follow steps of their own engine, and a step after
another engine's is slower for a few (on Zen 4 at batch 1: 5.8, 5.4, 5.2,
then 4.9-5.1 ms from the fourth on, medians of 15 turns after a float32
engine's step). ``host`` is the share of a step spent outside the model's
forward (planning, sampling, detokenizing, completions). ``linear`` is the model's linear layers alone at the step's
rows (``linear_alone_s``: each ``linear_modules`` module called in turn on
``B`` rows, eager, timed in turns with the steps), so ``step / linear`` says
how much of a step is not its linear layers. The read bandwidth of a shared
machine moves within a run (29-59 GB/s seen on one VM, the two probes of
one run 33 and 59): ``x floor`` takes the better of the two probes (before
and after loading), ``x turns`` each timed step against a probe read right
after its turn's steps (the median over the steps), the floor of the
bandwidth the step had. Every table names the CPU (``mstar.cpu.info``).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.cpu.info import cpu_info
from mstar.engine import Engine, SamplingParams
from mstar.models.dtypes import native_cpu_bf16
from mstar.models.loader import load

PROMPT_TOKENS = 32
READ_BYTES = 1 << 29
SETTLE_STEPS = 3  # untimed steps a turn between the cold step and the timed ones
TIMED_STEPS = 2  # timed steps a turn


@dataclass
class _Config:
    dtype: torch.dtype  # the arithmetic's (bf16: bfloat16 whatever the load's)
    quantization: str  # the mode the load resolved to: none, gguf, int8, int4, bf16
    compiled: bool
    engine: Engine
    last_forward_s: float = 0.0  # the last step's forward
    step_s: list[float] = field(default_factory=list)  # steps after its own (``_turn``)
    cold_s: list[float] = field(default_factory=list)  # steps after the other configs'
    forward_s: list[float] = field(default_factory=list)  # the forwards of step_s's steps
    linear_s: list[float] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)  # bytes/s read right after each turn's steps

    @property
    def name(self) -> str:
        packed = "" if self.quantization == "none" else f" {self.quantization}"
        forward = "compiled" if self.compiled else "eager"
        return f"{str(self.dtype).removeprefix('torch.')}{packed} {forward}"


def machine_rates(
    repeats: int = 5, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
) -> dict[str, float]:
    """Read bandwidth (bytes/s) and peak GEMM rate (FLOP/s) per dtype of
    ``dtypes``, best of ``repeats``. A 2048^3 matmul, or 512^3 in a dtype
    the CPU has no native matmul for (bfloat16 on AVX2 is emulated: 2048^3
    takes minutes there)."""
    probe = read_probe()
    rates = {"read_bytes_s": max(probe() for _ in range(repeats))}
    del probe
    for dtype in dtypes:
        n = 512 if dtype == torch.bfloat16 and native_cpu_bf16() is None else 2048
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        seconds = _best(functools.partial(torch.mm, a, b), repeats)
        rates[f"gemm_flop_s_{str(dtype).removeprefix('torch.')}"] = 2 * n**3 / seconds
    return rates


def read_probe() -> Callable[[], float]:
    """A probe of the read bandwidth now (bytes/s: one sum of a float32
    tensor of ``READ_BYTES``, far past the caches, made once and summed once
    at the start)."""
    big = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    big.sum()

    def probe() -> float:
        start = time.perf_counter()
        big.sum()
        return READ_BYTES / (time.perf_counter() - start)

    return probe


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def linear_modules(model: Any) -> list[torch.nn.Module]:
    """The model's linear layers, each weight once (a head tied to the
    embedding counted once): ``nn.Linear`` and any module whose class name
    ends in ``Linear`` with ``in_features`` / ``out_features`` (a quantized
    linear layer)."""
    seen: set[int] = set()
    found = []
    for module in model.modules():
        linear = isinstance(module, torch.nn.Linear) or (
            type(module).__name__.endswith("Linear") and hasattr(module, "in_features")
        )
        if not linear:
            continue
        weight = getattr(module, "weight", None)
        key = id(weight) if isinstance(weight, torch.Tensor) else id(module)
        if key not in seen:
            seen.add(key)
            found.append(module)
    return found


def linear_parameters(model: Any) -> int:
    """Parameters of the model's linear layers (``in x out`` each), the head
    included once (tied to the embedding or not)."""
    return sum(m.in_features * m.out_features for m in linear_modules(model))


def linear_bytes(model: Any, rows: int = 1) -> int:
    """Bytes a decode step of ``rows`` rows reads of the linear layers'
    weights, each tensor once: their parameters and buffers (what a
    quantized layer stores), or what a layer says it reads at ``rows``
    (``read_tensors``: packed weights or, at many rows, bfloat16 panels)."""
    seen: set[int] = set()
    total = 0
    for module in linear_modules(model):
        reads = getattr(module, "read_tensors", None)
        tensors = reads(rows) if reads is not None else (
            *module.parameters(recurse=False), *module.buffers(recurse=False)
        )  # fmt: skip
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def linear_alone_s(
    model: Any, rows: int, repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds the model's linear layers alone take on ``rows`` rows (every
    ``linear_modules`` module called once in model order, the head included,
    as a decode step does), eager, without autograd; the median of
    ``repeats`` passes after a warm one, on ``clock``."""
    modules = linear_modules(model)
    param = next(model.parameters())
    inputs = {m.in_features: torch.randn(rows, m.in_features).to(param) for m in modules}
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = clock()
            for m in modules:
                m(inputs[m.in_features])
            times.append(clock() - start)
    return statistics.median(times[1:])


def floor_s(
    rates: dict[str, float],
    params: int,
    dtype: torch.dtype,
    rows: int,
    weight_bytes: int | None = None,
) -> float:
    """A decode step's floor: its weight bytes read once (``weight_bytes``,
    None: ``params`` in ``dtype``) or its GEMM FLOPs at the peak rate."""
    name = str(dtype).removeprefix("torch.")
    if weight_bytes is None:
        weight_bytes = params * torch.tensor([], dtype=dtype).element_size()
    compute = 2 * rows * params / rates[f"gemm_flop_s_{name}"]
    return max(weight_bytes / rates["read_bytes_s"], compute)


def run_roofline(
    batches: tuple[int, ...] = (1, 8, 32, 128),
    dtypes: tuple[torch.dtype, ...] | None = None,
    modes: tuple[bool, ...] = (False, True),
    steps: int = 10,
    stage: Callable[[str], None] = lambda _: None,
    quantizations: tuple[str, ...] = ("none",),
) -> dict:
    """The table's rows (one per batch and config) and the machine's rates;
    ``dtypes`` None: float32 and bfloat16, float32 alone without a native
    bfloat16 matmul; each dtype loaded as each of ``quantizations`` allows
    (``mstar.cpu.quant``: one that resolves to a config already there is
    left out)."""
    native = native_cpu_bf16() is not None
    # without a native bfloat16 matmul, bfloat16 by default only as packed weights'
    # arithmetic (float32 products, int16 activations), rated as float32
    emulated = dtypes is None and not native
    dtypes = dtypes or (torch.float32, torch.bfloat16)
    rated = (torch.float32,) if emulated else dtypes
    stage("measuring the machine's read bandwidth and peak GEMM")
    first = machine_rates(dtypes=rated)
    turns = -(-steps // TIMED_STEPS)
    # a decoding request's budget: it outlives the turns' steps
    new_tokens = turns * (1 + SETTLE_STEPS + TIMED_STEPS) + 8
    pages = max(batches) * -(-(PROMPT_TOKENS + new_tokens) // 16) + 64
    configs, params = [], 0
    for dtype in dtypes:
        for quantization in quantizations:
            for compiled in modes:
                stage(
                    f"loading SmolLM2 in {dtype}, {quantization}{', compiling' if compiled else ''}"
                )
                model, tokenizer = load("smollm2", dtype=dtype, quantization=quantization)
                mode = getattr(model, "mstar_quantization", "none").split(" ", 1)[0]
                if emulated and dtype == torch.bfloat16 and mode == "none":
                    continue  # an emulated bfloat16 engine: minutes a step at batch 32
                arithmetic = torch.bfloat16 if mode == "bf16" else dtype  # the panels' whatever
                if any(
                    (c.dtype, c.quantization, c.compiled) == (arithmetic, mode, compiled)
                    for c in configs
                ):
                    continue
                params = linear_parameters(model)
                engine = Engine(
                    model, tokenizer, num_pages=pages, prefix_cache=False, compile=compiled
                )
                configs.append(_Config(arithmetic, mode, compiled, engine))
                _time_forward(configs[-1])
    stage("measuring the machine's read bandwidth and peak GEMM again")
    # the better of two measurements: a busy moment of a shared machine lowers one
    second = machine_rates(dtypes=rated)
    rates = {k: max(v, first[k]) for k, v in second.items()}
    best_floor = {b: min(floor_s(rates, params, d, b) for d in rated) for b in batches}
    rows = []
    probe = read_probe()
    for batch in batches:
        stage(f"batch {batch}: prefill")
        for c in configs:
            _start(c.engine, batch, new_tokens)
        stage(f"batch {batch}: {steps} decode steps per config, in turns")
        for c in configs:
            for times in (c.step_s, c.cold_s, c.forward_s, c.linear_s, c.read_s):
                times.clear()
        for _ in range(turns):
            for c in configs:
                _turn(c, batch, probe)
        for c in configs:
            step = statistics.median(c.step_s)
            forward = statistics.median(c.forward_s)
            linear = statistics.median(c.linear_s)
            arithmetic = torch.float32 if emulated else c.dtype
            weight_bytes = linear_bytes(c.engine.model, batch)
            own_floor = floor_s(rates, params, arithmetic, batch, weight_bytes)
            x_turns = _x_turns(c, rates, params, arithmetic, batch, weight_bytes)
            rows.append(
                {
                    "batch": batch,
                    "config": c.name,
                    "step_s": step,
                    "cold_step_s": statistics.median(c.cold_s),
                    "linear_s": linear,
                    "x_linear": step / linear,
                    "host_share": max(step - forward, 0.0) / step,
                    "floor_s": own_floor,
                    "x_own_floor": step / own_floor,
                    "x_turns": x_turns,
                    "turn_read_bytes_s": list(c.read_s),
                    "machine_floor_s": best_floor[batch],
                    "x_floor": step / best_floor[batch],
                    "compiled": c.engine.compiled,
                }
            )
            for rid in list(c.engine._running):
                c.engine.abort(rid)
    cpu = cpu_info()
    return {
        "cpu": cpu.describe(),
        "cpu_family": cpu.family,
        "rates": rates,
        # both read probes: a shared machine's rate moves from run to run (31-59 GB/s seen)
        "read_probes": (first["read_bytes_s"], second["read_bytes_s"]),
        "linear_parameters": params,
        "rows": rows,
    }


def _turn(config: _Config, rows: int, probe: Callable[[], float]) -> None:
    """One turn of ``config`` (its forward timed by ``_time_forward``): a
    step after the other configs' work (``cold_s``), ``SETTLE_STEPS``
    untimed, ``TIMED_STEPS`` timed (``step_s``, their forwards in
    ``forward_s``), the read bandwidth then (``read_s``: the better of two
    ``probe`` calls), then its linear layers alone at ``rows`` rows
    (``linear_s``)."""
    config.cold_s.append(_timed_step(config.engine))
    for _ in range(SETTLE_STEPS):
        config.engine.step()
    for _ in range(TIMED_STEPS):
        config.step_s.append(_timed_step(config.engine))
        config.forward_s.append(config.last_forward_s)
    config.read_s.append(max(probe(), probe()))  # the first may share a core with the kernels' spin
    config.linear_s.append(linear_alone_s(config.engine.model, rows, repeats=1))


def _x_turns(
    config: _Config,
    rates: dict[str, float],
    params: int,
    dtype: torch.dtype,
    rows: int,
    weight_bytes: int,
) -> float:
    """The median over ``config``'s timed steps of each step's time against
    its floor (``floor_s``) at the read rate probed right after its turn's
    steps (``read_s``)."""
    reads = [read for read in config.read_s for _ in range(TIMED_STEPS)]
    return statistics.median(
        step / floor_s({**rates, "read_bytes_s": read}, params, dtype, rows, weight_bytes)
        for step, read in zip(config.step_s, reads, strict=True)
    )


def _timed_step(engine: Engine) -> float:
    """Seconds one ``engine.step()`` takes."""
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _time_forward(config: _Config) -> None:
    """Keep each forward's wall time (to tell the host's share of a step)."""
    forward = config.engine._forward_step

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        config.last_forward_s = time.perf_counter() - start
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
    gemm = " / ".join(
        f"{v / 1e9:.0f} ({k.removeprefix('gemm_flop_s_')})"
        for k, v in r.items()
        if k.startswith("gemm_flop_s_")
    )
    both = result.get("read_probes")
    probes = "" if both is None else f" (the better of {both[0] / 1e9:.0f} and {both[1] / 1e9:.0f})"
    title = (
        f"decode steps of SmolLM2 ({result['linear_parameters'] / 1e6:.0f}M linear parameters)"
        f" vs the machine's floor: read {r['read_bytes_s'] / 1e9:.0f} GB/s{probes}, GEMM {gemm} GFLOP/s"
    )
    turns = [r for row in result["rows"] for r in row.get("turn_read_bytes_s", ())]
    if turns:
        title += (
            f"; in the steps' turns {min(turns) / 1e9:.0f}-{max(turns) / 1e9:.0f} GB/s (x turns)"
        )
    title += f"\nCPU: {result['cpu']}"
    table = Table(title=title, min_width=100)
    # floor: of this config's own weight bytes; machine: the best dtype's (see the module)
    for col in ("batch", "config", "step ms", "cold ms", "linear ms", "x linear",
                "floor ms", "x floor", "x turns", "mach. ms", "x mach.", "host %"):  # fmt: skip
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for row in result["rows"]:
        table.add_row(
            str(row["batch"]), row["config"], f"{row['step_s'] * 1e3:.1f}",
            f"{row['cold_step_s'] * 1e3:.1f}", f"{row['linear_s'] * 1e3:.1f}",
            f"{row['x_linear']:.2f}x",
            f"{row['floor_s'] * 1e3:.1f}", f"{row['x_own_floor']:.1f}x", f"{row['x_turns']:.1f}x",
            f"{row['machine_floor_s'] * 1e3:.1f}", f"{row['x_floor']:.1f}x",
            f"{row['host_share'] * 100:.0f}",
        )  # fmt: skip
    return table
