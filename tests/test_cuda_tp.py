"""Tensor parallelism on 2 GPUs (NCCL) against one GPU, on the tiny seeded
Llama of tests/test_tp.py (the GPU check's TP stage; skipped with fewer
than 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_tp import OPTIONS, prompts, tiny_llama

from mstar.engine import Engine, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def test_two_gpus_give_the_tokens_of_one(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=10, n=2),
              SamplingParams(max_new_tokens=14)]  # fmt: skip
    one = Engine.from_pretrained(str(tmp_path), device="cuda", **OPTIONS)
    want = [[o.token_ids for o in c.outputs] for c in one.generate(prompts(), params)]
    with Engine.from_pretrained(
        str(tmp_path), device="cuda", tensor_parallel_size=2, **OPTIONS
    ) as two:
        assert two.cache.num_kv_heads == 2 and two.cache.device == torch.device("cuda", 0)
        got = [[o.token_ids for o in c.outputs] for c in two.generate(prompts(), params)]
        assert two.stats.preemptions > 0
    assert got == want
