"""The engine's device helpers: FlashInfer is attached only to a model its
kernels serve (half-precision weights, a head width they are built for), and a
CUDA device without an index is the current one."""

from __future__ import annotations

import copy
import os

import pytest

pytest.importorskip("transformers")
import torch

import mstar.engine.resources.attn.flashinfer as flashinfer_module
from mstar.engine.resources.kv.cache import indexed_device
from mstar.models.device import flashinfer_or_none
from mstar.models.seeded import build_model


@pytest.fixture
def adapter(monkeypatch):
    """FlashInfer's adapter as if flashinfer and CUDA were there."""
    made = object()
    monkeypatch.setattr(flashinfer_module, "FlashInferPagedAttention", lambda device: made)
    return made


def model(head_dim: int, dtype: torch.dtype):
    base = build_model(seed=0)[0]
    config = copy.deepcopy(base.config)
    config.head_dim = head_dim
    return type(base)(config).to(dtype)


@pytest.mark.parametrize(
    ("head_dim", "dtype", "served"),
    [
        (64, torch.bfloat16, True),
        (64, torch.float16, True),
        (64, torch.float32, False),  # from_pretrained's default dtype
        (16, torch.bfloat16, False),  # the seeded tiny model's width
    ],
)
def test_flashinfer_only_for_a_model_its_kernels_serve(adapter, head_dim, dtype, served):
    got = flashinfer_or_none("cuda", model(head_dim, dtype))
    assert (got is adapter) == served


def test_flashinfer_without_a_model_is_built_as_asked(adapter):
    assert flashinfer_or_none("cuda") is adapter


def test_cpu_device_is_unchanged():
    assert indexed_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_without_an_index_is_the_current_device():
    assert indexed_device("cuda") == torch.zeros(1, device="cuda").device


def test_host_pool_takes_its_share_of_the_available_memory(monkeypatch, tmp_path):
    """The page cache a load fills counts as available (``MemAvailable``),
    not as used: the free pages alone gave an 8B file's first start 66 pages."""
    import mstar.models.device as device
    from mstar.models.hf_support import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, v_head_dim=8, chunk_sizes=(None, None),
                  sinks=False, keeps_logits=True)  # fmt: skip
    page = device.page_bytes_of(spec, 16, torch.float32)
    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(device, "MEMINFO", meminfo)
    monkeypatch.setattr(device, "HOST_POOL_BYTES", 1 << 60)
    meminfo.write_text("MemTotal: 8388608 kB\nMemFree: 4096 kB\nMemAvailable: 4194304 kB\n")
    pages = device.pool_pages(spec, 16, torch.float32, torch.device("cpu"))
    assert pages == int((4 << 30) * device.KV_MEMORY_FRACTION) // page
    sizes = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", sizes.__getitem__)
    meminfo.write_text("MemTotal: 8388608 kB\nMemFree: 4096 kB\n")  # no MemAvailable: free pages
    assert device._free_bytes(torch.device("cpu")) == 1000 * 4096
    monkeypatch.setattr(device, "MEMINFO", tmp_path / "absent")
    assert device._free_bytes(torch.device("cpu")) == 1000 * 4096
