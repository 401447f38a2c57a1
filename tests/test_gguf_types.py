"""GGUF files in the types people download (Q4_K_M's Q4_K and Q6_K, Q5_K,
and the types the integer kernels take), written here (``gguf_files``):
the weights served equal gguf-py's dequantization bit for bit (Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K, Q6_K packed) or rounded to bfloat16 (every other type, as
bfloat16 panels); a Q4_K_M-like file served through the engine, on the
integer lanes, agrees with the float32 HF model of the file; what the
lanes or panels cannot take is named, with why."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf_files import LlamaShape, q4_k_m_types, q5_k_m_types, write_llama_gguf

from mstar.cpu.quant import QuantChoice, quantize_model
from mstar.cpu.quant.kernels import bf16_or_why, kernel_or_why
from mstar.cpu.quant.linear import PackedLinear
from mstar.engine import Engine, SamplingParams
from mstar.engine.verify import Tolerance, check_mode, float32_reference
from mstar.models.gguf import gguf_folder, load_gguf
from mstar.models.loader import load, model_folder

gguf = pytest.importorskip("gguf")

# GGUF tensor names (without ``blk.N.`` and ``.weight``) -> the HF layer's
HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# one type a tensor, each type somewhere; q/k in integer types (their rows permuted by HF)
MIXED = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q4_K",
    "ffn_gate": "Q5_K",
    "ffn_up": "Q6_K",
    "ffn_down": "Q4_K",
    "output": "Q6_K",
    "token_embd": "Q4_K",
}
PACKED_TYPES = {
    "Q4_0": "int4", "Q4_1": "int4", "Q5_0": "int8", "Q8_0": "int8", "Q4_K": "int4", "Q5_K": "int8",
    "Q6_K": "int8",
}  # fmt: skip
# the clause on the K-quants' lanes (int16 activations whatever the arithmetic) in MIXED's description
K_LANES = (
    "int16 activations at 1-8 rows (the 4 int4 layers, the 5 int8 layers) (9 of them on lanes,"
    " 16 rows a vector), 9+ rows multiply in bfloat16"
)


@pytest.fixture(scope="module")
def panels_run():
    """The kernels with bfloat16 panels (AVX512-BF16), loaded before the
    cache folder moves to a temporary one for the files converted here."""
    why = kernel_or_why() or bf16_or_why()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def lanes(panels_run):
    """The kernels' lanes (AVX512-VNNI: every CPU with AVX512-BF16 has it)."""
    if not torch.ops.mstar_quant.lanes_rows():
        pytest.skip("the kernels' build has no lanes (no AVX512-VNNI)")


@pytest.fixture(scope="module")
def files(panels_run, tmp_path_factory) -> Path:
    """A folder for the GGUF files, the cache folder (``MSTAR_KV_CACHE``)
    beside them, so the converted models go with them."""
    folder = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MSTAR_KV_CACHE", str(folder / "cache"))
        yield folder


def gguf_reference(path: Path, model: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Each linear layer's ``(GGUF type, weights)`` as gguf-py dequantizes
    them, rows in the HF model's order (llama's q/k permuted as transformers'
    conversion does), by HF layer name."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS["llama"](config=model.config.to_dict())
    out = {}
    for tensor in gguf.GGUFReader(path).tensors:
        parts = tensor.name.split(".")
        if parts[0] == "output":
            name = "lm_head"
        elif parts[0] == "blk" and parts[2] in HF_NAMES:
            name = f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}"
        else:
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weights = processor.process(weights=weights, name=tensor.name).weights
        out[name] = (tensor.tensor_type.name, torch.from_numpy(weights.copy()))
    return out


@pytest.fixture(scope="module")
def mixed(files) -> tuple[Path, torch.nn.Module]:
    path = write_llama_gguf(files / "mixed.gguf", MIXED)
    return path, load(str(path), quantization="gguf")[0]


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_served_weights_are_gguf_pys_dequantization(mixed, type_name):
    """Packed integer types bit for bit; every other type as bfloat16 panels
    of the same values, each rounded to bfloat16."""
    path, model = mixed
    layers = {n: w for n, (t, w) in gguf_reference(path, model).items() if t == type_name}
    assert layers
    for name, expected in layers.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, PackedLinear), name
        assert layer.kind == PACKED_TYPES.get(type_name, "bf16"), name
        assert torch.isfinite(expected).all() and expected.abs().max() > 0
        if type_name in PACKED_TYPES:
            assert torch.equal(layer.dequantized().weight, expected), name
        else:
            assert layer.arithmetic == "bfloat16"
            assert torch.equal(layer.packed().dequantize(), expected.bfloat16().float()), name


