"""Speculative decoding: the KV manager's short commits and rewinds, the
n-gram proposer, and the engine with drafts against the engine without (tiny
seeded models; one SmolLM2 run)."""

import copy
import random

import numpy as np
import pytest

pytest.importorskip("transformers")

from mstar.engine import Engine, SamplingParams
from mstar.engine.resources.groups import KVGroups
from mstar.engine.resources.kv.manager import InvalidStep, KVManager
from mstar.engine.resources.step import KVStep, Segment
from mstar.engine.sampling.speculative import ngram_draft
from mstar.models.seeded import build_model


def run(mgr, segments, tokens=None, kept=None, **kwargs):
    step = KVStep(tuple(Segment(*s) for s in segments), tokens=tokens, **kwargs)
    mgr.admit(step)
    mgr.plan(step)
    mgr.commit(step, kept)
    return step


# --- the n-gram proposer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("history", "k", "want"),
    [
        ([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3], 4, [7, 8, 1, 2]),  # longest suffix, latest
        ([5, 6, 7, 5, 6], 3, [7, 5, 6]),
        ([5, 6, 7, 8], 3, []),  # no earlier occurrence
        ([1, 1, 1, 1, 1, 1, 1, 1], 3, [1, 1, 1]),  # the latest one with k tokens after it
        ([9, 3, 4, 8, 2, 4], 3, []),  # only a 1-token suffix matches: below min_n
    ],
)
def test_ngram_draft_follows_the_longest_suffix(history, k, want):
    assert ngram_draft(np.array(history), k).tolist() == want


def test_ngram_draft_prefers_a_longer_match_over_a_later_one():
    h = np.array([7, 2, 3, 50, 51, 9, 3, 60, 7, 2, 3])  # [7, 2, 3] at 0; [3] alone at 6
    assert ngram_draft(h, 2, min_n=1).tolist() == [50, 51]


# --- the KV operation ------------------------------------------------------------------------


def test_a_short_commit_keeps_the_accepted_tokens_and_returns_the_rest():
    mgr = KVManager(16, 4)
    run(mgr, [("a", "m", 6), ("b", "m", 3)])
    free = mgr.num_free_pages
    run(mgr, [("a", "m", 5), ("b", "m", 5)], kept=[1, 5])  # a: 7 tokens, b: 8
    assert (mgr.stored_len("a", "m"), mgr.held_pages("a", "m")) == (7, 2)
    assert (mgr.stored_len("b", "m"), mgr.held_pages("b", "m")) == (8, 2)
    assert mgr.num_free_pages == free - 1  # b's second page; a's third went back
    mgr.check_invariants()
    mgr.rewind("b", "m", 5)  # after the commit: 3 tokens, one page
    assert (mgr.stored_len("b", "m"), mgr.held_pages("b", "m")) == (3, 1)
    mgr.check_invariants()
    mgr.release("a")
    mgr.release("b")
    assert mgr.num_free_pages == 16


@pytest.mark.parametrize(
    ("kept", "kwargs", "match"),
    [
        ([1], {}, "expected kept 2 ints"),
        ([1, 6], {}, r"\[0, 5\].*request 'b', label 'm', got 6"),
        ([-1, 0], {}, r"request 'a', label 'm', got -1"),
        ([1.0, 2.0], {}, "expected kept 2 ints"),
        ([1, 5], {"post_forks": (("m", "x"),)}, "without post-forks"),
        ([1, 5], {"commit": False}, "without commit=False"),
    ],
)
def test_a_bad_kept_is_refused_naming_the_row_before_any_change(kept, kwargs, match):
    mgr = KVManager(16, 4)
    run(mgr, [("a", "m", 6), ("b", "m", 3)])
    step = KVStep((Segment("a", "m", 5), Segment("b", "m", 5)), **kwargs)
    mgr.admit(step)
    mgr.plan(step)
    free = mgr.num_free_pages
    with pytest.raises(InvalidStep, match=match):
        mgr.commit(step, kept)
    assert mgr.num_free_pages == free and mgr.stored_len("b", "m") == 3
    mgr.commit(step)  # still admitted and planned: it commits whole
    mgr.check_invariants()


