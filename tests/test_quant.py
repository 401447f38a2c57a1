"""Quantized weights (mstar.cpu.quant): GGUF blocks decoded bit for bit,
the packed linear kernels against F.linear on the dequantized weights, the
float32 fallback, the engine on SmolLM2's own Q4_1/Q8_0 weights, float
weights held as bfloat16 panels (bf16), refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks as random_k_blocks

from mstar.cpu import build as cpp_build
from mstar.cpu.quant import QuantChoice, quantize_model, resolve_quantization
from mstar.cpu.quant.at_load import quantize_int4, quantize_int8
from mstar.cpu.quant.gguf import BLOCK_BYTES, decode_blocks
from mstar.cpu.quant.kernels import SOURCE, bf16_or_why, build_under, kernel_or_why
from mstar.cpu.quant.linear import BF16_ROWS, PackedLinear
from mstar.cpu.quant.packed import Packed, bf16_panels, pack_bf16, pack_int4
from mstar.engine import Engine, SamplingParams
from mstar.models.loader import model_folder
from mstar.models.seeded import build_model

gguf = pytest.importorskip("gguf")


def random_blocks(type_name: str, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows of random blocks with finite float16 scales (and mins)."""
    rng = np.random.default_rng(seed)
    size = BLOCK_BYTES[type_name]
    blocks = rng.integers(0, 256, (rows, width // 32, size), dtype=np.uint8)
    halves = 2 if type_name == "Q4_1" else 1
    scales = rng.normal(0, 0.05, (rows, width // 32, halves)).astype(np.float16)
    blocks[:, :, : 2 * halves] = scales.view(np.uint8).reshape(rows, width // 32, 2 * halves)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_as_gguf_dequantizes_bit_for_bit(type_name):
    data = random_blocks(type_name, 12, 96)
    ours = decode_blocks(type_name, data).dequantize()
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    assert ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(theirs))


@pytest.mark.parametrize(
    ("type_name", "kind", "per_scale"),
    [("Q4_K", "int4", 32), ("Q5_K", "int8", 32), ("Q6_K", "int8", 16)],
)
def test_k_quant_super_blocks_decode_as_gguf_dequantizes_bit_for_bit(type_name, kind, per_scale):
    """Q4_K as int4, Q5_K and Q6_K as int8, float32 scales (and minimums) per
    sub-block: every bit pattern of the packed six-bit scales (random
    bytes), three super-blocks a row, several rows."""
    data = random_k_blocks(type_name, 12, 768, np.random.default_rng(3))
    packed = decode_blocks(type_name, data)
    assert packed.kind == kind and packed.scales.dtype == torch.float32
    assert packed.scales.shape == (12, 768 // per_scale)
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    assert torch.equal(packed.dequantize(), torch.from_numpy(theirs))


def test_decode_blocks_refuses_a_type_it_does_not_pack():
    types = "Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K"
    with pytest.raises(ValueError, match=f"expected a GGUF type of {types}, got Q3_K"):
        decode_blocks("Q3_K", np.zeros((1, 110), np.uint8))


def test_smollm2_file_tensors_decode_bit_for_bit():
    from mstar.models.loader import smollm2_path

    try:
        reader = gguf.GGUFReader(smollm2_path())
    except FileNotFoundError as err:
        pytest.skip(str(err))
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in BLOCK_BYTES and kind not in seen:
            seen.add(kind)
            ours = decode_blocks(kind, tensor.data).dequantize()
            theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            assert torch.equal(ours, torch.from_numpy(theirs)), tensor.name
    assert seen == {"Q4_1", "Q8_0"}


def random_packed(kind: str, rows: int, width: int, seed: int = 0) -> Packed:
    g = torch.Generator().manual_seed(seed)
    groups = width // 32
    if kind == "int4":
        q = torch.randint(0, 16, (rows, width), generator=g)
        return pack_int4(
            q, torch.rand(rows, groups, generator=g) / 10, -torch.rand(rows, groups, generator=g)
        )
    q = torch.randint(-128, 128, (rows, width), generator=g, dtype=torch.int8)
    return Packed("int8", q, (torch.rand(rows, groups, generator=g) / 100).half())


@pytest.fixture(scope="module")
def kernels():
    why = kernel_or_why()
    if why is not None:
        pytest.skip(why)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("shape", [(12, 96), (200, 1088), (4, 32)])
@pytest.mark.parametrize("batch", [1, 3, 5, 32])
def test_packed_linear_matches_f_linear_on_the_dequantized_weights(kernels, kind, shape, batch):
    packed = random_packed(kind, *shape)
    x = torch.randn(batch, shape[1], generator=torch.Generator().manual_seed(1))
    y = PackedLinear(packed)(x)
    expected = F.linear(x.double(), packed.dequantize().double())
    assert y.shape == (batch, shape[0]) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


BATCHES = [*range(1, 10), 32, 200]


@pytest.fixture(scope="module", params=["this CPU's build", "AVX2 build"])
def ops(request, kernels):
    """The kernels' ops as built for this CPU, and (where that build is not the
    AVX2 one, e.g. with AVX-512) the same source built for AVX2 alone under its
    own namespace, so both code paths are checked on this machine."""
    if request.param == "this CPU's build":
        return torch.ops.mstar_quant
    if cpp_build.flags() == cpp_build.FLAGS:
        pytest.skip("this CPU's build is the AVX2 build")
    return build_under("mstar_quant_avx2", SOURCE.read_text(), cpp_build.FLAGS)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("shape", [(52, 576), (36, 1536), (4, 32), (20, 96), (460, 576)])
def test_every_kernel_path_matches_f_linear_on_the_dequantized_weights(ops, kind, shape):
    """1-4 rows (1-8 with AVX-512) stream the weights, more go through dequantized tiles or 16- or
    32-row panels (52, 36, 20: a partial last panel; 460 x 576: enough weights to share among threads); the
    activations arrive non-contiguous (every other column)."""
    packed = random_packed(kind, *shape, seed=shape[0])
    weight = packed.dequantize().double()
    g = torch.Generator().manual_seed(3)
    for batch in BATCHES:
        x = torch.randn(batch, 2 * shape[1], generator=g)[:, ::2]
        assert not x.is_contiguous()
        if kind == "int4":
            y = ops.int4_linear(x, packed.qweight, packed.scales, packed.mins)
        else:
            y = ops.int8_linear(x, packed.qweight, packed.scales)
        expected = F.linear(x.double(), weight)
        assert y.shape == (batch, shape[0])
        torch.testing.assert_close(
            y.double(),
            expected,
            rtol=1e-5,
            atol=1e-5 * expected.abs().max(),
            msg=lambda text, batch=batch: f"{batch} rows: {text}",
        )


def _packed_call_in_child(conn, packed, x) -> None:
    conn.send(PackedLinear(packed)(x).tolist())  # plain values: the child exits first
    conn.close()


def test_a_forked_child_shares_the_kernels_work_with_threads_of_its_own(kernels):
    """The kernels' helper threads are the process's: a child forked after the
    parent used them (a server's workers) builds its own instead of waiting on
    threads it does not have, and answers the same."""
    import multiprocessing

    packed = random_packed("int4", 4096, 576)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(2))
    want = PackedLinear(packed)(x)  # the parent's threads now exist
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_packed_call_in_child, args=(child, packed, x))
    process.start()
    process.join(60)
    if process.is_alive():
        process.kill()
    assert process.exitcode == 0 and parent.poll(5)
    assert parent.recv() == want.tolist()


def test_packed_linear_keeps_leading_dims_and_adds_its_bias(kernels):
    packed = random_packed("int4", 8, 64)
    bias = torch.randn(8)
    x = torch.randn(2, 3, 64)
    y = PackedLinear(packed, bias)(x)
    torch.testing.assert_close(y, F.linear(x, packed.dequantize(), bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 3, 5, 64])
def test_int8_per_channel_scales(kernels, batch):
    w = torch.randn(20, 64)
    packed = quantize_int8(w)
    assert packed.scales.shape == (20, 1)
    x = torch.randn(batch, 64)
    torch.testing.assert_close(PackedLinear(packed)(x), F.linear(x, packed.dequantize()))


@pytest.mark.parametrize("quantize,tolerance", [(quantize_int8, 0.01), (quantize_int4, 0.1)])
def test_quantized_at_load_stays_close_to_the_float_weights(quantize, tolerance):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    error = (quantize(w).dequantize() - w).abs().max() / w.abs().max()
    assert 0 < error < tolerance


def tiny(seed: int = 0) -> torch.nn.Module:
    return build_model(seed)[1].eval()


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tiny_model_quantized_matches_its_dequantized_twin(kernels, mode):
    model = tiny()
    description = quantize_model(model, QuantChoice(mode, "as asked"))
    assert description.startswith(f"{mode} (as asked): 15 layers {mode}")
    assert isinstance(model.lm_head, PackedLinear)
    assert not isinstance(model.get_input_embeddings(), PackedLinear)
    twin = tiny()
    for name, mod in model.named_modules():
        if isinstance(mod, PackedLinear):
            twin.get_submodule(name).weight = torch.nn.Parameter(mod.packed().dequantize())
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(model, ids), logits(twin, ids), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(model, ids), logits(tiny(), ids), atol=1e-6)


def test_without_the_kernels_the_layers_stay_float32_with_the_same_values(monkeypatch, kernels):
    import mstar.cpu.quant as quant

    fast = tiny()
    quantize_model(fast, QuantChoice("int4", "as asked"))
    monkeypatch.setattr(quant, "kernel_or_why", lambda: "no AVX2 here")
    slow = tiny()
    embedding = slow.get_input_embeddings().weight.clone()
    description = quantize_model(slow, QuantChoice("int4", "as asked"))
    assert description.endswith("run as float32 (dequantized): no AVX2 here")
    assert not any(isinstance(m, PackedLinear) for m in slow.modules())
    assert torch.equal(slow.get_input_embeddings().weight, embedding)  # tied head untied
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(slow, ids), logits(fast, ids), rtol=1e-4, atol=1e-4)


def test_compiled_forward_traces_through_the_kernels(kernels):
    model = tiny()
    quantize_model(model, QuantChoice("int4", "as asked"))
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    eager = logits(model, ids)
    compiled = torch.compile(model.forward, dynamic=True, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, eager, rtol=1e-5, atol=1e-5)


def test_int4_refuses_a_width_not_divisible_by_32():
    model = build_model(0, hidden_size=40, num_attention_heads=4, num_key_value_heads=2)[1]
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_model(model, QuantChoice("int4", "as asked"))
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize(
    "value,kwargs,match",
    [
        ("q4", {}, "got 'q4'"),
        (None, {}, "got None"),
        ("gguf", {"gguf": False}, "needs a GGUF file"),
        ("int4", {"dtype": torch.float16}, "float32 activations, not float16"),
        ("int8", {"tensor_parallel_size": 2}, "tensor parallelism"),
        ("gguf", {"device": "cuda"}, "not cuda"),
    ],
)
def test_bad_or_inapplicable_quantization_is_refused(value, kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(value, **{"gguf": True, **kwargs})


def test_auto_is_the_files_own_format_where_the_kernels_serve_it(monkeypatch):
    import mstar.cpu.quant as quant

    assert resolve_quantization("auto", gguf=True) == QuantChoice(
        "gguf", "auto: the file's own format", "float32"
    )
    assert resolve_quantization("auto", gguf=False).mode == "none"
    assert resolve_quantization("auto", gguf=True, tensor_parallel_size=2).mode == "none"
    # bfloat16 arithmetic on any CPU the kernels run on: the panels where it has
    # AVX512-BF16, int16 activations wherever (see quantize_model)
    for why in (None, "the CPU lacks AVX512-BF16"):
        monkeypatch.setattr(quant, "bf16_or_why", lambda why=why: why)
        choice = resolve_quantization("auto", gguf=True, dtype=torch.bfloat16)
        assert (choice.mode, choice.arithmetic) == ("gguf", "bfloat16")
        assert (
            resolve_quantization("int4", gguf=True, dtype=torch.bfloat16).arithmetic == "bfloat16"
        )


def test_engine_refuses_a_bad_quantization_before_loading():
    with pytest.raises(ValueError, match="got 'int3'"):
        Engine.from_pretrained("smollm2", quantization="int3")


def test_engine_on_smollm2s_own_weights_answers_as_float32(smollm2, kernels):
    model, tokenizer = smollm2
    prompts = ["What is the capital of France?", "Name three colors."]
    params = SamplingParams(max_new_tokens=12)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    with Engine(copy.deepcopy(model), tokenizer) as engine:
        expected = [c.outputs[0].token_ids for c in engine.chat(chats, params)]
    with Engine.from_pretrained("smollm2", quantization="gguf") as engine:
        assert engine.model.mstar_quantization == (
            "gguf (as asked): 210 layers int4 (Q4_1), 1 layer int8 (Q8_0)"
        )
        assert isinstance(engine.model.model.layers[0].mlp.down_proj, PackedLinear)
        got = [c.outputs[0].token_ids for c in engine.chat(chats, params)]
    assert got == expected


def test_bf16_panels_hold_each_weight_rounded_at_its_place():
    packed = random_packed("int4", 64, 96, seed=5)
    panels = bf16_panels(packed)
    weight = packed.dequantize()
    assert panels.shape == (2, 48, 32, 2) and panels.dtype == torch.bfloat16
    for p, j, r, i in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 47, 31, 1), (1, 3, 5, 0), (0, 20, 17, 1)]:
        assert panels[p, j, r, i] == weight[32 * p + r, 2 * j + i].bfloat16()
    assert torch.equal(panels.permute(0, 2, 1, 3).reshape(64, 96), weight.bfloat16())
    with pytest.raises(ValueError, match="rows divisible by 32 for bfloat16 panels, got 36"):
        bf16_panels(random_packed("int4", 36, 96))