def test_q5_0_packs_as_int8_and_q5_1_loads_as_panels_of_its_dequantization(files):
    """Types transformers' own conversion refuses (Q5_0, Q5_1) load from the
    file: Q5_0 as int8 ``q - 16`` of its scale, gguf-py's dequantization bit
    for bit; Q5_1 as that dequantization rounded to bfloat16."""
    types = {"attn_q": "Q5_0", "attn_k": "Q5_1", "ffn_up": "Q5_0"}
    path = write_llama_gguf(files / "q5.gguf", types, LlamaShape(layers=1))
    model = load(str(path), quantization="gguf")[0]
    assert model.mstar_quantization.startswith(
        "gguf (as asked): 2 layers int8 (Q5_0), 5 layers int4 (Q4_K),"
        " 1 layer bf16 panels (Q5_1 dequantized)"
    )
    layers = {n: (t, w) for n, (t, w) in gguf_reference(path, model).items() if t.startswith("Q5_")}
    assert sorted(t for t, _ in layers.values()) == ["Q5_0", "Q5_0", "Q5_1"]
    for name, (type_name, expected) in layers.items():
        layer = model.get_submodule(name)
        assert layer.kind == PACKED_TYPES.get(type_name, "bf16"), name
        if type_name == "Q5_0":
            assert torch.equal(layer.dequantized().weight, expected), name
        else:
            assert torch.equal(layer.packed().dequantize(), expected.bfloat16().float()), name


def test_the_description_names_each_type_and_what_serves_it(mixed, lanes):
    assert mixed[1].mstar_quantization == (
        "gguf (as asked): 2 layers int4 (Q4_0), 2 layers int4 (Q4_1), 2 layers int8 (Q8_0),"
        " 4 layers int4 (Q4_K), 2 layers int8 (Q5_K), 3 layers int8 (Q6_K);"
        f" {K_LANES}"
    )


def test_q4_k_m_file_serves_on_lanes_and_agrees_with_its_float32_model(files, lanes):
    """``quantization="auto"`` on a Q4_K_M-like file: every linear layer on
    the integer lanes alone (Q4_K int4, Q6_K int8, float32 scales; many rows
    on bfloat16 panels dequantized from them; none float32), the start-up check passed (bfloat16
    arithmetic: the half-precision bound), the decode step fused as one
    stack (layer 1's q/k int4 and v int8 side by side), and the greedy
    tokens agree with the HF model on the file's float32 dequantization
    under that bound."""
    from transformers import AutoModelForCausalLM

    from mstar.models.llama.fused_linear import SideBySide
    from mstar.models.llama.step import fused_step

    path = write_llama_gguf(files / "q4_k_m.gguf", q4_k_m_types)
    with Engine.from_pretrained(str(path), quantization="auto") as engine:
        assert engine.model.mstar_quantization == (
            "gguf (auto: the file's own format): 12 layers int4 (Q4_K), 3 layers int8 (Q6_K);"
            " int16 activations at 1-8 rows (the 12 int4 layers, the 3 int8 layers) (15 of them"
            " on lanes, 16 rows a vector), 9+ rows multiply in bfloat16"
        )
        linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
        assert not linears
        packed = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
        held = [m.lane_panels or m.panels is not None for m in packed]  # a small model holds them
        assert all(m.lanes is not None and m.qweight is None for m in packed) and all(held)
        assert engine.mode_check is not None and engine.mode_check.ok
        fused = fused_step(engine.model)
        assert fused.stack is not None
        assert isinstance(fused.layers[1].qkv.module, SideBySide)
        hf = AutoModelForCausalLM.from_pretrained(model_folder(str(path)), dtype=torch.float32)
        check = check_mode(engine, float32_reference(hf.eval()), Tolerance.of(exact=False))
    assert check.ok, check.failure
    assert check.tokens == 24