def test_bad_rewinds_are_refused_before_any_change():
    mgr = KVManager(16, 4)
    run(mgr, [("a", "m", 6)])
    run(mgr, [("a", "m", 0)], post_forks=(("m", "f"),))  # f shares a's full page
    with pytest.raises(InvalidStep, match=r"\[0, 6\].*got 7"):
        mgr.rewind("a", "m", 7)
    with pytest.raises(InvalidStep, match=r"page \d+ is shared"):  # into the shared full page
        mgr.rewind("a", "m", 3)
    with pytest.raises(TypeError, match="expected n an int"):
        mgr.rewind("a", "m", 1.0)
    step = KVStep((Segment("a", "m", 1),))
    mgr.admit(step)
    with pytest.raises(InvalidStep, match="in an admitted step"):
        mgr.rewind("a", "m", 1)
    mgr.abort(step)
    assert mgr.stored_len("a", "m") == 6
    mgr.rewind("a", "m", 2)  # within its own page: fine
    mgr.check_invariants()


def test_the_prefix_cache_registers_accepted_tokens_only():
    mgr = KVManager(16, 4, prefix_cache=True)
    run(mgr, [("a", "m", 6)], tokens=np.arange(6))
    # a verify row: last token + 4 drafts, 1 accepted: 8 tokens kept, page [4..7] full
    run(mgr, [("a", "m", 5)], tokens=np.array([6, 7, 90, 91, 92]), kept=[2])
    mgr.check_invariants()
    reg = mgr._pages.registry
    pages = np.flatnonzero(reg.registered)
    assert sorted(reg.tokens[pages].tolist()) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # its next decode rows register the accepted continuation, never 90, 91, 92
    for t in (8, 9, 10, 11):
        run(mgr, [("a", "m", 1)], tokens=np.array([t]))
    assert mgr.match_prefix("b", "m", np.arange(13)) == 12
    assert mgr.match_prefix("c", "m", np.array([0, 1, 2, 3, 4, 5, 6, 7, 90, 91, 92, 1, 1])) == 8
    mgr.release("b")
    mgr.release("c")
    with pytest.raises(InvalidStep, match="registered"):
        mgr.rewind("a", "m", 1)


def test_a_decode_step_committing_nothing_for_some_rows():
    mgr = KVManager(16, 4, prefix_cache=True)
    run(mgr, [("a", "m", 3), ("b", "m", 3)], tokens=np.arange(6))
    run(mgr, [("a", "m", 1), ("b", "m", 1)], tokens=np.array([3, 9]), kept=[1, 0])
    assert (mgr.stored_len("a", "m"), mgr.stored_len("b", "m")) == (4, 3)
    assert mgr.prefix_stats()["pages_cached"] == 1  # a's [0, 1, 2, 3]
    mgr.check_invariants()


def test_a_window_releases_by_the_accepted_length():
    mgr = KVManager(32, 4, window=4)
    run(mgr, [("a", "m", 10)])  # the next query reads keys 7..: page 0 (0-3) released
    kept_pages = mgr.page_ids("a", "m").tolist()  # 4-7, 8-11
    run(mgr, [("a", "m", 6)], kept=[1])  # 11 tokens (16 would release 8-11 too)
    assert mgr.stored_len("a", "m") == 11 and mgr.page_ids("a", "m").tolist() == kept_pages[1:]
    with pytest.raises(InvalidStep, match="released pages"):
        mgr.rewind("a", "m", 1)  # position 10 would read key 7, released
    mgr.check_invariants()


def test_kv_groups_cut_every_group():
    groups = KVGroups(((2, [0]), (None, [1])), 32, 4, cache={"num_kv_heads": 1, "head_dim": 2})
    run(groups, [("a", "m", 10)])
    run(groups, [("a", "m", 6)], kept=[2])
    assert groups.stored_len("a", "m") == 12
    assert groups.held_pages("a", "m") == (1, 3)  # the window (2) keeps keys 11..
    with pytest.raises(InvalidStep, match="released pages"):
        groups.rewind("a", "m", 4)  # the windowed group refuses: no group changes
    assert groups.held_pages("a", "m") == (1, 3)
    groups.check_invariants()


# --- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    return build_model(seed=0)


