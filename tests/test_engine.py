"""``mstar.engine.Engine`` on the seeded tiny random Llama, against the model
alone (HF ``generate``, or its own forward replayed through the sampler)."""

import copy
import functools
import random
from dataclasses import replace

import pytest

pytest.importorskip("transformers")
import torch

from mstar.engine import Engine, RequestTooLarge, SamplingParams, StepFailed
from mstar.engine.sampling.params import make_generator, sample_token
from mstar.models.seeded import build_model

NEW = 12


@pytest.fixture(scope="module")
def models():
    """(reference, paged twin); tests deepcopy the twin for their engines."""
    return build_model(seed=0)


def engine(models, **kwargs) -> Engine:
    options = {"num_pages": 64, "page_size": 8, "token_budget": 32} | kwargs
    return Engine(copy.deepcopy(models[1]), **options)


def prompts(count: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def hf_greedy(reference, prompt: list[int], new: int = NEW, eos=None) -> list[int]:
    ids = torch.tensor([prompt])
    out = reference.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def replay(reference, prompt, tokens, params: SamplingParams, sample: int) -> list[int]:
    """The tokens the sampler draws from the model's own logits over
    ``prompt + tokens``, with a fresh generator for ``sample``."""
    logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    generator = make_generator(params, sample, torch.device("cpu"))
    return [sample_token(row, params, generator) for row in logits[: len(tokens)]]


def test_greedy_equals_hf_generate_with_chunked_prefill(models):
    reference, _ = models
    eng = engine(models, token_budget=16)  # prompts up to 40 tokens: chunked
    batch = prompts()
    done = eng.generate(batch, SamplingParams(max_new_tokens=NEW))
    for prompt, completion in zip(batch, done):
        (out,) = completion.outputs
        assert out.token_ids == hf_greedy(reference, prompt)
        assert out.finish_reason == "length" and out.text is None
    assert eng.stats.mixed_steps > 0
    assert eng.mgr.num_free_pages == eng.mgr.num_pages and not eng.has_unfinished()


def test_a_decode_step_gets_no_logits_index_unless_the_forward_is_compiled(models):
    """A step whose every token is chosen, in order (a decode step), runs the
    head over the whole step: the forward gets ``logits_at`` None (no index
    made, checked and gathered), a prefill step the index; a forward replaced
    on the model (compiled) always gets the index. The tokens: HF's greedy."""
    reference, _ = models
    prompt = prompts(1)[0]
    for replaced in (False, True):
        eng = engine(models)
        if replaced:
            eng.model.forward = functools.partial(type(eng.model).forward, eng.model)
        seen = recorded_logits_at(eng)
        (done,) = eng.generate([prompt], SamplingParams(max_new_tokens=NEW))
        assert done.outputs[0].token_ids == hf_greedy(reference, prompt)
        prefills = len(seen) - (NEW - 1)
        none = [at is None for at in seen]
        assert none == (
            [False] * len(seen) if replaced else [False] * prefills + [True] * (NEW - 1)
        )


def recorded_logits_at(eng: Engine) -> list:
    """The ``logits_at`` of each forward ``eng`` runs from now on."""
    seen, forward = [], eng._forward_step

    def recording(*args, logits_at=None, **kwargs):
        seen.append(logits_at)
        return forward(*args, logits_at=logits_at, **kwargs)

    eng._forward_step = recording
    return seen


def test_eos_ends_a_sample_and_ignore_eos_runs_on(models):
    reference, paged = models
    prompt = prompts(1, seed=3)[0]
    free = hf_greedy(reference, prompt)
    eos = free[4]
    first = free.index(eos)
    model = copy.deepcopy(paged)
    model.generation_config.eos_token_id = eos
    eng = Engine(model, num_pages=64, page_size=8)
    (stopped,) = eng.generate([prompt], SamplingParams(max_new_tokens=NEW))[0].outputs
    assert stopped.token_ids == free[: first + 1] == hf_greedy(reference, prompt, eos=eos)
    assert stopped.finish_reason == "stop"
    (kept,) = eng.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0].outputs
    assert kept.token_ids == free and kept.finish_reason == "length"