def test_q5_k_m_file_serves_on_lanes_and_fuses_its_decode_stack(files, lanes):
    """``quantization="auto"`` on a Q5_K_M-like file: its Q5_K layers int8 on
    lanes of the file's factors (2816 bytes a block a super-block: 0.6875 a
    weight, the file's), no row-major copy, the start-up check passed, the decode step
    fused as one stack on them, which decodes."""
    from mstar.models.llama.step import fused_step

    path = write_llama_gguf(files / "q5_k_m.gguf", q5_k_m_types)
    with Engine.from_pretrained(str(path), quantization="auto") as engine:
        assert engine.model.mstar_quantization.startswith(
            "gguf (auto: the file's own format): 12 layers int8 (Q5_K), 3 layers int8 (Q6_K);"
            " int16 activations at 1-8 rows (the 15 int8 layers) (15 of them on lanes"
        )
        packed = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
        assert {m.lanes.shape[-1] for m in packed} == {2816, 3360}
        assert all(m.qweight is None for m in packed)
        assert engine.mode_check is not None and engine.mode_check.ok
        assert fused_step(engine.model).stack is not None
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        (done,) = engine.generate([[5, 17, 42, 9]], params)
    assert len(done.outputs[0].token_ids) == 8


def test_k_quant_lanes_of_the_files_factors_serve_as_the_float32_lanes_bit_for_bit(
    files, lanes, monkeypatch
):
    """A Q4_K_M-like file's Q4_K and Q6_K layers hold lanes of the file's own
    factors (0.58 and 0.82 bytes a weight): the engine passes its start-up check and fuses its
    decode stack on them, and the model's logits at one and many rows and
    the engine's greedy tokens are those of the same file on float32-scale
    lanes (0.75 and 1.25), bit for bit."""
    import mstar.models.gguf as gguf_model
    from mstar.cpu.quant.gguf import decode_blocks
    from mstar.models.llama.step import fused_step

    path = write_llama_gguf(files / "q4_k_m_factors.gguf", q4_k_m_types)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(7))

    def served() -> tuple[set[int], list[torch.Tensor], list[int]]:
        """The layers' kinds and lanes' last axes, the logits, the greedy tokens."""
        with Engine.from_pretrained(str(path), quantization="auto") as engine:
            assert engine.mode_check is not None and engine.mode_check.ok
            assert fused_step(engine.model).stack is not None
            packed = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
            layouts = {(m.kind, m.lanes.shape[-1]) for m in packed}
            params = SamplingParams(max_new_tokens=8, ignore_eos=True)
            (done,) = engine.generate([ids[0, :4].tolist()], params)
        model = load(str(path), quantization="gguf", dtype=torch.bfloat16)[0]
        with torch.no_grad():
            logits = [model(ids[:, :1]).logits, model(ids).logits]
        return layouts, logits, done.outputs[0].token_ids

    layouts, logits, tokens = served()
    assert layouts == {("int4", 2304), ("int8", 3360)}
    with monkeypatch.context() as patch:  # the same file on float32-scale lanes
        patch.setenv("MSTAR_KV_CACHE", str(files / "float32-scales"))
        patch.setattr(
            gguf_model, "decode_blocks", lambda t, d: replace(decode_blocks(t, d), factors=None)
        )
        wide, theirs, their_tokens = served()
    assert wide == {("int4", 384), ("int8", 640)}
    assert all(torch.equal(a, b) for a, b in zip(logits, theirs, strict=True))
    assert tokens == their_tokens and len(tokens) == 8


def test_without_bf16_panels_the_types_are_named_float32_with_why(mixed, monkeypatch):
    import mstar.cpu.quant as quant

    path, _ = mixed
    model, weights = load_gguf(path, pack=True)
    monkeypatch.setattr(quant, "bf16_or_why", lambda: "the CPU lacks AVX512-BF16")
    description = quantize_model(model, QuantChoice("gguf", "as asked"), weights)
    assert description == (
        "gguf (as asked): 2 layers int4 (Q4_0), 2 layers int4 (Q4_1), 2 layers int8 (Q8_0);"
        " 4 layers float32 (Q4_K dequantized), 2 layers float32 (Q5_K dequantized),"
        " 3 layers float32 (Q6_K dequantized): the CPU lacks AVX512-BF16;"
        " Q4_K, Q5_K, Q6_K dequantized, not on int4/int8 lanes: the CPU lacks AVX512-BF16"
    )
    kept = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert len(kept) == 9 and "lm_head" in kept


