"""logprobs, prompt logprobs, penalties, biases and min_p in the engine,
against the model's own logits (the oracle: HF's forward and generate)."""

from __future__ import annotations

import copy

import pytest
import torch

from mstar.engine import Engine, SamplingParams
from mstar.models.seeded import build_model

POOL = {"num_pages": 48, "page_size": 8, "token_budget": 8}  # prompts span chunks


@pytest.fixture(scope="module")
def pair():
    return build_model(0)  # (oracle, twin for the engine)


def engine_of(pair, **kwargs) -> Engine:
    return Engine(copy.deepcopy(pair[1]), **{**POOL, **kwargs})


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 1 for j in range(n)]


@torch.no_grad()
def own_logprobs(oracle, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of ``ids``, float32."""
    return torch.log_softmax(oracle(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_equal_the_models_own_and_prompt_logprobs_every_prompt_token(pair):
    """Greedy, chunked prefill, two requests sharing a cached prefix (the
    one asking prompt logprobs computes every position anyway)."""
    oracle = pair[0]
    shared = prompt(20, 1)
    prompts = [shared + prompt(5, 2), shared + prompt(9, 3)]
    params = SamplingParams(max_new_tokens=5, logprobs=4, prompt_logprobs=3)
    engine = engine_of(pair)
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=2))  # caches the prefix
    for p, c in zip(prompts, engine.generate(prompts, params)):
        out = c.outputs[0]
        ref = own_logprobs(oracle, p + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, rec) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(p) - 1 + i]
            assert rec.chosen.token_id == token
            assert rec.chosen.logprob == pytest.approx(float(row[token]), abs=1e-4)
            top = [t.logprob for t in rec.top]
            assert len(top) == 4 and top == sorted(top, reverse=True)
            assert rec.top[0].token_id == token  # greedy: the chosen one is the most likely
            assert top == pytest.approx(row.topk(4).values.tolist(), abs=1e-4)
        assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            rec = c.prompt_logprobs[j]
            assert rec.chosen.token_id == p[j]
            assert rec.chosen.logprob == pytest.approx(float(ref[j - 1, p[j]]), abs=1e-4)
            assert len(rec.top) == 3


def test_sampled_logprobs_are_after_temperature(pair):
    params = SamplingParams(max_new_tokens=4, temperature=0.7, seed=5, logprobs=2, n=2)
    p = prompt(12, 4)
    c = engine_of(pair).generate([p], params)[0]
    for out in c.outputs:
        logits = pair[0](torch.tensor([p + out.token_ids])).logits[0].float().detach()
        for i, (token, rec) in enumerate(zip(out.token_ids, out.logprobs)):
            want = torch.log_softmax(logits[len(p) - 1 + i] / 0.7, dim=-1)[token]
            assert rec.chosen.logprob == pytest.approx(float(want), abs=1e-4)


def test_prompt_logprobs_survive_a_preemption(pair):
    """A pool too small for both: the younger is preempted and recomputed;
    every prompt token still has its record, equal to the model's."""
    p = prompt(30, 6)
    engine = engine_of(pair, num_pages=8)
    params = SamplingParams(max_new_tokens=24, prompt_logprobs=1, logprobs=1)
    got = engine.generate([p, prompt(30, 7)], params)
    assert engine.stats.preemptions > 0
    for c in got:
        ids = c.prompt_token_ids
        ref = own_logprobs(pair[0], ids + c.outputs[0].token_ids)
        assert all(c.prompt_logprobs[j].chosen.logprob == pytest.approx(
            float(ref[j - 1, ids[j]]), abs=1e-4) for j in range(1, len(ids)))  # fmt: skip
        assert len(c.outputs[0].logprobs) == len(c.outputs[0].token_ids)


@torch.no_grad()
def openai_penalized_greedy(oracle, p: list[int], new: int, presence: float, frequency: float):
    """Greedy decoding applying OpenAI's formula to HF's logits, one token at a time."""
    out: list[int] = []
    for _ in range(new):
        logits = oracle(torch.tensor([p + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.numel())
        logits = logits - presence * (counts > 0).float() - frequency * counts.float()
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.8), (0.5, 0.5)])
def test_presence_and_frequency_penalties_follow_openais_formula(pair, presence, frequency):
    prompts = [prompt(11, 8), prompt(4, 9)]
    params = SamplingParams(
        max_new_tokens=10, presence_penalty=presence, frequency_penalty=frequency
    )
    got = engine_of(pair).generate(prompts, params)
    plain = engine_of(pair).generate(prompts, SamplingParams(max_new_tokens=10))
    for p, c in zip(prompts, got):
        want = openai_penalized_greedy(pair[0], p, 10, presence, frequency)
        assert c.outputs[0].token_ids == want
    assert any(c.outputs[0].token_ids != b.outputs[0].token_ids for c, b in zip(got, plain))


def test_repetition_penalty_equals_hf_generate(pair):
    prompts = [prompt(9, 8), prompt(9, 15)]  # HF's greedy repeats itself on both
    got = engine_of(pair).generate(
        prompts, SamplingParams(max_new_tokens=10, repetition_penalty=1.7)
    )
    for p, c in zip(prompts, got):
        ids = torch.tensor([p])
        hf = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 10, "do_sample": False}
        want = pair[0].generate(ids, repetition_penalty=1.7, pad_token_id=0, **hf)
        plain = pair[0].generate(ids, pad_token_id=0, **hf)
        assert c.outputs[0].token_ids == want[0, len(p) :].tolist() != plain[0, len(p) :].tolist()


def test_logit_bias_forces_and_bans_tokens_and_min_p_keeps_the_likely(pair):
    p = prompt(6, 12)
    forced = engine_of(pair).generate([p], SamplingParams(max_new_tokens=4, logit_bias={42: 100}))
    assert forced[0].outputs[0].token_ids == [42] * 4
    plain = engine_of(pair).generate([p], SamplingParams(max_new_tokens=4))[0].outputs[0]
    first = plain.token_ids[0]
    banned = engine_of(pair).generate(
        [p], SamplingParams(max_new_tokens=1, logit_bias={first: -100})
    )
    assert banned[0].outputs[0].token_ids[0] != first
    # min_p = 1 keeps only the most likely: sampling at any temperature is greedy
    sampled = SamplingParams(max_new_tokens=4, temperature=1.5, min_p=1.0, seed=1)
    assert engine_of(pair).generate([p], sampled)[0].outputs[0].token_ids == plain.token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_bias_outside_the_vocabulary_and_guided_extras_are_refused(pair):
    engine = engine_of(pair)
    with pytest.raises(ValueError, match="logit_bias ids in"):
        engine.add_request([1, 2], SamplingParams(logit_bias={256: 1}))
    with pytest.raises(ValueError, match="when guided"):
        engine.add_request([1, 2], SamplingParams(logprobs=1), uncond_prompt=[3])
    assert not engine.has_unfinished()
