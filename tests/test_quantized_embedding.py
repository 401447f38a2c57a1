"""A GGUF's token embedding kept in its blocks (``QuantizedEmbedding``): each
row looked up is gguf-py's dequantization of it bit for bit, whatever the
type and the ids' shape; a loaded model holds the file's blocks, not a
float32 table, and its head (tied or not) stays packed; the engine on it
decodes the float32 model's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import LlamaShape, random_tensor, write_llama_gguf

from mstar.cpu.quant.embedding import QuantizedEmbedding
from mstar.cpu.quant.kernels import kernel_or_why
from mstar.cpu.quant.linear import PackedLinear
from mstar.engine import Engine, SamplingParams
from mstar.models.loader import load

gguf = pytest.importorskip("gguf")

# the Llama files here: every linear layer Q4_0 (int4, exact on float32 activations)
LINEAR = dict.fromkeys(
    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_0"
)


# the types the kernels' gguf_rows looks up; Q2_K's rows go through gguf-py's numpy
NATIVE = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def file_rows(type_name: str, vocab: int, width: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows (uint8 ``[vocab, bytes a row]``) of random ``type_name`` weights."""
    rng = np.random.default_rng(seed)
    if type_name == "BF16":  # finite values (random bytes may be NaN)
        values = torch.from_numpy(rng.normal(0, 0.05, (vocab, width)).astype(np.float32))
        return values.bfloat16().view(torch.uint8).numpy()
    return random_tensor(type_name, vocab, width, rng).view(np.uint8)


@pytest.mark.parametrize("type_name", [*NATIVE, "Q2_K"])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (2, 3), (0,)])
def test_rows_are_gguf_pys_dequantization_bit_for_bit(type_name, shape):
    """Native (the kernels' ``gguf_rows``) where built and the type is one
    it takes, else gguf-py's numpy: either way gguf-py's table's rows."""
    rows = file_rows(type_name, 300, 256)
    embedding = QuantizedEmbedding(torch.from_numpy(rows.copy()), type_name)
    assert (embedding.num_embeddings, embedding.embedding_dim) == (300, 256)
    assert embedding.native() == (kernel_or_why() is None and type_name in NATIVE)
    table = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[type_name]))
    assert torch.isfinite(table).all() and table.abs().max() > 0
    ids = torch.randint(0, 300, shape, generator=torch.Generator().manual_seed(1))
    if ids.numel():
        ids.view(-1)[0] = 299  # the last row too
    got = embedding(ids)
    assert got.dtype == torch.float32 and got.shape == (*shape, 256)
    assert torch.equal(got, table[ids])
    assert torch.equal(embedding.dequantize(), table)


def test_bad_blocks_types_and_ids_are_refused():
    rows = torch.from_numpy(file_rows("Q8_0", 8, 64))
    with pytest.raises(ValueError, match="other than F32, got 'F32'"):
        QuantizedEmbedding(rows, "F32")
    with pytest.raises(ValueError, match="got 'Q9_9'"):
        QuantizedEmbedding(rows, "Q9_9")
    with pytest.raises(ValueError, match=r"got torch.int8 \[8, 68\]"):
        QuantizedEmbedding(rows.view(torch.int8), "Q8_0")
    with pytest.raises(ValueError, match="whole 34-byte blocks, got 67 bytes"):
        QuantizedEmbedding(rows[:, :67], "Q8_0")
    for embedding in (QuantizedEmbedding(rows, "Q8_0"), QuantizedEmbedding(rows[:, :34], "Q8_0")):
        with pytest.raises(IndexError, match="from 0, got -1"):
            embedding(torch.tensor([3, -1]))
        with pytest.raises(IndexError):
            embedding(torch.tensor([8]))
        for ids in (torch.tensor([1.7]), torch.tensor([True, False])):  # not rounded, not a mask
            with pytest.raises(TypeError, match=f"integer token ids, got {ids.dtype}"):
                embedding(ids)
    if kernel_or_why() is None:  # the op itself refuses them too
        with pytest.raises(TypeError, match="integer token ids, got Float"):
            torch.ops.mstar_quant.gguf_rows(rows, torch.tensor([1.7]), "Q8_0")
    with pytest.raises(AttributeError, match="Q8_0 blocks, not a float weight"):
        _ = embedding.weight
    assert not hasattr(embedding, "weight")


def embedding_bytes(path: Path) -> int:
    (tensor,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight"]
    return int(tensor.n_bytes)


def held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MSTAR_KV_CACHE", str(folder / "cache"))
        yield folder


# (embedding, head): untied Q4_K under a Q8_0 head; tied Q8_0 and Q4_0 (the head packed from it)
CASES = {"untied-q4_k": ("Q4_K", "Q8_0"), "tied-q8_0": ("Q8_0", None), "tied-q4_0": ("Q4_0", None)}


@pytest.fixture(scope="module", params=list(CASES))
def llama(files, request) -> Path:
    embedding, head = CASES[request.param]
    types = LINEAR | {"token_embd": embedding} | ({"output": head} if head else {})
    return write_llama_gguf(files / f"{request.param}.gguf", types, tied=head is None)


def test_a_loaded_model_holds_the_files_blocks_and_a_packed_head(llama):
    """The embedding is the file's blocks, bytes for bytes, its rows the
    float path's (``quantization="none"``) bit for bit; the head, tied or
    not, a packed layer of the float path's head weights."""
    if (why := kernel_or_why()) is not None:
        pytest.skip(f"the packed kernels are not built here: {why}")
    model = load(str(llama), quantization="gguf")[0]
    floats = load(str(llama))[0]
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding)
    assert held_bytes(embedding) == embedding_bytes(llama)
    assert held_bytes(embedding) < held_bytes(floats.get_input_embeddings()) / 3
    assert torch.equal(embedding.dequantize(), floats.get_input_embeddings().weight)
    assert isinstance(model.lm_head, PackedLinear)
    assert torch.equal(model.lm_head.dequantized().weight, floats.lm_head.weight)
    assert model.config.tie_word_embeddings == llama.name.startswith("tied")


def test_the_engine_on_a_quantized_embedding_decodes_the_float_models_tokens(llama):
    """Fused and checked against eager float32 at start-up, the engine's
    greedy tokens are HF's ``generate`` on the float32 model of the file."""
    from mstar.models.llama.step import fused_step

    if (why := kernel_or_why()) is not None:
        pytest.skip(f"the packed kernels are not built here: {why}")
    prompts = [[5, 17, 42, 99, 3], [200, 7]]
    floats = load(str(llama))[0]
    want = []
    with torch.no_grad():
        for prompt in prompts:
            out = floats.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
            want.append(out[0, len(prompt) :].tolist())
    with Engine.from_pretrained(str(llama), quantization="gguf") as engine:
        assert isinstance(engine.model.get_input_embeddings(), QuantizedEmbedding)
        assert engine.mode_check is not None and engine.mode_check.ok
        assert fused_step(engine.model) is not None
        done = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [d.outputs[0].token_ids for d in done] == want


def test_quantization_none_keeps_the_float_embedding(files):
    path = write_llama_gguf(files / "float.gguf", LINEAR | {"token_embd": "Q8_0"}, tied=True)
    model = load(str(path))[0]
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_an_f32_embedding_stays_a_float_table(files):
    shape = LlamaShape(layers=1)
    path = write_llama_gguf(files / "f32.gguf", LINEAR | {"token_embd": "F32"}, shape)
    model = load(str(path), quantization="gguf")[0]
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