def test_a_layer_the_panels_cannot_shape_stays_float32_and_is_named(files, lanes):
    """A head of 280 rows (not a multiple of 32): float32, named with why."""
    path = write_llama_gguf(files / "odd.gguf", q4_k_m_types, LlamaShape(layers=1, vocab=280))
    model = load(str(path), quantization="gguf")[0]
    assert model.mstar_quantization == (
        "gguf (as asked): 5 layers int4 (Q4_K), 2 layers int8 (Q6_K); 1 layer float32 (Q6_K"
        " dequantized): rows not a multiple of 32 or width of 32; Q6_K dequantized, not on"
        " int4/int8 lanes: rows not a multiple of 32; int16 activations at 1-8 rows (the 5 int4"
        " layers, the 2 int8 layers) (7 of them on lanes, 16 rows a vector), 9+ rows multiply"
        " in bfloat16"
    )
    assert type(model.lm_head) is torch.nn.Linear


def test_the_converted_float32_model_is_gguf_pys_dequantization(mixed):
    """The float32 weights the panels round (the file converted by
    transformers) are gguf-py's dequantization bit for bit, every type here."""
    path, _ = mixed
    model = load(str(path))[0]
    reference = gguf_reference(path, model)
    assert {t for t, _ in reference.values()} == {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    for name, (_, expected) in reference.items():
        assert torch.equal(model.get_submodule(name).weight, expected), name


def mapped(path: Path) -> bool:
    """Whether this process maps the file ``path`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


def test_a_gguf_loads_from_the_file_with_no_float32_copy_and_leaves_it_unmapped(files):
    """The load reads the file itself: no converted float32 model is written
    under the cache folder (only the index, config and tokenizer), no
    packed layer holds a float32 weight, and once loaded nothing keeps the
    file mapped (every tensor copied out or packed)."""
    import gc
    import os

    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc/self/maps here")
    path = write_llama_gguf(files / "direct.gguf", q4_k_m_types, LlamaShape(layers=1))
    model = load(str(path), quantization="gguf")[0]
    gc.collect()
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert not any(p.is_meta for p in model.parameters())
    assert not mapped(path)
    cache = Path(os.environ["MSTAR_KV_CACHE"])
    assert not list(cache.glob("direct-*/*.safetensors"))  # no converted float32 model
    assert (gguf_folder(path) / "tensors.json").exists()
    for first, second in zip(
        model.state_dict().values(),
        load(str(path), quantization="gguf")[0].state_dict().values(),
        strict=True,
    ):
        assert torch.equal(first, second)  # a second load, from the index, the same


QWEN = LlamaShape(hidden=256, layers=2, heads=2, kv_heads=1)  # head_dim 128: Qwen3's default


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen2_and_qwen3_files_load_from_the_file_and_decode_as_hf(files, arch):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms) files: the float32 model
    read from the file is transformers' conversion bit for bit, and the
    engine on the packed Q4_0/Q8_0 layers decodes HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    types = {"token_embd": "Q8_0", "output": "Q8_0"}
    path = write_llama_gguf(files / f"{arch}.gguf", types | dict.fromkeys(HF_NAMES, "Q4_0"),
                            QWEN, arch=arch)  # fmt: skip
    model = load(str(path))[0]
    hf = AutoModelForCausalLM.from_pretrained(model_folder(str(path)), dtype=torch.float32).eval()
    assert type(model) is type(hf) and model.state_dict().keys() == hf.state_dict().keys()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    prompt = [5, 17, 42, 99, 3]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:]
    with Engine.from_pretrained(str(path), quantization="gguf") as engine:
        assert engine.model.mstar_quantization.startswith("gguf (as asked): 14 layers int4 (Q4_0)")
        (done,) = engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert done.outputs[0].token_ids == want.tolist()


def test_qwen3_head_dim_comes_from_the_file(files):
    """A head_dim other than Qwen3's default 128 (transformers' reader leaves
    the default): the model gets the file's, its q rows as the file holds them."""
    path = write_llama_gguf(files / "qwen3-64.gguf", {}, LlamaShape(layers=1), arch="qwen3")
    model = load(str(path))[0]
    assert model.config.head_dim == 64
    q = model.model.layers[0].self_attn.q_proj.weight
    (tensor,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight"]
    reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    assert q.shape == (256, 256) and torch.equal(q, reference)  # (qwen: rows not permuted)