def engine(model, **kwargs) -> Engine:
    options = {"num_pages": 64, "page_size": 8, "token_budget": 32} | kwargs
    return Engine(copy.deepcopy(model), **options)


def copy_prompts(count=4, seed=0):
    """Prompts that repeat themselves (drafts are found and mostly taken) and
    random ones (few drafts)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        text = [rng.randrange(1, 256) for _ in range(rng.randint(6, 14))]
        out.append(text * 3 if i % 2 else [rng.randrange(1, 256) for _ in range(30)])
    return out


def outputs(eng, prompts, params):
    done = eng.generate(prompts, params)
    eng.mgr.check_invariants()
    assert eng.mgr.num_free_pages == eng.mgr.num_pages  # no page leaks
    return [[o.token_ids for o in c.outputs] for c in done]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_greedy_with_drafts_equals_greedy_without(models, prefix_cache):
    prompts, params = copy_prompts(), SamplingParams(max_new_tokens=40)
    want = outputs(engine(models[1], prefix_cache=prefix_cache), prompts, params)
    eng = engine(models[1], prefix_cache=prefix_cache, speculative="ngram")
    assert outputs(eng, prompts, params) == want
    assert eng.stats.spec_accepted > 20 and eng.stats.spec_proposed >= eng.stats.spec_accepted
    if prefix_cache:  # again, on the pages the first run cached: the same tokens
        assert outputs(eng, prompts, params) == want
        check_cached_chains(eng, prompts, want)


def check_cached_chains(eng, prompts, outs):
    """Every page the prefix cache holds holds a prefix of a request's
    prompt and accepted output (a rejected draft token would break it)."""
    reg, ps = eng.mgr._pages.registry, eng.mgr.page_size
    seqs = [p + o[0] for p, o in zip(prompts, outs)]
    for page in np.flatnonzero(reg.registered).tolist():
        chain = []
        while page >= 0:
            chain[:0] = reg.tokens[page].tolist()
            page = int(reg.parent[page])
        assert any(s[: len(chain)] == chain for s in seqs), chain
    assert len(np.flatnonzero(reg.registered)) >= sum(len(s) - 1 for s in seqs) // ps - 4


def test_stops_end_a_draft_where_one_token_decoding_does(models):
    prompts = copy_prompts()
    base = outputs(engine(models[1]), prompts, SamplingParams(max_new_tokens=40))
    stop = base[1][0][7]  # a token greedy decoding emits on a copy prompt
    for params in (
        SamplingParams(max_new_tokens=9),
        SamplingParams(max_new_tokens=40, stop_token_ids=(stop,)),
    ):
        want = outputs(engine(models[1]), prompts, params)
        assert outputs(engine(models[1], speculative="ngram"), prompts, params) == want
    eos = Engine(copy.deepcopy(models[1]), num_pages=64, page_size=8, speculative="ngram")
    eos.eos_token_ids = frozenset([stop])
    (done,) = eos.generate(prompts[1], SamplingParams(max_new_tokens=40))
    assert done.outputs[0].token_ids == base[1][0][: base[1][0].index(stop) + 1]


def test_seeded_samples_forks_and_preemption_equal_the_plain_engine(models):
    prompts = copy_prompts(4)[1::2]  # two copy prompts, two samples each
    params = SamplingParams(max_new_tokens=30, temperature=0.01, n=2, seed=3)
    want = outputs(engine(models[1]), prompts, params)
    small = engine(models[1], num_pages=16, speculative="ngram")  # preempts
    assert outputs(small, prompts, params) == want
    assert small.stats.preemptions > 0 and small.stats.spec_accepted > 0


def test_a_windowed_model_and_an_abort(models):
    _, mistral = build_model(seed=1, config_class="MistralConfig", sliding_window=8)
    prompts, params = copy_prompts(), SamplingParams(max_new_tokens=40)
    want = outputs(engine(mistral), prompts, params)
    eng = engine(mistral, speculative="ngram")
    assert eng.mgr.window == 8
    assert outputs(eng, prompts, params) == want and eng.stats.spec_accepted > 0
    rid = eng.add_request(prompts[1], params)
    proposed = eng.stats.spec_proposed
    while eng.stats.spec_proposed == proposed:  # aborted after a verify step
        eng.step()
    eng.abort(rid)
    assert eng.mgr.num_free_pages == eng.mgr.num_pages
    eng.mgr.check_invariants()


def test_sampling_with_drafts_keeps_the_model_distribution():
    """Many seeded samples from a tiny model on a repeating prompt (drafts
    every step): the histogram of generated tokens matches the plain
    engine's, drawn with other seeds. Accepting every draft would emit the
    prompt's continuation far more often and fails this."""
    _, model = build_model(seed=2, vocab_size=12, hidden_size=16, intermediate_size=32)
    prompt = [1, 2, 3, 4, 5] * 4
    n = 300

    def histogram(seed0, **kwargs):
        eng = engine(model, token_budget=1024, num_pages=1024, page_size=4, **kwargs)
        if eng.spec is not None:
            eng.spec.max_batch, eng.spec.min_n, eng.spec.adaptive = n, 1, False  # drafts always
        params = [
            SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed0 + i) for i in range(n)
        ]
        done = eng.generate([prompt] * n, params)
        tokens = np.concatenate([c.outputs[0].token_ids[1:] for c in done])
        return np.bincount(tokens, minlength=12) / len(tokens), eng

    plain, _ = histogram(0)
    spec, eng = histogram(10_000, speculative="ngram", num_speculative_tokens=3)
    assert eng.stats.spec_proposed > n  # drafts all along
    assert 0.5 * np.abs(plain - spec).sum() < 0.1  # total variation: noise ~0.04, always-accept 0.2