def test_stop_token_ids(models):
    reference, _ = models
    prompt = prompts(1, seed=4)[0]
    free = hf_greedy(reference, prompt)
    stop = free[5]
    params = SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop, 100000))
    (out,) = engine(models).generate([prompt], params)[0].outputs
    assert out.token_ids == free[: free.index(stop) + 1] and out.finish_reason == "stop"


def test_n_greedy_samples_share_the_prompt_and_equal_greedy(models):
    reference, _ = models
    eng = engine(models)
    batch = prompts(3, seed=5)
    done = eng.generate(batch, SamplingParams(max_new_tokens=NEW, n=3))
    for prompt, completion in zip(batch, done):
        assert [o.index for o in completion.outputs] == [0, 1, 2]
        want = hf_greedy(reference, prompt)
        assert all(o.token_ids == want for o in completion.outputs)
    assert eng.stats.peak_shared > 0  # the samples shared their prompt's full pages
    assert eng.mgr.num_free_pages == eng.mgr.num_pages


def test_seeded_sampling_is_reproducible_and_follows_the_model(models):
    reference, _ = models
    batch = prompts(3, seed=6)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, top_k=50, n=2, seed=7)
    first = engine(models).generate(batch, params)
    again = engine(models, token_budget=8).generate(batch, params)
    other = engine(models).generate(batch, replace(params, seed=8))
    tokens = [[o.token_ids for o in c.outputs] for c in first]
    assert tokens == [[o.token_ids for o in c.outputs] for c in again]
    assert tokens != [[o.token_ids for o in c.outputs] for c in other]
    for prompt, samples in zip(batch, tokens):
        assert samples[0] != samples[1]  # each sample draws from its own generator
        for i, got in enumerate(samples):
            assert got == replay(reference, prompt, got, params, i)


def test_preemption_keeps_generated_tokens(models):
    batch = prompts(8, seed=7)
    for params in (
        SamplingParams(max_new_tokens=16),
        SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=1),
    ):
        roomy = engine(models).generate(batch, params)
        tight = engine(models, num_pages=14)
        squeezed = tight.generate(batch, params)
        assert tight.stats.preemptions > 0
        assert [[o.token_ids for o in c.outputs] for c in squeezed] == [
            [o.token_ids for o in c.outputs] for c in roomy
        ]
        assert tight.mgr.num_free_pages == 14


def test_abort_returns_pages_and_spares_the_others(models):
    batch = prompts(2, seed=8)
    params = SamplingParams(max_new_tokens=NEW)
    alone = engine(models).generate(batch[1:], params)[0]
    eng = engine(models)
    gone, kept = (eng.add_request(p, params) for p in batch)
    eng.step()
    eng.step()
    held = eng.mgr.num_free_pages
    eng.abort(gone)
    assert eng.mgr.labels(gone) == [] and eng.mgr.num_free_pages > held
    with pytest.raises(KeyError, match=gone):
        eng.abort(gone)
    finished = {}
    while eng.has_unfinished():
        finished.update((c.request_id, c) for c in eng.step() if c.finished)
    assert list(finished) == [kept]
    assert finished[kept].outputs[0].token_ids == alone.outputs[0].token_ids


def test_a_finished_request_gives_its_pages_back_at_once(models):
    eng = engine(models)
    short, long = prompts(2, seed=9)
    a = eng.add_request(short, SamplingParams(max_new_tokens=2))
    eng.add_request(long, SamplingParams(max_new_tokens=NEW))
    while True:
        done = {c.request_id for c in eng.step() if c.finished}
        if a in done:
            break
    assert eng.mgr.labels(a) == [] and eng.has_unfinished()


def test_a_request_too_big_for_the_pool_is_refused_up_front(models):
    eng = engine(models, num_pages=4)  # 32 tokens
    with pytest.raises(RequestTooLarge, match=r"'big' needs 5 KV pages.*pool has 4"):
        eng.add_request(list(range(1, 30)), SamplingParams(max_new_tokens=12), request_id="big")
    with pytest.raises(RequestTooLarge, match="n 3"):
        eng.add_request(list(range(1, 20)), SamplingParams(max_new_tokens=8, n=3))
    assert not eng.has_unfinished()
    eng.add_request(list(range(1, 30)), SamplingParams(max_new_tokens=4))  # 32 tokens: fits