@pytest.fixture(scope="module")
def bf16(kernels):
    if (why := bf16_or_why()) is not None:
        pytest.skip(why)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("shape", [(32, 96), (64, 576), (96, 1536), (1024, 576)])
def test_bf16_linear_matches_f_linear_on_bfloat16_rounded_inputs(bf16, kind, shape):
    """Every row count (6-row micro-kernels and the rest), activations
    non-contiguous, enough weights (1024 x 576) to share among threads: the
    products of the bfloat16-rounded activations and weights, summed in float32."""
    packed = random_packed(kind, *shape, seed=shape[0])
    panels = bf16_panels(packed)
    weight = packed.dequantize().bfloat16().double()
    g = torch.Generator().manual_seed(4)
    for batch in BATCHES:
        x = torch.randn(batch, 2 * shape[1], generator=g)[:, ::2]
        y = torch.ops.mstar_quant.bf16_linear(x, panels)
        expected = F.linear(x.bfloat16().double(), weight)
        assert y.shape == (batch, shape[0]) and y.dtype == torch.float32
        torch.testing.assert_close(
            y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
        )


def test_bf16_linear_refuses_what_is_not_its_panels(bf16):
    panels = bf16_panels(random_packed("int4", 32, 96))
    with pytest.raises(RuntimeError, match="activations of width 96, got 64"):
        torch.ops.mstar_quant.bf16_linear(torch.randn(2, 64), panels)
    with pytest.raises(RuntimeError, match="expected float32 activations"):
        torch.ops.mstar_quant.bf16_linear(torch.randn(2, 96).double(), panels)
    with pytest.raises(RuntimeError, match="contiguous bfloat16 panels"):
        torch.ops.mstar_quant.bf16_linear(torch.randn(2, 96), panels.float())


