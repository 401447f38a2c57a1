"""The weights' dtype: ``--dtype``/``dtype=`` strings, ``auto``'s choice,
and bfloat16 against Hugging Face in bfloat16."""

from __future__ import annotations

import copy

import pytest
import torch

from mstar.cli import main
from mstar.engine import Engine, SamplingParams
from mstar.models.dtypes import DTYPE_CHOICES, resolve_dtype

# bfloat16 against HF in bfloat16 on SmolLM2 (the demo's questions): the
# first token's logits within LOGIT_TOL of HF's (their spread is ~30), and
# greedy answers equal HF's for at least GREEDY_SHARE of their tokens
# (compared up to the first difference). Measured here: 0.64 and 61/78.
LOGIT_TOL = 1.0
GREEDY_SHARE = 0.5


@pytest.mark.parametrize(
    "value, want",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
     (torch.float16, torch.float16)],
)  # fmt: skip
def test_named_dtypes_resolve_as_asked(value, want):
    assert resolve_dtype(value).dtype == want


def test_auto_takes_bfloat16_where_the_cpu_multiplies_it_natively(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == torch.bfloat16 and "AVX512-BF16" in choice.describe()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == torch.float32 and "no native bfloat16" in choice.describe()
    assert resolve_dtype("auto", "cuda").dtype == torch.bfloat16
    assert DTYPE_CHOICES == ("auto", "float32", "bfloat16", "float16")


def test_auto_for_packed_weights_takes_the_packed_kernels_arithmetic(monkeypatch):
    """A GGUF in its own weights, int8/int4 at load: bfloat16 arithmetic
    wherever the packed kernels run (the panels with AVX512-BF16, int16
    activations without), and says which; without the kernels the
    native-bfloat16 rule holds."""
    from mstar.models import dtypes
    from mstar.serve.options import resolved_dtype

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(dtypes, "_packed_kernels_run", lambda: True)
    monkeypatch.setattr(dtypes, "_bf16_packed_runs", lambda: False)
    choice = resolved_dtype("auto", "cpu", model="smollm2", quantization="auto")
    assert choice.dtype == torch.bfloat16 and "rounded to int16" in choice.describe()
    for model, quantization in [("m.gguf", "gguf"), ("folder", "int8"), ("folder", "int4")]:
        assert resolved_dtype("auto", "cpu", model=model, quantization=quantization).dtype == (
            torch.bfloat16
        )
    assert resolved_dtype("float32", "cpu", model="smollm2", quantization="auto").dtype == (
        torch.float32
    )
    for model, quantization in [("smollm2", "none"), ("folder", "auto"), ("m.gguf", "none")]:
        assert resolved_dtype("auto", "cpu", model=model, quantization=quantization).dtype == (
            torch.bfloat16
        )
    assert resolved_dtype("bfloat16", "cpu", model="smollm2", quantization="auto").dtype == (
        torch.bfloat16
    )
    monkeypatch.setattr(dtypes, "_bf16_packed_runs", lambda: True)
    choice = resolved_dtype("auto", "cpu", model="smollm2", quantization="auto")
    assert choice.dtype == torch.bfloat16 and "AVX512-BF16" in choice.describe()
    assert resolved_dtype("auto", "cpu", exact=True, model="smollm2").dtype == torch.float32
    monkeypatch.setattr(dtypes, "_packed_kernels_run", lambda: False)
    assert resolve_dtype("auto", "cpu", packed=True).dtype == torch.bfloat16


@pytest.mark.parametrize("value", ["float64x", "fp32", torch.int8, 3])
def test_a_bad_dtype_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=repr(value).replace("(", r"\(").replace(")", r"\)")):
        resolve_dtype(value)
    with pytest.raises(ValueError, match="expected dtype"):
        Engine.from_pretrained("/nonexistent", dtype=value)


@pytest.mark.parametrize("command", [["generate", "hi"], ["demo"], ["serve"]])
def test_cli_refuses_a_bad_dtype_in_one_line(command, capsys):
    assert main([*command, "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--dtype fp8" in err and "'fp8'" in err


def test_bfloat16_matches_hf_in_bfloat16(smollm2):
    from mstar.cli.demo import CHAT_QUESTIONS
    from mstar.engine.prompts import chat_prompt

    model, tokenizer = smollm2
    reference = copy.deepcopy(model).to(torch.bfloat16)
    engine = Engine(copy.deepcopy(reference), tokenizer, num_pages=64)
    assert engine.cache.dtype == torch.bfloat16
    first: list[torch.Tensor] = []
    step = engine._forward_step

    def recording(*args, **kwargs):
        logits = step(*args, **kwargs)
        first.append(logits)
        return logits

    prompts = [chat_prompt(tokenizer, q) for q in CHAT_QUESTIONS[:4]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine._forward_step = recording
    done = engine.generate(prompts, params)
    agree = total = 0
    worst = 0.0
    for prompt, logits_row, out in zip(prompts, first[0], done):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want_logits = reference(ids).logits[0, -1]
            want = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
            )[0, len(prompt) :].tolist()
        assert logits_row.dtype == torch.bfloat16
        diff = float((logits_row.float() - want_logits.float()).abs().max())
        worst = max(worst, diff)
        assert diff <= LOGIT_TOL
        got = out.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        agree, total = agree + same, total + len(want)
    print(f"greedy agreement {agree}/{total}, logits max diff {worst:.3f}")
    assert agree >= GREEDY_SHARE * total, f"greedy agreement {agree}/{total}"
