"""``bench --roofline``'s arithmetic: the linear parameters a decode step
reads and the floor it cannot beat (no timing here)."""

from __future__ import annotations

import statistics

import pytest
import torch

from mstar.bench.roofline import (
    _Config,
    _time_forward,
    _turn,
    _x_turns,
    floor_s,
    format_roofline,
    linear_alone_s,
    linear_bytes,
    linear_modules,
    linear_parameters,
)
from mstar.models.seeded import build_model


def test_linear_parameters_count_a_tied_head_once():
    model = build_model(seed=0)[1]
    config = model.config
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    head = config.vocab_size * h
    assert linear_parameters(model) == layers * per_layer + head
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one read
    assert linear_parameters(model) == layers * per_layer + head


def test_the_floor_is_the_slower_of_reading_the_weights_and_multiplying():
    rates = {"read_bytes_s": 1e9, "gemm_flop_s_float32": 1e9, "gemm_flop_s_bfloat16": 4e9}
    assert floor_s(rates, 1000, torch.bfloat16, 1) == 2000 / 1e9  # bytes bound
    assert floor_s(rates, 1000, torch.float32, 1) == 4000 / 1e9
    assert floor_s(rates, 1000, torch.bfloat16, 100) == 2 * 100 * 1000 / 4e9  # compute bound


class QuantLinear(torch.nn.Module):
    """A stand-in for a quantized linear layer: packed bytes, no nn.Linear."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)


def test_linear_modules_take_any_linear_layer_and_its_own_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), QuantLinear(4, 6), torch.nn.ReLU())
    assert [type(m) for m in linear_modules(model)] == [torch.nn.Linear, QuantLinear]
    assert linear_parameters(model) == 8 * 4 + 4 * 6
    assert linear_bytes(model) == (8 * 4 + 4) * 4 + 6 * 2  # float32 weight + bias, packed bytes
    assert linear_alone_s(model, rows=3, repeats=1) >= 0
    rates = {"read_bytes_s": 1e9, "gemm_flop_s_float32": 1e12}
    assert floor_s(rates, 56, torch.float32, 1, weight_bytes=100) == 100 / 1e9


def test_linear_bytes_of_packed_layers_are_what_their_rows_read():
    from mstar.cpu.quant.at_load import quantize_int4
    from mstar.cpu.quant.linear import BF16_ROWS, PackedLinear
    from mstar.cpu.quant.packed import bf16_panels

    packed = quantize_int4(torch.randn(64, 96))
    stored = 64 * 48 + 2 * (64 * 3 * 2)  # nibbles, float16 scales and mins
    model = torch.nn.Sequential(PackedLinear(packed, None, bf16_panels(packed)))
    assert linear_bytes(model, rows=BF16_ROWS - 1) == stored
    assert linear_bytes(model, rows=BF16_ROWS) == 64 * 96 * 2  # the bfloat16 panels
    assert linear_bytes(torch.nn.Sequential(PackedLinear(packed)), rows=32) == stored


def test_the_table_names_the_cpu_the_read_probes_and_the_cold_step():
    pytest.importorskip("rich")
    from rich.console import Console

    row = dict(batch=1, config="bfloat16 gguf eager", step_s=4.84e-3, cold_step_s=5.86e-3,
               linear_s=4.5e-3, x_linear=1.08, floor_s=2.7e-3, x_own_floor=1.8,
               x_turns=1.1, turn_read_bytes_s=[31e9, 58e9],
               machine_floor_s=7.6e-3, x_floor=0.6, host_share=0.1)  # fmt: skip
    result = {
        "rates": {"read_bytes_s": 52e9, "gemm_flop_s_float32": 190e9},
        "read_probes": (41e9, 52e9),
        "cpu": "Some CPU (flags avx2)",
        "linear_parameters": 134e6,
        "rows": [row],
    }
    console = Console(width=200, record=True)
    console.print(format_roofline(result))
    text = " ".join(console.export_text().split())  # the title wraps at the table's width
    assert "read 52 GB/s (the better of 41 and 52)" in text
    assert "CPU: Some CPU (flags avx2)" in text
    assert "step ms ┃ cold ms" in text
    assert "│ 4.8 │ 5.9 │ 4.5 │ 1.08x │" in text  # the step, the cold step, the linear layers
    assert "in the steps' turns 31-58 GB/s (x turns)" in text
    assert (
        "│ 2.7 │ 1.8x │ 1.1x │ 7.6 │" in text
    )  # the floor, against the run's and the turns' reads


class _Engine:
    """An engine's step, its forward on ``_forward_step``: a forward's wall
    time reads as the step's number (the forward sets the clock it is timed by)."""

    def __init__(self, clock: list[float]) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 4))
        self.steps, self.clock = 0, clock
        self._forward_step = self._forward

    def _forward(self) -> None:
        self.steps += 1
        self.clock[0] += self.steps  # seconds "taken" by this forward

    def step(self) -> None:
        self._forward_step()


def test_a_turn_times_a_step_after_its_own_and_the_cold_one_apart(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("mstar.bench.roofline.time.perf_counter", lambda: clock[0])
    engine = _Engine(clock)
    config = _Config(torch.float32, "none", False, engine)
    _time_forward(config)
    reads = iter([30e9, 33e9, 55e9, 50e9])
    for _ in range(2):
        _turn(config, rows=2, probe=lambda: next(reads))
    assert engine.steps == 12  # six steps a turn
    assert config.cold_s == [1.0, 7.0]  # each turn's first step: after the others'
    assert config.step_s == [5.0, 6.0, 11.0, 12.0]  # its last two: settled after its own
    assert config.forward_s == config.step_s  # the host's share from the timed steps
    assert len(config.linear_s) == 2
    assert config.read_s == [33e9, 55e9]  # the better of two probes after each turn's steps
    # each step against the floor of its own turn's read: 1 GB read at 33, then 55 GB/s
    rates = {"read_bytes_s": 99e9, "gemm_flop_s_float32": 1e20}
    assert _x_turns(config, rates, 10, torch.float32, 2, 10**9) == pytest.approx(
        statistics.median([5 * 33, 6 * 33, 11 * 55, 12 * 55])
    )