def test_packed_linear_multiplies_in_bfloat16_from_bf16_rows(bf16):
    """Fewer rows than ``BF16_ROWS`` stream the packed weights (float32
    arithmetic, as without panels); more take the panels; the bias is added
    either way and leading dims are kept."""
    packed = random_packed("int4", 64, 576, seed=6)
    bias = torch.randn(64)
    plain, panelled = PackedLinear(packed, bias), PackedLinear(packed, bias, bf16_panels(packed))
    assert (plain.arithmetic, panelled.arithmetic) == ("float32", "bfloat16")
    g = torch.Generator().manual_seed(7)
    for rows in range(1, BF16_ROWS + 3):
        x = torch.randn(1, rows, 576, generator=g)
        y = panelled(x)
        assert y.shape == (1, rows, 64)
        if rows < BF16_ROWS:
            assert torch.equal(y, plain(x))
        else:
            expected = F.linear(x.bfloat16().double(), packed.dequantize().bfloat16().double())
            torch.testing.assert_close(y.double(), expected + bias.double(), rtol=1e-5, atol=1e-4)
            assert not torch.equal(y, plain(x))


def test_tiny_model_in_bfloat16_arithmetic_stays_near_its_dequantized_twin(bf16):
    model = tiny()
    description = quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    assert description.endswith(
        "15 layers int4; int16 activations at 1-8 rows (the 15 int4 layers) (15 of them on"
        f" lanes, 16 rows a vector), {BF16_ROWS}+ rows multiply in bfloat16"
    )
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(m.arithmetic == "bfloat16+int16" for m in layers)
    twin = tiny()
    for name, mod in model.named_modules():
        if isinstance(mod, PackedLinear):
            twin.get_submodule(name).weight = torch.nn.Parameter(mod.packed().dequantize())
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    ours, theirs = logits(model, ids), logits(twin, ids)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05)
    assert not torch.allclose(ours, theirs, atol=1e-6)  # bfloat16, not float32


