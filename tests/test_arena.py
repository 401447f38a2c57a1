"""``mstar.cpu.quant.arena``: the packed layers' tensors of a kind in one
allocation in model order, the same values and logits; joins of layers
lying side by side taken as views (``fused_linear``)."""

from __future__ import annotations

import mmap

import pytest
import torch

from mstar.cpu.quant import QuantChoice, quantize_model
from mstar.cpu.quant.arena import HUGE_PAGE, KINDS, allocation, gather
from mstar.cpu.quant.kernels import kernel_or_why
from mstar.cpu.quant.linear import PackedLinear
from mstar.models.llama.fused_linear import RowConcat, _rows
from mstar.models.seeded import build_model


@pytest.fixture(scope="module")
def kernels():
    if (why := kernel_or_why()) is not None:
        pytest.skip(why)


def packed_tiny(mode: str = "int4", gathered: bool = True, monkeypatch=None) -> torch.nn.Module:
    """The seeded tiny Llama with its linear layers packed (``gathered``: as
    ``quantize_model`` leaves them; else each tensor its own allocation)."""
    model = build_model(0)[1].eval()
    if not gathered:
        monkeypatch.setattr("mstar.cpu.quant.gather", lambda model: 0)
    quantize_model(model, QuantChoice(mode, "as asked", "bfloat16"))
    return model


def storages(model: torch.nn.Module, kind: str) -> set[int]:
    return {
        m._buffers[kind].untyped_storage().data_ptr()
        for m in model.modules()
        if isinstance(m, PackedLinear) and m._buffers.get(kind) is not None
    }


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantize_model_leaves_each_kind_in_one_allocation_in_module_order(
    kernels, mode, monkeypatch
):
    """Every kind a packed layer holds lies in one allocation, each layer's
    tensor after the one before it in module order; the logits are the
    scattered model's bit for bit."""
    model = packed_tiny(mode)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    kinds = [k for k in KINDS if layers[0]._buffers.get(k) is not None]
    assert kinds  # the main weights at least
    for kind in kinds:
        assert len(storages(model, kind)) == 1
        starts = [m._buffers[kind].data_ptr() for m in layers]
        assert starts == sorted(starts) and len(set(starts)) == len(starts)
    scattered = packed_tiny(mode, gathered=False, monkeypatch=monkeypatch)
    assert len(storages(scattered, kinds[0])) == len(layers)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, scattered(ids).logits)


def test_gather_keeps_values_and_a_shared_tensor_shared(kernels, monkeypatch):
    """Each tensor once (two layers holding one tensor still share it after),
    every value where it was; returns the bytes of the allocations."""
    model = packed_tiny(gathered=False, monkeypatch=monkeypatch)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    kind = "lanes" if layers[0].lanes is not None else "qweight"
    layers[1]._buffers[kind] = layers[0]._buffers[kind]
    held = {(i, k): t for i, m in enumerate(layers) for k, t in m._buffers.items() if t is not None}
    before = {key: t.clone() for key, t in held.items()}
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in held.values()}
    assert gather(model) >= sum(unique.values())
    for (i, k), t in before.items():
        assert torch.equal(layers[i]._buffers[k], t)
    assert layers[0]._buffers[kind].data_ptr() == layers[1]._buffers[kind].data_ptr()


def test_gather_gives_views_of_one_start_but_another_shape_their_own_copy(kernels, monkeypatch):
    """A layer holding a prefix of another's tensor (the same start, fewer
    rows) keeps its own rows, not a view of the other's shape."""
    model = packed_tiny(gathered=False, monkeypatch=monkeypatch)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    kind = "lanes" if layers[0].lanes is not None else "qweight"
    whole = layers[0]._buffers[kind]
    layers[1]._buffers[kind] = prefix = whole[: whole.shape[0] // 2]
    before = whole.clone(), prefix.clone()
    gather(model)
    assert torch.equal(layers[0]._buffers[kind], before[0])
    assert torch.equal(layers[1]._buffers[kind], before[1])


def test_allocation_is_aligned_to_a_huge_page_and_writable():
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:
        assert allocation(4096) is None
        return
    arena = allocation(3 * HUGE_PAGE + 5)
    assert arena.dtype == torch.uint8 and arena.numel() == 3 * HUGE_PAGE + 5
    assert arena.data_ptr() % HUGE_PAGE == 0
    arena.fill_(7)
    assert int(arena.sum()) == 7 * arena.numel()


def test_rows_of_tensors_side_by_side_are_a_view_else_a_copy():
    arena = torch.arange(40, dtype=torch.float32)
    a, b = arena[:12].view(3, 4), arena[12:20].view(2, 4)
    joined = _rows([a, b])
    assert joined.data_ptr() == a.data_ptr() and torch.equal(joined, torch.cat([a, b]))
    apart = arena[24:32].view(2, 4)  # not where a ends
    copied = _rows([a, apart])
    assert copied.data_ptr() != a.data_ptr() and torch.equal(copied, torch.cat([a, apart]))
    assert _rows([a, b.clone()]).data_ptr() != a.data_ptr()  # another allocation


def test_joined_layers_of_a_gathered_model_are_views_of_its_allocation(kernels):
    """q/k/v (and gate/up) lie side by side after ``gather``: their join
    copies nothing, and the layers' weights stay views of the one allocation."""
    model = packed_tiny()
    attn = model.model.layers[0].self_attn
    kind = "lanes" if attn.q_proj.lanes is not None else "qweight"
    (arena,) = storages(model, kind)
    joined = RowConcat([attn.q_proj, attn.k_proj, attn.v_proj])
    assert joined.module._buffers[kind].untyped_storage().data_ptr() == arena
    assert joined.module._buffers[kind].data_ptr() == attn.q_proj._buffers[kind].data_ptr()
    assert storages(model, kind) == {arena} and joined.current()


def test_quantize_model_trims_the_heap_after_each_layer_it_packs(kernels, monkeypatch):
    """Each layer's read form is handed back before the next is read: left
    in the heap, an 8B Q4_K_M file's first load peaked 1.3 GiB higher."""
    model = build_model(0)[1].eval()
    packed_at_trim: list[int] = []

    def trim() -> bool:
        packed_at_trim.append(sum(isinstance(m, PackedLinear) for m in model.modules()))
        return True

    monkeypatch.setattr("mstar.cpu.quant.trim_heap", trim)
    quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    packed = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert packed > 1 and packed_at_trim == list(range(1, packed + 1))


def test_trim_heap_hands_the_freed_heap_pages_back():
    """Tensors freed in the middle of the C heap stay resident until trimmed
    (a 3B-shaped load kept 5.4 GB of them)."""
    from pathlib import Path

    from mstar.cpu.quant.arena import trim_heap

    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("no /proc/self/status here")

    def resident() -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS"))
        return int(line.split()[1]) << 10

    chunks = [torch.ones(16 << 10) for _ in range(4000)]  # 64 KiB each: heap, not mmap
    top = torch.ones(16 << 10)  # above them: the heap's top stays in use
    chunks.clear()
    before = resident()
    assert trim_heap()
    assert before - resident() > 128 << 20, (before, resident())
    del top
