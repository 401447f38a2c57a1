"""The compiled forward on CUDA (CUDA graphs around the attention op, token
counts padded to powers of two) against the eager engine on the same GPU,
on the seeded tiny Llama (CUDA only; the GPU check's "compiled" stage)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("transformers")

from mstar.engine import Engine, SamplingParams
from mstar.models.seeded import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
OPTIONS = {"num_pages": 64, "page_size": 8, "token_budget": 32, "flashinfer": None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cuda_engine_equals_the_eager_one(dtype):
    model = build_model(seed=0)[1].to("cuda", dtype)
    eager = Engine(copy.deepcopy(model), **OPTIONS)
    compiled = Engine(copy.deepcopy(model), compile=True, **OPTIONS)
    assert compiled.compiled.startswith("compiled"), compiled.compiled
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    want = [d.outputs[0].token_ids for d in eager.generate(prompts, params)]
    got = [d.outputs[0].token_ids for d in compiled.generate(prompts, params)]
    if dtype == torch.float32:
        assert got == want
    else:  # bfloat16: the same tokens up to rounding; most agree
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        assert same >= 0.8 * sum(map(len, want))
