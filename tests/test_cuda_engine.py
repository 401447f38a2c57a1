"""The engine with its model on CUDA against the same engine on the CPU, on
the seeded tiny Llama (CUDA only; the GPU check's third stage). Attention is
the portable ``paged_attention`` here; FlashInfer's turn is
tests/test_flashinfer_cuda.py."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("transformers")

from mstar.engine import Engine, SamplingParams
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.step import KVStep, Segment
from mstar.models.hf import forward_step
from mstar.models.seeded import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def twin() -> torch.nn.Module:
    """The tiny Llama the engines serve (deep-copied for each engine)."""
    return build_model(seed=0)[1]


def _engine(model: torch.nn.Module, device: str, **kwargs) -> Engine:
    options = {"num_pages": 64, "page_size": 8, "token_budget": 32} | kwargs
    return Engine(copy.deepcopy(model).to(device), flashinfer=None, **options)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(3, 40))] for _ in range(count)]


CASES = {  # options, prompts (count, seed), new tokens
    "default": ({}, (6, 1), 12),
    "chunked-prefill": ({"token_budget": 16}, (6, 1), 12),
    "preempting": ({"num_pages": 14}, (8, 7), 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_engine_is_token_exact_with_the_cpu_engine(twin, case):
    options, (count, seed), new = CASES[case]
    prompts = _prompts(count, seed)
    prompts[3] = prompts[0][:20] + prompts[3]  # a shared prefix for the prefix cache
    params = SamplingParams(max_new_tokens=new)
    cpu = _engine(twin, "cpu", **options)
    cuda = _engine(twin, "cuda", **options)
    assert cuda.cache.layer(0).device.type == "cuda"
    expected = [c.outputs[0].token_ids for c in cpu.generate(prompts, params)]
    got = [c.outputs[0].token_ids for c in cuda.generate(prompts, params)]
    assert got == expected
    assert (cuda.stats.steps, cuda.stats.preemptions) == (cpu.stats.steps, cpu.stats.preemptions)
    assert cuda.stats.preemptions > 0 or case != "preempting"


def test_cuda_engine_forks_and_guides_as_the_cpu_engine(twin):
    """n > 1 (greedy: every sample equal) and a guided request."""
    results = []
    for device in ("cpu", "cuda"):
        eng = _engine(twin, device)
        a = eng.add_request(_prompts(1, 2)[0], SamplingParams(max_new_tokens=10, n=3))
        b = eng.add_request(
            _prompts(1, 3)[0],
            SamplingParams(max_new_tokens=10),
            uncond_prompt=[1, 2, 3],
            guidance_scale=1.5,
        )
        done = {}
        while eng.has_unfinished():
            done.update((c.request_id, c) for c in eng.step() if c.finished)
        results.append([[o.token_ids for o in done[r].outputs] for r in (a, b)])
    assert results[0] == results[1]
    assert len({tuple(t) for t in results[1][0]}) == 1


@torch.no_grad()
def test_cuda_step_logits_match_the_cpu(twin):
    """One mixed packed step through forward_step: the logits themselves."""
    logits = []
    for device in ("cpu", "cuda"):
        eng = _engine(twin, device, prefix_cache=False)
        mgr: KVManager = eng.mgr
        ids = {"a": _prompts(1, 4)[0], "b": _prompts(1, 5)[0]}
        first = KVStep(tuple(Segment(r, "main", len(t) - 1) for r, t in ids.items()))
        mgr.admit(first)
        plan = mgr.plan(first)["main"]
        feed = torch.tensor([x for t in ids.values() for x in t[:-1]], device=device)
        forward_step(eng.model, feed, plan, eng.cache)
        mgr.commit(first)
        step = KVStep((*(Segment(r, "main", 1) for r in ids), Segment("c", "main", 7)))
        mgr.admit(step)
        plan = mgr.plan(step)["main"]
        feed = torch.tensor([t[-1] for t in ids.values()] + list(range(1, 8)), device=device)
        logits.append(forward_step(eng.model, feed, plan, eng.cache).cpu())
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