def test_guided_request_follows_the_combined_logits(models):
    reference, _ = models
    cond, uncond = prompts(2, seed=10)
    eng = engine(models, token_budget=16)
    eng.add_request(prompts(1, seed=11)[0], SamplingParams(max_new_tokens=NEW))
    rid = eng.add_request(
        cond, SamplingParams(max_new_tokens=NEW), uncond_prompt=uncond, guidance_scale=1.5
    )
    done = {}
    while eng.has_unfinished():
        done.update((c.request_id, c) for c in eng.step() if c.finished)
    want = []
    with torch.no_grad():
        for _ in range(NEW):
            c = reference(torch.tensor([cond + want])).logits[0, -1]
            u = reference(torch.tensor([uncond + want])).logits[0, -1]
            want.append(int((u + 1.5 * (c - u)).argmax()))
    assert done[rid].outputs[0].token_ids == want
    assert want != hf_greedy(reference, cond)  # the guidance changed the tokens


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], None, "non-empty prompt"),
        ([1, 256], None, r"ids in \[0, 256\)"),
        ("text", None, "no tokenizer"),
        ([1, 2], SamplingParams(n=2), "n == 1 when guided"),
        ([1] * 500, SamplingParams(max_new_tokens=20), "max_position_embeddings 512"),
    ],
)
def test_bad_requests_are_refused_with_a_named_error(models, prompt, params, message):
    eng = engine(models, num_pages=200)
    uncond = [1, 2] if params is not None and params.n == 2 else None
    with pytest.raises(ValueError, match=message):
        eng.add_request(prompt, params, uncond_prompt=uncond)
    eng.add_request([1, 2], request_id="x")
    with pytest.raises(ValueError, match="'x'"):
        eng.add_request([1, 2], request_id="x")


@pytest.mark.parametrize(
    "field, value", [("max_new_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("n", 0)]
)
def test_sampling_params_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_k_1_and_a_tiny_top_p_are_greedy():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    for params in (
        SamplingParams(temperature=2.0, top_k=1, seed=0),
        SamplingParams(temperature=2.0, top_p=1e-6, seed=0),
    ):
        generator = make_generator(params, 0, torch.device("cpu"))
        assert {sample_token(logits, params, generator) for _ in range(20)} == {best}


def test_draws_follow_the_probabilities_and_never_take_a_zero():
    """``draw`` (the inverted cumulative sum) against the probabilities it
    was given: 40000 draws within 4 standard deviations of each expected
    count, a token of probability 0 never, the same draws from the same seed."""
    from mstar.engine.sampling.params import draw

    probs = torch.tensor([0.05, 0.0, 0.25, 0.6, 0.0, 0.1]) * 3  # unnormalized
    generator = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(40000)]), None, 6)
    expected = probs / probs.sum() * 40000
    sd = (expected * (1 - probs / probs.sum())).sqrt()
    assert ((counts - expected).abs() <= 4 * sd + 1e-9).all(), counts
    assert counts[1] == counts[4] == 0
    assert draw(torch.tensor([0.0, 0.0, 1.0]), generator) == 2
    again = [torch.Generator().manual_seed(9) for _ in range(2)]
    assert [draw(probs, again[0]) for _ in range(50)] == [draw(probs, again[1]) for _ in range(50)]


def test_the_greedy_token_is_torchs_argmax_ties_and_nan_included():
    """``greedy_token`` (numpy's argmax on a CPU float32 row) picks what
    ``torch.argmax`` picks: the first of equal maxima, a NaN, any dtype,
    a strided row."""
    from mstar.engine.sampling.params import greedy_token

    rows = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    rows[1, [7, 40, 299]] = 9.0  # ties: the first
    rows[2, :] = float("-inf")
    rows[3, 50] = float("nan")
    rows[4, [3, 90]] = float("inf")
    cases = [*rows, rows[5].bfloat16(), rows[:, 17], rows[0, ::2]]
    for row in cases:
        assert greedy_token(row) == int(row.argmax()), row
    assert [greedy_token(r) for r in rows[1:3]] == [7, 0]


