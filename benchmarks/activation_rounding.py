"""What rounding the activations costs on a real model: SmolLM2-135M's GGUF
(Q4_1, head Q8_0) scored in llama-perplexity's protocol, ours in float32
arithmetic, in bfloat16 (panels at 9+ rows, int16 activations below) and
with int8 rows (activations rounded to int8 per group of 32, what lanes
held without panels take at 2+ rows: ``PackedLinear.int8_rows``).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/activation_rounding.py \\
        [--text FILE] [--llama-perplexity BIN] [--llama-quantize BIN]

The protocol (llama.cpp's ``perplexity``): the text's tokens (no BOS: the
file's ``add_bos_token`` is false) cut into chunks of 512, each run alone,
the second half of each scored. Prints each mode's perplexity, its KL
divergence from float32 and how often its top token is float32's. With
``--llama-perplexity`` (and ``--llama-quantize``, to write the file's F32
dequantization), llama.cpp's perplexity on the file and on its F32 twin:
what its own int8 activations cost it. The default text is this repo's
docs (engine, KV layer, serving: ~12k tokens).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

import mstar.cpu.quant as quant
from mstar.cpu.info import cpu_info
from mstar.models.loader import load, smollm2_path

CHUNK = 512
DOCS = Path(__file__).resolve().parents[1] / "docs"
# (label, panels held: bytes at most, dtype): held panels under the bound; none above it
MODES = (
    ("float32", quant.HELD_PANELS_BYTES, torch.float32),
    ("bfloat16 (panels + int16)", quant.HELD_PANELS_BYTES, torch.bfloat16),
    ("int8 rows", 0, torch.bfloat16),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, help="text to score (default: docs/*.md)")
    parser.add_argument("--llama-perplexity", help="llama.cpp's llama-perplexity binary")
    parser.add_argument("--llama-quantize", help="llama-quantize, to write the F32 twin")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "text.txt"
        text.write_text(args.text.read_text() if args.text else default_text())
        print(cpu_info().describe())
        scored = {label: score(text.read_text(), held, dtype, Path(scratch) / str(held))
                  for label, held, dtype in MODES}  # fmt: skip
        base = scored["float32"][1]
        print("\n| mode | perplexity | KL from float32 | top-1 = float32's |\n|---|---:|---:|---:|")
        for label, (ppl, logprobs) in scored.items():
            kl = (base.exp() * (base - logprobs)).sum(-1).mean().item()
            top = (logprobs.argmax(-1) == base.argmax(-1)).float().mean().item()
            print(f"| {label} | {ppl:.3f} | {kl:.2e} | {top:.2%} |")
        if args.llama_perplexity:
            print(f"\nllama.cpp on the file: {llama(args.llama_perplexity, smollm2_path(), text)}")
            if args.llama_quantize:
                twin = Path(scratch) / "f32.gguf"
                subprocess.run([args.llama_quantize, "--allow-requantize", str(smollm2_path()),
                                str(twin), "F32"], check=True, capture_output=True)  # fmt: skip
                print(
                    f"llama.cpp on its F32 dequantization: {llama(args.llama_perplexity, twin, text)}"
                )


def default_text() -> str:
    return "".join((DOCS / f"{name}.md").read_text() for name in ("engine", "kv-layer", "serving"))


def score(text: str, held: int, dtype: torch.dtype, cache: Path) -> tuple[float, torch.Tensor]:
    """Perplexity of SmolLM2 on ``text`` (the protocol above) in ``dtype``
    with panels held up to ``held`` bytes (its own stored layers under
    ``cache``), and the scored tokens' log-probabilities [T, V]."""
    quant.HELD_PANELS_BYTES, os.environ["MSTAR_KV_CACHE"] = held, str(cache)
    model, tokenizer = load("smollm2", dtype=dtype, quantization="gguf")
    model.config._attn_implementation = "eager"  # no plan: the model's own attention
    ids = tokenizer.encode(text, add_special_tokens=False)
    nll, kept = 0.0, []
    for start in range(0, len(ids) - CHUNK + 1, CHUNK):
        chunk = torch.tensor([ids[start : start + CHUNK]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(chunk).logits[0].float(), -1)[CHUNK // 2 : -1]
        nll -= logprobs.gather(1, chunk[0, CHUNK // 2 + 1 :, None]).sum().item()
        kept.append(logprobs)
    scored = torch.cat(kept)
    print(f"{model.mstar_quantization}: {len(kept)} chunks", flush=True)
    return math.exp(nll / len(scored)), scored


def llama(binary: str, model: Path, text: Path) -> str:
    """llama-perplexity's final estimate on ``model`` (its default environment)."""
    out = subprocess.run(
        [binary, "-m", str(model), "-f", str(text), "-c", str(CHUNK), "-b", str(CHUNK), "-t", "2"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out.stdout + out.stderr)
    return f"PPL {found[1]} +/- {found[2]}" if found else "no estimate printed"


if __name__ == "__main__":
    main()