def test_options_are_checked(models):
    with pytest.raises(ValueError, match="speculative None or one of"):
        engine(models[1], speculative="eagle")
    with pytest.raises(TypeError, match="num_speculative_tokens an int"):
        engine(models[1], speculative="ngram", num_speculative_tokens=2.0)
    with pytest.raises(ValueError, match=r"num_speculative_tokens in \[1, 64\]"):
        engine(models[1], speculative="ngram", num_speculative_tokens=0)


def test_smollm2_greedy_with_drafts_equals_without(smollm2):
    model, tokenizer = smollm2
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    chats = [
        [{"role": "user", "content": f"Repeat this code exactly:\n{text}"}],
        [{"role": "user", "content": "What is the capital of France?"}],
    ]
    params = SamplingParams(max_new_tokens=32)
    outs = []
    for spec in (None, "ngram"):
        eng = Engine(copy.deepcopy(model), tokenizer, num_pages=64, speculative=spec)
        outs.append([c.outputs[0].token_ids for c in eng.chat(chats, params)])
    assert outs[0] == outs[1]
    assert eng.stats.spec_accepted > 10


def test_cli_flags():
    from mstar.cli import main

    demo = ["demo", "--model", "random", "--quiet", "--requests", "2", "--max-new-tokens", "8"]
    assert main([*demo, "--speculative", "--num-speculative-tokens", "3"]) == 0
    assert main([*demo, "--speculative", "--num-speculative-tokens", "0"]) == 2
    with pytest.raises(SystemExit):
        main([*demo, "--speculative", "eagle"])


def test_penalties_and_a_grammar_see_each_verify_position(models, smollm2):
    """Logits processing (penalties, a grammar's mask) runs per verify
    position on the tokens before it: outputs equal one-token decoding."""
    from mstar.engine import StructuredOutputs

    prompts, penalty = copy_prompts(), SamplingParams(max_new_tokens=30, frequency_penalty=0.5)
    want = outputs(engine(models[1]), prompts, penalty)
    assert outputs(engine(models[1], speculative="ngram"), prompts, penalty) == want
    model, tokenizer = smollm2
    chat = [{"role": "user", "content": "Write the list 1, 2, 3, 1, 2, 3, 1, 2, 3 as JSON."}]
    params = SamplingParams(
        max_new_tokens=40, structured_outputs=StructuredOutputs(json={"type": "array"})
    )
    outs = []
    for spec in (None, "ngram"):
        eng = Engine(copy.deepcopy(model), tokenizer, num_pages=64, speculative=spec)
        outs.append([c.outputs[0].token_ids for c in eng.chat([chat], params)])
    assert outs[0] == outs[1]