def test_compiled_forward_traces_through_the_bf16_kernel(bf16):
    model = tiny()
    quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    ids = torch.randint(0, 256, (1, BF16_ROWS + 2), generator=torch.Generator().manual_seed(3))
    eager = logits(model, ids)
    compiled = torch.compile(model.forward, dynamic=True, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, eager, rtol=1e-5, atol=1e-5)


def test_layers_of_rows_not_a_multiple_of_32_keep_float32_products_and_are_named(bf16):
    model = build_model(0, num_key_value_heads=1)[1].eval()  # k/v: 16 rows
    description = quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    odd = [
        n for n, m in model.named_modules() if isinstance(m, PackedLinear) and m.out_features % 32
    ]
    assert odd and all(n.endswith(("k_proj", "v_proj")) for n in odd)
    assert all(model.get_submodule(n).arithmetic == "int16" for n in odd)
    assert f"{BF16_ROWS}+ rows multiply in bfloat16 (float32 for {', '.join(odd)}: rows not a" in (
        description
    )
    x = torch.randn(BF16_ROWS, 64)
    layer = model.get_submodule(odd[0])
    assert torch.equal(
        layer(x), torch.ops.mstar_quant.int4_linear(x, *layer.read_tensors(BF16_ROWS))
    )


def test_packed_linear_refuses_panels_of_other_weights():
    packed = random_packed("int4", 64, 96)
    with pytest.raises(ValueError, match=r"expected bfloat16 panels of shape \[2, 48, 32, 2\]"):
        PackedLinear(packed, None, bf16_panels(random_packed("int4", 32, 96)))
    with pytest.raises(ValueError, match="got float32"):
        PackedLinear(packed, None, bf16_panels(packed).float())
    assert PackedLinear(packed, None, bf16_panels(packed)).arithmetic == "bfloat16"


