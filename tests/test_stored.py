"""A GGUF's packed layers stored at the first load and read back at the
next (``mstar.cpu.quant.stored``): the same layers byte for byte, the same
tokens, the file's linear tensors not read again."""

from __future__ import annotations

import pytest
import torch
from gguf_files import LlamaShape, q4_k_m_types, q5_k_m_types, write_llama_gguf

from mstar.cpu.quant import stored
from mstar.cpu.quant.arena import KINDS
from mstar.cpu.quant.kernels import bf16_or_why, kernel_or_why
from mstar.cpu.quant.linear import PackedLinear
from mstar.engine import Engine, SamplingParams
from mstar.models import gguf as gguf_module
from mstar.models.loader import load


@pytest.fixture
def cache(tmp_path, monkeypatch):
    if (why := kernel_or_why() or bf16_or_why()) is not None:
        pytest.skip(why)
    monkeypatch.setenv("MSTAR_KV_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _packed(model) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {k: m._buffers[k] for k in KINDS if m._buffers.get(k) is not None}
        for name, m in model.named_modules()
        if isinstance(m, PackedLinear)
    }


@pytest.mark.parametrize(
    ("types", "tied"),
    [
        (q4_k_m_types, False),
        (q5_k_m_types, False),
        (lambda *_: "Q4_0", True),
        (lambda *_: "Q8_0", False),
    ],
)
def test_a_second_load_reads_the_stored_layers_byte_for_byte(cache, monkeypatch, types, tied):
    path = write_llama_gguf(cache / "m.gguf", types, LlamaShape(), tied=tied)
    first, _ = load(str(path), quantization="gguf", dtype=torch.bfloat16)
    folder = stored.folder_for(path, "gguf/bfloat16")
    assert stored.layer_names(folder) == list(_packed(first))
    read = []
    real = gguf_module.decode_blocks
    monkeypatch.setattr(gguf_module, "decode_blocks", lambda *a: read.append(a[0]) or real(*a))
    second, _ = load(str(path), quantization="gguf", dtype=torch.bfloat16)
    assert read == []  # no linear tensor of the file read, a tied head not rebuilt
    assert second.mstar_quantization == first.mstar_quantization
    one, two = _packed(first), _packed(second)
    assert one.keys() == two.keys()
    for name in one:
        assert one[name].keys() == two[name].keys(), name
        for kind, t in one[name].items():
            assert t.dtype == two[name][kind].dtype and torch.equal(t, two[name][kind]), (
                name,
                kind,
            )
        a, b = first.get_submodule(name), second.get_submodule(name)
        assert (a.kind, a.int16_activations, a.lane_panels, a.symmetric) == (
            b.kind,
            b.int16_activations,
            b.lane_panels,
            b.symmetric,
        )
    if types("attn_q", 0, 1) == "Q4_0":  # lanes without minimums
        assert {t["lanes"].shape[2:] for t in two.values()} == {(288,)}
    ids = torch.tensor([[5, 17, 42, 9, 3, 11, 200, 7, 1, 64, 33]])  # many rows: panels from lanes
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)
        assert torch.equal(first(ids[:, :1]).logits, second(ids[:, :1]).logits)


def test_the_engine_on_stored_layers_decodes_the_same_tokens(cache):
    path = write_llama_gguf(cache / "q4km.gguf", q4_k_m_types, LlamaShape())
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        with Engine.from_pretrained(str(path), quantization="auto") as engine:
            runs.append(engine.generate([[1, 2, 3, 4, 5]], params)[0].outputs[0].token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 12
    assert stored.layer_names(stored.folder_for(path, "gguf/float32")) is not None


def test_a_load_asked_otherwise_than_the_storing_one_says_its_own_reason(cache):
    """The stored description's head is the storing load's mode and why: a
    later load of the same layers asked another way names its own."""
    path = write_llama_gguf(cache / "q8.gguf", lambda *_: "Q8_0", LlamaShape())
    auto, _ = load(str(path), quantization="auto", dtype=torch.bfloat16)
    asked, _ = load(str(path), quantization="gguf", dtype=torch.bfloat16)
    head, _, body = auto.mstar_quantization.partition("): ")
    assert head == "gguf (auto: the file's own format" and body
    assert asked.mstar_quantization == f"gguf (as asked): {body}"


def test_another_mode_or_file_packs_afresh(cache):
    path = write_llama_gguf(cache / "q8.gguf", lambda *_: "Q8_0", LlamaShape())
    load(str(path), quantization="gguf", dtype=torch.bfloat16)
    assert stored.layer_names(stored.folder_for(path, "gguf/bfloat16")) is not None
    assert stored.layer_names(stored.folder_for(path, "gguf/float32")) is None
    other = write_llama_gguf(cache / "other.gguf", lambda *_: "Q8_0", LlamaShape(), seed=1)
    assert stored.layer_names(stored.folder_for(other, "gguf/bfloat16")) is None


def test_a_save_keeps_the_newest_folders_of_its_file(cache, monkeypatch):
    """Each version of mstar packs a file afresh (its digest names the
    folder): a save keeps the newest ``KEEP`` folders of that file, no other
    file's."""
    import os

    path = write_llama_gguf(cache / "q8.gguf", lambda *_: "Q8_0", LlamaShape())
    other = write_llama_gguf(cache / "other.gguf", lambda *_: "Q8_0", LlamaShape(), seed=1)
    load(str(other), quantization="gguf", dtype=torch.bfloat16)
    others = stored.folder_for(other, "gguf/bfloat16")
    folders = []
    for version in range(stored.KEEP + 2):
        monkeypatch.setattr(
            stored, "code_digest", lambda mode, v=version: f"{mode}-v{v}".replace("/", "-")
        )
        load(str(path), quantization="gguf", dtype=torch.bfloat16)
        folders.append(stored.folder_for(path, "gguf/bfloat16"))
        index = folders[-1] / stored.LAYERS
        os.utime(index, (version * 10.0 + 1e9,) * 2)  # written in this order
    assert [f.exists() for f in folders] == [False] * 2 + [True] * stored.KEEP
    assert (others / stored.LAYERS).exists()


def test_a_fresh_process_runs_the_stored_layers(cache):
    """A second load in a process that packed nothing loads the kernels the
    stored layers run on (a forward through them failed: no ops registered)."""
    import os
    import subprocess
    import sys

    path = write_llama_gguf(cache / "q4_0.gguf", lambda *_: "Q4_0", LlamaShape())
    load(str(path), quantization="gguf", dtype=torch.bfloat16)
    script = (
        "import torch; from mstar.models.loader import load;"
        f"m, _ = load({str(path)!r}, quantization='gguf', dtype=torch.bfloat16);"
        "print(m(torch.tensor([[1, 2, 3]])).logits.shape)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "torch.Size([1, 3, 288])" in done.stdout, done.stderr[-800:]