def test_smollm2_greedy_equals_hf_generate_and_stops_at_eos(smollm2):
    from mstar.engine.prompts import chat_prompt

    reference, tokenizer = smollm2
    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "Write one sentence about cats.",
    ]
    batch = [chat_prompt(tokenizer, q) for q in questions]
    eng = Engine(copy.deepcopy(reference), tokenizer, num_pages=64, page_size=16)
    done = eng.generate(batch, SamplingParams(max_new_tokens=24))
    eos = tokenizer.eos_token_id
    for prompt, completion in zip(batch, done):
        ids = torch.tensor([prompt])
        want = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
        )[0, len(prompt) :].tolist()
        (out,) = completion.outputs
        assert out.token_ids == want
        assert (out.finish_reason == "stop") == (want[-1] == eos)
    paris = done[0].outputs[0]
    assert paris.finish_reason == "stop" and paris.token_ids[-1] == eos
    assert paris.text == "The capital of France is Paris."


def test_a_model_the_paged_path_cannot_serve_is_refused(models):
    model = copy.deepcopy(models[1])
    model.config.position_embedding_type = "alibi"
    with pytest.raises(ValueError, match="ALiBi"):
        Engine(model, num_pages=8)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_engine_on_cuda_equals_hf_generate(models):
    reference = copy.deepcopy(models[0]).cuda()
    eng = Engine(copy.deepcopy(models[1]).cuda(), num_pages=64, page_size=8, token_budget=16)
    batch = prompts(4, seed=12)
    done = eng.generate(batch, SamplingParams(max_new_tokens=NEW, n=2))
    for prompt, completion in zip(batch, done):
        ids = torch.tensor([prompt], device="cuda")
        want = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
        )[0, len(prompt) :].tolist()
        assert all(o.token_ids == want for o in completion.outputs)


@needs_cuda
def test_engine_on_cuda_through_flashinfer_answers_smollm2(smollm2):
    pytest.importorskip("flashinfer")
    from mstar.engine.prompts import chat_prompt
    from mstar.models.device import flashinfer_or_none

    reference, tokenizer = smollm2
    model = copy.deepcopy(reference).to("cuda", torch.bfloat16)
    flashinfer = flashinfer_or_none("cuda")
    assert flashinfer is not None
    eng = Engine(model, tokenizer, num_pages=64, page_size=16, flashinfer=flashinfer)
    batch = [chat_prompt(tokenizer, "What is the capital of France?")] * 2
    done = eng.generate(batch, SamplingParams(max_new_tokens=16))
    assert all("Paris" in c.outputs[0].text for c in done)


def run(eng: Engine) -> dict:
    done = {}
    while eng.has_unfinished():
        done.update((c.request_id, c) for c in eng.step() if c.finished)
    return done


def test_a_budget_smaller_than_the_rows_still_serves_everything(models):
    reference, _ = models
    cond, uncond, plain = prompts(3, seed=13)
    params = SamplingParams(max_new_tokens=6)
    tight, roomy = engine(models, token_budget=1), engine(models)
    for eng in (tight, roomy):
        eng.add_request(cond, params, uncond_prompt=uncond, guidance_scale=1.5, request_id="g")
        eng.add_request(plain, SamplingParams(max_new_tokens=6, n=3), request_id="f")
    done, want = run(tight), run(roomy)
    assert done["g"].outputs[0].token_ids == want["g"].outputs[0].token_ids
    assert [o.token_ids for o in done["f"].outputs] == [hf_greedy(reference, plain, new=6)] * 3


def test_num_pages_none_sizes_the_pool_from_memory(models):
    from mstar.models.device import HOST_POOL_BYTES

    eng = Engine(copy.deepcopy(models[1]), page_size=8)
    cache = eng.cache
    page_bytes = cache.num_layers * 2 * 8 * cache.num_kv_heads * cache.head_dim * 4
    assert eng.mgr.num_pages > 1 and eng.mgr.num_pages * page_bytes <= HOST_POOL_BYTES


def test_from_pretrained_smollm2_answers_a_string_prompt(smollm2):
    eng = Engine.from_pretrained("smollm2", num_pages=16)
    prompt = "The capital of France is"
    (done,) = eng.generate([prompt], SamplingParams(max_new_tokens=3))
    ids = eng.tokenizer.encode(prompt)
    assert done.prompt_token_ids == ids and " Paris" in done.outputs[0].text