def test_auto_holds_float_weights_in_bfloat16_arithmetic_as_panels(monkeypatch):
    """Float weights (not a GGUF file) in bfloat16 arithmetic: bf16 panels
    where the kernels have them; float32 stays exact (none), and ``none``,
    tensor parallelism or a CPU without AVX512-BF16 keep the float weights,
    the reason saying why; ``bf16`` asked is that or refused."""
    import mstar.cpu.quant as quant

    monkeypatch.setattr(quant, "kernel_or_why", lambda: None)
    monkeypatch.setattr(quant, "bf16_or_why", lambda: None)
    choice = resolve_quantization("auto", gguf=False, dtype=torch.bfloat16)
    assert (choice.mode, choice.arithmetic) == ("bf16", "bfloat16")
    assert resolve_quantization("auto", gguf=False).mode == "none"
    assert resolve_quantization("none", gguf=False, dtype=torch.bfloat16).mode == "none"
    parallel = resolve_quantization(
        "auto", gguf=False, dtype=torch.bfloat16, tensor_parallel_size=2
    )
    assert parallel.reason.endswith("no bfloat16 panels: tensor parallelism shards float weights")
    for gguf_file in (True, False):  # asked: bf16 arithmetic whatever the dtype
        assert resolve_quantization("bf16", gguf=gguf_file) == QuantChoice(
            "bf16", "as asked", "bfloat16"
        )
    monkeypatch.setattr(quant, "bf16_or_why", lambda: "the CPU lacks AVX512-BF16")
    assert resolve_quantization("auto", gguf=False, dtype=torch.bfloat16) == QuantChoice(
        "none", "auto: not a GGUF file, no bfloat16 panels: the CPU lacks AVX512-BF16"
    )
    with pytest.raises(ValueError, match="'bf16' cannot apply: the CPU lacks AVX512-BF16"):
        resolve_quantization("bf16", gguf=False)


