"""The compiled forward (``Engine(..., compile=True)``): exact in float32
against HF, one graph for every step, and eager when it cannot compile."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from mstar.cli import main
from mstar.engine import Engine, SamplingParams
from mstar.models import compiled as compiled_module
from mstar.models.seeded import build_model

OPTIONS = {"num_pages": 64, "page_size": 8, "token_budget": 32}


def test_token_counts_pad_to_a_few_buckets():
    assert [compiled_module.cpu_bucket(n) for n in (1, 2, 3, 37)] == [2, 2, 3, 37]
    want = [2, 2, 4, 4, 8, 32, 32, 64]
    assert [compiled_module.cuda_bucket(n) for n in (1, 2, 3, 4, 5, 31, 32, 33)] == want


@pytest.fixture(scope="module")
def models():
    return build_model(seed=0)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def _hf(reference, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = reference.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_compiled_float32_is_exact_against_hf_in_one_graph(models):
    from torch._dynamo.utils import counters

    reference, paged = models
    engine = Engine(copy.deepcopy(paged), compile=True, **OPTIONS)
    assert engine.compiled.startswith("compiled"), engine.compiled
    assert engine.stats.steps == 0 and not engine.has_unfinished()
    graphs = counters["stats"]["unique_graphs"]
    prompts = _prompts(7, seed=3)  # chunked prefills, mixed and decode steps of 1..7 rows
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    done = engine.generate(prompts, params)
    assert [d.outputs[0].token_ids for d in done] == [_hf(reference, p, 12) for p in prompts]
    (one,) = engine.generate([prompts[0][:5]], params)  # a lone request: 1-token steps
    assert one.outputs[0].token_ids == _hf(reference, prompts[0][:5], 12)
    assert counters["stats"]["unique_graphs"] == graphs, "a step recompiled"


def test_a_forward_that_does_not_compile_runs_eager_and_exact(models, monkeypatch):
    def failing(fn, **options):
        def run(*args, **kwargs):
            raise RuntimeError("no backend here\nsecond line")

        return run

    monkeypatch.setattr(compiled_module.torch, "compile", failing)
    reference, paged = models
    engine = Engine(copy.deepcopy(paged), compile=True, **OPTIONS)
    assert engine.compiled == "eager: the forward does not compile (RuntimeError: no backend here)"
    assert "forward" not in vars(engine.model) and engine.stats.steps == 0
    prompt = _prompts(1, seed=5)[0]
    (done,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert done.outputs[0].token_ids == _hf(reference, prompt, 6)


@pytest.mark.parametrize(
    "flag, fused, compiles",
    [([], False, True), ([], True, False), (["--enforce-eager"], False, False)],
)
def test_the_cli_compiles_unless_told_not_to_or_fused(flag, fused, compiles, monkeypatch, capsys):
    """The CLI compiles the forward unless ``--enforce-eager``, or the
    engine runs the fused forward (faster eager than HF's compiled one)."""
    asked = []

    def record(engine):
        asked.append(True)
        return "compiled (0 s)"

    monkeypatch.delenv("MSTAR_KV_ENFORCE_EAGER", raising=False)
    monkeypatch.setattr("mstar.engine.build.compiled_or_why", record)
    if not fused:  # as the CLI decides it (make_engine) and as the engine says it
        monkeypatch.setattr("mstar.models.hf.runs_fused", lambda model: False)
        monkeypatch.setattr("mstar.engine.engine.runs_fused", lambda model: False)
    # float32: the fused forward's dtype (auto is bfloat16 on a CPU with a native one)
    args = ["demo", "--model", "random", "--dtype", "float32", "--quiet", "--requests", "2"]
    assert main([*args, "--max-new-tokens", "2", *flag]) == 0
    err = capsys.readouterr().err
    assert bool(asked) == compiles
    assert ("weights, forward compiled (0 s), checked: agrees" in err) == compiles
    assert ("forward eager, fused layers (faster than compiled)" in err) == fused


def test_compiled_verify_rows_are_exact_against_hf(models):
    """Speculative verify rows (several logits a row) through the compiled
    forward: greedy equals HF, drafts accepted, still one graph."""
    from torch._dynamo.utils import counters

    reference, paged = models
    engine = Engine(copy.deepcopy(paged), compile=True, speculative="ngram", **OPTIONS)
    graphs = counters["stats"]["unique_graphs"]
    base = _prompts(3, seed=5)
    prompts = [p + p[:12] + p for p in base]  # text that repeats itself: drafts match
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    done = engine.generate(prompts, params)
    assert [d.outputs[0].token_ids for d in done] == [_hf(reference, p, 16) for p in prompts]
    assert engine.stats.spec_accepted > 0, engine.stats
    assert counters["stats"]["unique_graphs"] == graphs, "a verify step recompiled"


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_compile_must_be_a_bool(models, value):
    with pytest.raises(TypeError, match=f"expected compile a bool, got {value!r}"):
        Engine(copy.deepcopy(models[1]), compile=value, **OPTIONS)
