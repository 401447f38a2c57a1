"""``bench --roofline``'s arithmetic: the linear parameters a decode step
reads and the floor it cannot beat (no timing here)."""

from __future__ import annotations

import pytest
import torch

from mstar.bench.roofline import (
    floor_s,
    format_roofline,
    linear_alone_s,
    linear_bytes,
    linear_modules,
    linear_parameters,
)
from mstar.demo import build_model


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
    from mstar.engine.quant.at_load import quantize_int4
    from mstar.engine.quant.linear import BF16_ROWS, PackedLinear
    from mstar.engine.quant.packed import bf16_panels

    packed = quantize_int4(torch.randn(64, 96))
    stored = 64 * 48 + 2 * (64 * 3 * 2)  # nibbles, float16 scales and mins
    model = torch.nn.Sequential(PackedLinear(packed, None, bf16_panels(packed)))
    assert linear_bytes(model, rows=BF16_ROWS - 1) == stored
    assert linear_bytes(model, rows=BF16_ROWS) == 64 * 96 * 2  # the bfloat16 panels
    assert linear_bytes(torch.nn.Sequential(PackedLinear(packed)), rows=32) == stored


def test_the_title_names_the_cpu_and_both_read_probes():
    pytest.importorskip("rich")
    from rich.console import Console

    result = {
        "rates": {"read_bytes_s": 52e9, "gemm_flop_s_float32": 190e9},
        "read_probes": (41e9, 52e9),
        "cpu": "Some CPU (flags avx2)",
        "linear_parameters": 134e6,
        "rows": [],
    }
    console = Console(width=200, record=True)
    console.print(format_roofline(result))
    text = " ".join(console.export_text().split())  # the title wraps at the table's width
    assert "read 52 GB/s (the better of 41 and 52)" in text
    assert "CPU: Some CPU (flags avx2)" in text