def test_bf16_layers_multiply_every_row_count_on_their_panels(bf16):
    """A bf16 layer is its weights rounded to bfloat16, as panels: 1 row to
    many, the products of the bfloat16-rounded activations and weights summed
    in float32, the bias added; nothing else held, nor allowed beside them."""
    g = torch.Generator().manual_seed(8)
    weight, bias = torch.randn(64, 576, generator=g), torch.randn(64)
    packed = pack_bf16(weight)
    layer = PackedLinear(packed, bias)
    assert (layer.kind, layer.arithmetic, packed.shape) == ("bf16", "bfloat16", (64, 576))
    assert torch.equal(packed.dequantize(), weight.bfloat16().float())
    assert packed.qweight[1, 3, 5, 0] == weight[32 + 5, 6].bfloat16()  # panels [N/32, K/2, 32, 2]
    assert [t.data_ptr() for t in layer.read_tensors(1)] == [
        packed.qweight.data_ptr(),
        layer.bias.data_ptr(),
    ]
    for rows in (1, 5, BF16_ROWS, 33):
        x = torch.randn(rows, 2 * 576, generator=g)[:, ::2]
        expected = F.linear(x.bfloat16().double(), weight.bfloat16().double()) + bias.double()
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="without panels or int16"):
        PackedLinear(packed, None, None, int16_activations=True)
    with pytest.raises(ValueError, match="integer weights"):
        packed.values()
    with pytest.raises(ValueError, match="rows divisible by 32 for bfloat16 panels, got 36"):
        pack_bf16(torch.randn(36, 64))


def test_tiny_model_as_bf16_panels_stays_near_its_bfloat16_rounded_twin(bf16):
    """Every layer whose shape the panels take becomes bf16 (k/v of 16 rows
    stay float32 and are named); the logits stay near a float32 twin of the
    weights rounded to bfloat16, not equal to them (activations round too)."""
    model = build_model(0, num_key_value_heads=1)[1].eval()
    twin = copy.deepcopy(model)
    description = quantize_model(model, QuantChoice("bf16", "as asked", "bfloat16"))
    kept = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert kept and all(n.endswith(("k_proj", "v_proj")) for n in kept)
    assert description == (
        "bf16 (as asked): 11 layers as bfloat16 panels, every row count multiplied in bfloat16 on"
        f" float32 activations; float32 for {', '.join(kept)} (rows not a multiple of 32 or width"
        " of 32)"
    )
    for name, mod in twin.named_modules():  # new parameters: a tied embedding keeps its own
        if isinstance(mod, torch.nn.Linear) and name not in kept:
            mod.weight = torch.nn.Parameter(mod.weight.detach().bfloat16().float())
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    ours, theirs = logits(model, ids), logits(twin, ids)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05)
    assert not torch.allclose(ours, theirs, atol=1e-6)


def test_smollm2_folder_in_bfloat16_runs_on_its_panels_fused_and_checked(smollm2, bf16):
    """A float model folder, ``dtype="bfloat16"`` and ``quantization="auto"``:
    the model stays float32, every linear layer bf16, the step fused (one
    ``decode_layers`` call a decode step), the start-up check passed, and it
    answers as float32 does."""
    from mstar.models.llama.step import fused_step

    chat = [[{"role": "user", "content": "What is the capital of France?"}]]
    params = SamplingParams(max_new_tokens=8)
    folder = str(model_folder("smollm2"))
    with Engine.from_pretrained(folder, dtype="bfloat16", quantization="auto") as engine:
        assert engine.model.mstar_quantization.startswith(
            "bf16 (auto: bfloat16 arithmetic on float weights, the CPU has AVX512-BF16): 211 layers"
        )
        assert engine.dtype == torch.float32 and engine.mode_check.ok
        assert fused_step(engine.model).stack is not None
        got = engine.chat(chat, params)[0].outputs[0].token_ids
    model, tokenizer = smollm2
    with Engine(copy.deepcopy(model), tokenizer) as engine:
        assert got == engine.chat(chat, params)[0].outputs[0].token_ids
