"""A model's packed layers stored once and read back at the next load.

After a GGUF file's first load (``quantize_model``, then ``arena.gather``:
each kind of the packed tensors in one allocation, in model order), ``save``
writes each kind's allocation to a file and ``LAYERS``, an index of every
``PackedLinear`` (its kind, switches, and where each of its tensors lies,
of which dtype and shape). ``restore`` reads the allocations back into
memory on huge pages (one sequential read a kind, no unpacking, no lanes to
lay out: what the first load computed, byte for byte) and puts a
``PackedLinear`` over views of them where each linear layer was. The folder is named by the source file, the
quantization and a digest of mstar's code and the kernels' flags
(``folder_for``), so a changed file, mode or packer packs afresh; each save
keeps the newest ``KEEP`` folders of its file and removes the older ones
(each is about the file's size again: a cache otherwise grows by that at
every new version of mstar).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from mstar.cpu.build import code_digest
from mstar.cpu.cachedir import cache_root, cached, file_key
from mstar.cpu.quant.arena import KINDS, allocation
from mstar.cpu.quant.kernels import kernel_or_why
from mstar.cpu.quant.linear import PackedLinear
from mstar.cpu.quant.packed import Packed

__all__ = ["LAYERS", "folder_for", "layer_names", "restore", "save"]

LAYERS = "layers.json"  # the index, written last: a folder holding it is whole
KEEP = 3  # a file's packed folders kept (modes, versions of mstar), the newest


def folder_for(source: Path, mode: str) -> Path:
    """Where the packed layers of the file ``source`` in quantization
    ``mode`` (e.g. ``gguf/bfloat16``) are kept."""
    return cache_root() / f"{file_key(source)}-packed-{code_digest(mode)}"


def layer_names(folder: Path) -> list[str] | None:
    """The linear layers ``folder`` holds, by module name (None: none stored,
    or the kernels that multiply them do not run here: ``kernel_or_why``,
    which also loads them, as packing does before its layers run)."""
    if not (folder / LAYERS).exists() or kernel_or_why() is not None:
        return None
    return [entry["name"] for entry in json.loads((folder / LAYERS).read_text())["layers"]]


def save(model: Any, folder: Path) -> None:
    """Write ``model``'s packed layers (every linear layer a ``PackedLinear``
    whose tensors ``arena.gather`` moved) and ``model.mstar_quantization``
    into ``folder``, under the cache folder (``cachedir.cached``: written
    aside, then renamed into place)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinear)]

    def write(scratch: Path) -> None:
        for kind in KINDS:
            held = [m._buffers[kind] for _, m in layers if m._buffers.get(kind) is not None]
            if held:
                _whole(held[0]).numpy().tofile(scratch / f"{kind}.bin")
        entries = [_entry(name, layer) for name, layer in layers]
        index = {"quantization": model.mstar_quantization, "layers": entries}
        (scratch / LAYERS).write_text(json.dumps(index))

    cached(folder.relative_to(cache_root()).as_posix(), LAYERS, write)
    _prune(folder)


def _prune(folder: Path) -> None:
    """Remove all but the newest ``KEEP`` whole packed folders of ``folder``'s
    file (by when their index was written)."""
    file = folder.name.rpartition("-packed-")[0]
    whole = [f for f in folder.parent.glob(f"{file}-packed-*") if (f / LAYERS).exists()]
    whole.sort(key=lambda f: (f / LAYERS).stat().st_mtime, reverse=True)
    for old in whole[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def restore(model: Any, folder: Path, head: str) -> str:
    """Put the ``PackedLinear`` layers ``folder`` holds into ``model`` where
    its linear layers (meta weights; a bias read from the file stays) are;
    returns and sets ``model.mstar_quantization``: the stored description
    under ``head`` (``QuantChoice.head``: this load's mode and why, not the
    storing load's, which may have been asked otherwise)."""
    index = json.loads((folder / LAYERS).read_text())
    arenas = {
        kind: _read(folder / f"{kind}.bin") for kind in KINDS if (folder / f"{kind}.bin").exists()
    }
    for entry in index["layers"]:
        parent, _, attr = entry["name"].rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        tensors = {
            kind: arenas[kind][at : at + size].view(getattr(torch, dtype)).view(shape)
            for kind, (at, size, dtype, shape) in entry["tensors"].items()
        }
        setattr(owner, attr, _layer(entry, tensors, getattr(owner, attr).bias))
    model.mstar_quantization = head + index["quantization"].partition("): ")[2]
    return model.mstar_quantization


def _entry(name: str, layer: PackedLinear) -> dict[str, Any]:
    tensors = {}
    for kind in KINDS:
        t = layer._buffers.get(kind)
        if t is not None:
            at = t.data_ptr() - t.untyped_storage().data_ptr()
            size = t.numel() * t.element_size()
            tensors[kind] = (at, size, str(t.dtype).removeprefix("torch."), list(t.shape))
    return {
        "name": name,
        "kind": layer.kind,
        "symmetric": layer.symmetric,
        "int16": layer.int16_activations,
        "lane_panels": layer.lane_panels,
        "tensors": tensors,
    }


def _layer(entry: dict[str, Any], tensors: dict[str, torch.Tensor], bias: Any) -> PackedLinear:
    """The ``PackedLinear`` of an index entry over ``tensors`` (lanes alone
    where it held no row-major copy)."""
    kind, panels = entry["kind"], tensors.get("panels")
    bias = None if bias is None or bias.is_meta else bias
    if "qweight" not in tensors:
        return PackedLinear.on_lanes(kind, tensors["lanes"], bias, panels, entry["lane_panels"])
    row_major = (tensors["qweight"], tensors.get("scales"), tensors.get("mins"))
    packed = Packed(kind, *row_major, symmetric=entry["symmetric"])
    lanes = tensors.get("lanes")
    return PackedLinear(packed, bias, panels, entry["int16"], lanes, entry["lane_panels"])


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The uint8 allocation ``t`` is a view of."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _read(path: Path) -> torch.Tensor:
    """The file at ``path`` read into memory of its own (on huge pages where the OS has them)."""
    size = path.stat().st_size
    arena = allocation(size)
    if arena is None:
        arena = torch.empty(size, dtype=torch.uint8)
    with path.open("rb") as f:
        f.readinto(memoryview(arena.numpy()))
    return arena