def test_prefix_cache_reuses_shared_prefixes_exactly(models):
    reference, _ = models
    system = prompts(1, seed=11)[0] * 2  # a shared "system prompt" of several pages
    batch = [system + p for p in prompts(5, seed=12)]
    off = engine(models, prefix_cache=False).generate(batch, SamplingParams(max_new_tokens=8))
    eng = engine(models)
    first = eng.generate(batch[:1], SamplingParams(max_new_tokens=8))  # caches the system prompt
    rest = eng.generate(batch[1:], SamplingParams(max_new_tokens=8))
    stats = eng.mgr.prefix_stats()
    assert stats["tokens_hit"] >= 4 * (len(system) // 8 * 8)  # every later request hit it
    outputs = [c.outputs[0].token_ids for c in first + rest]
    assert outputs == [c.outputs[0].token_ids for c in off]
    assert outputs[2] == hf_greedy(reference, batch[2], 8)
    again = eng.generate(batch[:1], SamplingParams(max_new_tokens=8))  # prompt + answer cached
    assert again[0].outputs[0].token_ids == outputs[0]


@pytest.mark.parametrize("new", [2, 8], ids=["tail", "filled page"])
def test_a_repeated_prompt_computes_only_its_last_token(models, new):
    """37 tokens, pages of 8: the repeat takes 4 pages and 4 tokens of the
    fifth, copied from the first run's partial last page (``tail``) or from
    the page its answer filled, and answers exactly as without the cache
    (its log-probabilities too: wrong KV moves them)."""
    prompt = [random.Random(21).randrange(1, 256) for _ in range(37)]
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, logprobs=1)
    (off,) = engine(models, prefix_cache=False).generate([prompt], params)
    eng = engine(models)
    (first,) = eng.generate([prompt], params)
    hit = eng.mgr.prefix_stats()["tokens_hit"]
    (again,) = eng.generate([prompt], params)
    assert eng.mgr.prefix_stats()["tokens_hit"] - hit == 36  # whole pages alone: 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == off.outputs[0].token_ids
    want = [r.chosen.logprob for r in off.outputs[0].logprobs]
    assert [r.chosen.logprob for r in again.outputs[0].logprobs] == pytest.approx(want, abs=1e-4)


def test_smollm2_chat_prompts_share_the_system_prompt_from_cache(smollm2):
    from mstar.engine.prompts import chat_prompt

    reference, tokenizer = smollm2
    batch = [chat_prompt(tokenizer, q) for q in ("What is 2 + 2?", "Name a red fruit.")]
    eng = Engine(copy.deepcopy(reference), tokenizer, num_pages=64, page_size=16)
    done = [eng.generate([p], SamplingParams(max_new_tokens=8))[0] for p in batch]
    assert eng.mgr.prefix_stats()["tokens_hit"] >= 16  # the template's system prompt
    for prompt, completion in zip(batch, done):
        ids = torch.tensor([prompt])
        want = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
        )[0, len(prompt) :].tolist()
        assert completion.outputs[0].token_ids == want


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=8, n=3)],
    ids=["decode", "fork"],
)
def test_a_request_that_never_fits_is_dropped_not_retried_forever(models, params):
    """Past an intake that let it in (here: told of a bigger pool), a request
    that cannot fit even with every other one preempted fails its step with
    ``RequestTooLarge`` as the cause; the others finish exactly."""
    small = prompts(1, seed=12)[0][:6]
    alone = engine(models).generate([small], SamplingParams(max_new_tokens=4))[0]
    eng = engine(models, num_pages=4)
    eng.intake = replace(eng.intake, num_pages=10**6)
    big = eng.add_request(list(range(1, 30 if params.n == 1 else 20)), params, request_id="big")
    kept = eng.add_request(small, SamplingParams(max_new_tokens=4))
    finished, failed = {}, []
    for _ in range(200):  # bounded: the old engine looped here without end
        if not eng.has_unfinished():
            break
        try:
            finished.update((c.request_id, c) for c in eng.step() if c.finished)
        except StepFailed as err:
            failed.append(err)
    assert not eng.has_unfinished()
    assert [big in err.request_ids for err in failed] == [True]
    cause = failed[0].__cause__
    assert isinstance(cause, RequestTooLarge) and "'big' does not fit the pool of 4" in str(cause)
    if params.n == 1:  # refused before its step ran: the other request lost nothing
        assert finished[kept].outputs[0].token_ids == alone.outputs[0].token_ids
    assert eng.mgr.num_free_pages == 4
    eng.mgr.check_invariants()
