"""The engine as users hold it: arguments checked at the boundary, calls that
leave the engine as they found it, streaming, chat and stop strings. Text
tests use SmolLM2's tokenizer over a tiny random Llama of its vocabulary
(random tokens: split multi-byte characters, CJK, emoji), the oracle being
the tokenizer's own decode of the ids."""

import codecs
import copy
import math
import threading

import numpy as np
import pytest

pytest.importorskip("transformers")
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.engine import Engine, RequestTooLarge, SamplingParams, StepFailed
from mstar.engine.detokenizer import TextStream
from mstar.engine.sampling.logprobs import TokenNames
from mstar.models.seeded import build_model

EMOJI_CJK = st.text(
    st.one_of(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
        st.sampled_from("🌊🐍👍🏽世界日本語한국어中文 \n"),
    ),
    max_size=40,
)
FEW = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def text_engine(text_model, tok, **kwargs) -> Engine:
    options = {"num_pages": 64, "page_size": 8, "token_budget": 32} | kwargs
    return Engine(copy.deepcopy(text_model), tok, **options)


@pytest.fixture(scope="module")
def tiny():
    return build_model(seed=0)[1]


def ids_engine(tiny, **kwargs) -> Engine:
    options = {"num_pages": 16, "page_size": 8, "token_budget": 16} | kwargs
    return Engine(copy.deepcopy(tiny), **options)


def bounded(fn, seconds: float = 60.0):
    """``fn()``'s result or exception, failing the test if it runs past ``seconds``."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    return box


def idle(eng: Engine) -> bool:
    return not eng.has_unfinished() and eng.mgr.num_free_pages == eng.mgr.num_pages


# --- SamplingParams and the engine's arguments ---------------------------------------------


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("max_new_tokens", 2.5, TypeError),
        ("max_new_tokens", True, TypeError),
        ("n", 2.5, TypeError),
        ("top_k", 1.0, TypeError),
        ("seed", "x", TypeError),
        ("seed", -1, ValueError),
        ("temperature", "hot", TypeError),
        ("temperature", math.nan, ValueError),
        ("top_p", math.inf, ValueError),
        ("ignore_eos", 1, TypeError),
        ("stop_token_ids", "ab", TypeError),
        ("stop_token_ids", (1.5,), TypeError),
        ("stop_token_ids", (-1,), ValueError),
        ("stop", ("",), ValueError),
        ("stop", (1,), TypeError),
        ("stop", b"x", TypeError),
    ],
)
def test_sampling_params_check_types_and_ranges_naming_the_field(field, value, error):
    with pytest.raises(error, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value)[:3] in str(info.value)


def test_sampling_params_normalize_numbers_and_stop():
    params = SamplingParams(temperature=1, top_p=1, stop="###", stop_token_ids=[3, np.int64(4)])
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert params.stop == ("###",) and params.stop_token_ids == (3, 4)


def test_a_fractional_max_new_tokens_is_refused_not_a_hang(tiny):
    eng = ids_engine(tiny)
    box = bounded(lambda: eng.generate([1, 2, 3], SamplingParams(max_new_tokens=2.5)))
    assert isinstance(box.get("error"), TypeError) and idle(eng)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"page_size": 0}, ValueError, "page_size"),
        ({"token_budget": 1.5}, TypeError, "token_budget"),
        ({"num_pages": True}, TypeError, "num_pages"),
        ({"prefix_cache": "yes"}, TypeError, "prefix_cache"),
        ({"num_pages": 1 << 40}, ValueError, "fits the free memory"),
        ({"kv_cache_memory": 2.5}, TypeError, "kv_cache_memory"),
        ({"kv_cache_memory": 1 << 20}, ValueError, "num_pages or kv_cache_memory, not both"),
        ({"num_pages": None, "kv_cache_memory": 100}, ValueError, "at least one page"),
        ({"num_pages": None, "kv_cache_memory": 1 << 50}, ValueError, "fits the free memory"),
    ],
)
def test_engine_options_are_checked_before_the_model_changes(tiny, kwargs, error, match):
    model = copy.deepcopy(tiny)
    with pytest.raises(error, match=match):
        Engine(model, **({"num_pages": 16} | kwargs))
    assert model.config._attn_implementation != "mstar_paged"  # untouched


def test_kv_cache_memory_sizes_the_pool_in_whole_pages(tiny):
    page = ids_engine(tiny, num_pages=1).kv_cache_bytes
    engine = ids_engine(tiny, num_pages=None, kv_cache_memory=5 * page + page // 2)
    assert engine.mgr.num_pages == 5 and engine.kv_cache_bytes == 5 * page


def test_limit_context_caps_what_a_request_may_span(tiny):
    engine = ids_engine(tiny)
    own = engine.max_len
    for bad in (1, own + 1, 2.5, True):
        with pytest.raises(ValueError, match="expected a context"):
            engine.limit_context(bad)
    assert engine.max_len == own  # refused: unchanged
    engine.limit_context(8)
    assert engine.max_len == 8
    with pytest.raises(ValueError, match="max_position_embeddings 8"):
        engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=5))
    engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=4))


def test_serve_takes_kv_cache_memory_as_a_size():
    import argparse

    from mstar.cli import serve
    from mstar.serve.options import build_engine, memory_size

    assert [memory_size(s) for s in ("4GiB", "512MiB", "1.5G", "2000", "3kb")] == [
        4 << 30,
        512 << 20,
        1_500_000_000,
        2000,
        3000,
    ]
    for bad in ("", "4 apples", "0", "-1GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_size(bad)
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):  # a pool in pages or in bytes, not both
        parser.parse_args(["serve", "--pages", "8", "--kv-cache-memory", "2GiB"])
    args = parser.parse_args(
        ["serve", "--model", "random", "--dtype", "float32", "--kv-cache-memory", "1MiB"]
    )
    assert args.kv_cache_memory == 1 << 20
    engine, _ = build_engine(args, enforce_eager=True)
    page = engine.kv_cache_bytes // engine.mgr.num_pages
    assert (1 << 20) - page < engine.kv_cache_bytes <= 1 << 20


def test_a_slow_tokenizer_is_refused(tiny):
    with pytest.raises(TypeError, match="fast tokenizer"):
        Engine(copy.deepcopy(tiny), object(), num_pages=8)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"device": "foo"}, ValueError, "'foo'"),
        ({"device": "tpu"}, ValueError, "'tpu'"),
        ({"dtype": torch.int8}, ValueError, "dtype"),
        ({"dtype": "fp32"}, ValueError, "'fp32'"),
    ],
)
def test_from_pretrained_checks_its_arguments_before_loading(kwargs, error, match):
    with pytest.raises(error, match=match):
        Engine.from_pretrained("/nonexistent", **kwargs)
    with pytest.raises(TypeError, match="name"):
        Engine.from_pretrained(3)


# --- prompts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, error, match",
    [
        (b"Hi", TypeError, "bytes"),
        ([1.0, 2.0], TypeError, "float"),
        ([[[1]]], TypeError, "list"),
        ([True, 2], TypeError, "bool"),
        ([1, "a"], TypeError, "int 1"),
        (np.array([1, 2]), TypeError, "ndarray"),
        ([[]], ValueError, "non-empty"),
        ([[1, 999]], ValueError, r"ids in \[0, 256\)"),
    ],
)
def test_bad_prompts_get_a_named_error_and_nothing_is_queued(tiny, prompt, error, match):
    eng = ids_engine(tiny)
    with pytest.raises(error, match=match):
        eng.generate(prompt)
    assert idle(eng)


def test_one_prompt_or_a_list_always_gives_a_list(tiny):
    eng = ids_engine(tiny)
    params = SamplingParams(max_new_tokens=3)
    (one,) = eng.generate([1, 2, 3], params)
    (same,) = eng.generate((np.int64(1), 2, 3), params)
    two = eng.generate([[1, 2, 3], [4, 5]], params)
    assert one.prompt_token_ids == same.prompt_token_ids == [1, 2, 3]
    assert [c.prompt_token_ids for c in two] == [[1, 2, 3], [4, 5]]
    assert one.outputs[0].token_ids == two[0].outputs[0].token_ids
    assert eng.generate([], params) == []


def test_a_string_is_one_prompt_not_one_per_character(text_model, tok):
    eng = text_engine(text_model, tok)
    (done,) = eng.generate("Hi there", SamplingParams(max_new_tokens=2))
    assert done.prompt_token_ids == tok.encode("Hi there")
    with pytest.raises(ValueError, match="valid UTF-8"):
        eng.generate("bad \udcff argument")
    with pytest.raises(ValueError, match="non-empty"):
        eng.generate([""])
    assert idle(eng)


# --- exception safety ----------------------------------------------------------------------


def test_a_refused_prompt_leaves_no_request_of_its_call_queued(tiny):
    eng = ids_engine(tiny, num_pages=4)  # 32 tokens
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(RequestTooLarge, match=r"the prompt alone .* needs 5 KV pages"):
        eng.generate([[1, 2, 3], [4, 5], list(range(1, 40))], params)
    assert idle(eng)
    assert len(eng.generate([[1, 2, 3], [4, 5]], params)) == 2  # the next call works
    with pytest.raises(ValueError, match="2 SamplingParams"):
        eng.generate([[1], [2]], [params])
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.generate([[1], [2]], {"max_new_tokens": 2})
    assert idle(eng)


def failing_logits(eng: Engine, after: int):
    """Make the forward of ``eng`` raise after ``after`` good calls."""
    real, calls = eng._logits, []

    def logits(*args):
        calls.append(1)
        if len(calls) > after:
            raise RuntimeError("boom")
        return real(*args)

    eng._logits = logits


def test_a_failed_step_aborts_its_requests_and_the_others_go_on(tiny):
    params = SamplingParams(max_new_tokens=6)
    first, second = list(range(1, 25)), [7, 8, 9]
    alone = ids_engine(tiny).generate(second, params)[0].outputs[0].token_ids
    eng = ids_engine(tiny, token_budget=16)  # the first step holds only 'a''s prefill
    eng.add_request(first, params, request_id="a")
    eng.add_request(second, params, request_id="b")
    failing_logits(eng, after=0)
    with pytest.raises(StepFailed) as info:
        eng.step()
    assert info.value.request_ids == ("a",) and isinstance(info.value.__cause__, RuntimeError)
    del eng._logits  # the forward works again
    done = {}
    while eng.has_unfinished():
        done.update((c.request_id, c) for c in eng.step() if c.finished)
    assert list(done) == ["b"] and done["b"].outputs[0].token_ids == alone
    assert idle(eng)
    eng.mgr.check_invariants()


def test_generate_and_stream_that_fail_or_stop_early_leave_the_engine_idle(tiny):
    eng = ids_engine(tiny)
    params = SamplingParams(max_new_tokens=8, n=2, temperature=1.0, seed=0)
    failing_logits(eng, after=3)
    with pytest.raises(StepFailed):
        eng.generate([[1, 2, 3], [4, 5, 6]], params)
    assert idle(eng)
    del eng._logits
    stream = eng.stream([[1, 2, 3], [4, 5, 6]], params)
    assert idle(eng)  # queued at the first next
    next(stream)
    assert eng.has_unfinished()
    stream.close()
    assert idle(eng)

    def interrupt(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.generate([[1, 2, 3]], params, progress=interrupt)
    assert idle(eng)
    eng.mgr.check_invariants()
    assert len(eng.generate([[1, 2, 3]], params)) == 1


def test_generate_refuses_to_run_over_requests_it_did_not_add(tiny):
    eng = ids_engine(tiny)
    eng.add_request([1, 2], request_id="mine")
    with pytest.raises(ValueError, match="no running requests"):
        eng.generate([1, 2])
    assert eng.has_unfinished()
    auto = eng.add_request([1, 2], request_id="req0")  # a user's id an auto id will skip
    assert eng.add_request([1, 2]) not in (auto, "mine")


# --- streaming -----------------------------------------------------------------------------


STOPS = ("🌊", "世界", "a 🌊", "b\n", "ab", "x y")  # most span tokens


@FEW
@given(
    parts=st.lists(st.one_of(EMOJI_CJK, st.sampled_from(STOPS)), max_size=6),
    stops=st.lists(st.sampled_from(STOPS), max_size=2),
)
def test_text_stream_joins_to_the_decode_and_ends_before_a_stop(tok, parts, stops):
    ids = tok.encode("x" + "".join(parts))
    full = tok.decode(ids, skip_special_tokens=True)
    stream = TextStream(tok, tuple(stops))
    seen, used = [], 0
    for token in ids:
        used += 1
        before = stream.text
        stopped = stream.add(token)
        assert stream.text.startswith(before)  # only grows
        seen.append(stream.text[len(before) :])
        if stopped:
            break
    else:
        before = stream.text
        stream.close()
        seen.append(stream.text[len(before) :])
    ends = [i for i in (full.find(s) for s in stops) if i >= 0]
    assert "".join(seen) == stream.text == full[: min(ends, default=len(full))]
    if ends:  # stopped at the token that completed the first stop string
        done = tok.decode(ids[:used], skip_special_tokens=True)
        assert any(s in done for s in stops)
        assert not any(s in tok.decode(ids[: used - 1], skip_special_tokens=True) for s in stops)


@FEW
@given(ids=st.lists(st.integers(0, 49151), max_size=30))
def test_text_stream_of_any_tokens_equals_the_decode(tok, ids):
    stream = TextStream(tok)
    for token in ids:
        stream.add(token)
    stream.close()
    full = tok.decode(ids, skip_special_tokens=True)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # Python's, the oracle
    decoder.decode(b"".join(TokenNames(tok).bytes(t) for t in ids), final=False)
    split = bool(decoder.getstate()[0])  # the bytes end inside a character: it is left out
    assert stream.text == (full[:-1] if split else full)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=EMOJI_CJK, seed=st.integers(0, 1000), greedy=st.booleans())
def test_streamed_deltas_join_to_the_final_text(text_model, tok, monkeypatch, prompt, seed, greedy):
    params = SamplingParams(
        max_new_tokens=12, n=2, temperature=0.0 if greedy else 1.0, seed=seed, stop=("e",)
    )
    eng = text_engine(text_model, tok)
    with monkeypatch.context() as patch:
        patch.setattr(tok, "decode", None)  # no whole-text decode on the way
        deltas: dict[int, list[str]] = {0: [], 1: []}
        for completion in eng.stream("x" + prompt, params):
            for out in completion.outputs:
                deltas[out.index].append(out.delta)
                assert out.text == "".join(deltas[out.index])
                assert "\ufffd" not in out.delta or "\ufffd" in tok.backend_tokenizer.decode(
                    out.token_ids
                )
    for out in completion.outputs:
        eos = out.token_ids[-1] in eng.eos_token_ids
        full = tok.decode(out.token_ids[: len(out.token_ids) - eos], skip_special_tokens=True)
        assert out.text == full.partition("e")[0] and "e" not in out.text
        assert (out.finish_reason == "stop") == ("e" in full or eos)


def test_a_streamed_emoji_is_never_split(tiny, text_model, tok, monkeypatch):
    """The CLI showed ``��������`` for ``🌊🌊🌊``: pieces decoded token by token."""
    waves = tok.encode("🌊🌊🌊")
    assert len(waves) == 9  # three tokens each
    script = iter(waves)
    monkeypatch.setattr("mstar.engine.sampling.logits.sample_token", lambda *args: next(script))
    eng = text_engine(text_model, tok)
    deltas = [c.outputs[0].delta for c in eng.stream([1, 2], SamplingParams(max_new_tokens=9))]
    assert deltas == ["", "", "🌊"] * 3


def test_a_cut_inside_a_character_leaves_it_out(text_model, tok, monkeypatch):
    """max_new_tokens=4 of three 3-token waves: one wave, no U+FFFD."""
    script = iter(tok.encode("🌊🌊🌊"))
    monkeypatch.setattr("mstar.engine.sampling.logits.sample_token", lambda *args: next(script))
    eng = text_engine(text_model, tok)
    outs = [c.outputs[0] for c in eng.stream([1, 2], SamplingParams(max_new_tokens=4))]
    assert [o.delta for o in outs] == ["", "", "🌊", ""]
    assert outs[-1].text == "🌊" and outs[-1].finish_reason == "length"


def test_step_hands_out_each_delta_once(text_model, tok):
    eng = text_engine(text_model, tok)
    rid = eng.add_request("Hi", SamplingParams(max_new_tokens=10, temperature=1.0, seed=3))
    deltas, final = [], None
    while eng.has_unfinished():
        for c in eng.step():
            deltas.append(c.outputs[0].delta)
            final = c
    assert final.request_id == rid and "".join(deltas) == final.outputs[0].text


def test_stop_strings_need_a_tokenizer(tiny):
    eng = ids_engine(tiny)
    with pytest.raises(ValueError, match="stop strings"):
        eng.add_request([1], SamplingParams(stop="x"))


# --- chat and stop strings on SmolLM2 ------------------------------------------------------


CHAT = [
    {"role": "system", "content": "You are a helpful geography tutor."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And Italy?"},
]


def test_chat_equals_hf_generate_on_the_templated_prompt(smollm2):
    reference, tokenizer = smollm2
    prompt = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])
    ids = torch.tensor([prompt])
    want = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
    )[0, len(prompt) :].tolist()
    eng = Engine(copy.deepcopy(reference), tokenizer, num_pages=32, page_size=16)
    (done,) = eng.chat(CHAT, SamplingParams(max_new_tokens=8))
    assert done.prompt_token_ids == prompt and done.outputs[0].token_ids == want
    text = done.outputs[0].text
    assert text == tokenizer.decode(want[:-1]) == "The capital of Italy is Rome."
    # a stop string over two tokens (" of", " Italy"): the text ends before it
    (cut,) = eng.chat([CHAT], SamplingParams(max_new_tokens=8, stop=["Paris", "of It"]))
    out = cut.outputs[0]
    assert out.text == "The capital " and out.finish_reason == "stop"
    assert out.token_ids == want[:4]  # through " Italy", the token that completed it


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ("hi", TypeError, "list of dicts"),
        ([], ValueError, "at least one"),
        (["hi"], TypeError, r"messages\[0\] a dict"),
        ([{"role": "bot", "content": "x"}], ValueError, "role"),
        ([{"role": "user"}], ValueError, "role and content"),
        ([{"role": "user", "content": 3}], TypeError, "content a str"),
        ([{"role": "user", "content": "\udcff"}], ValueError, "UTF-8"),
    ],
)
def test_bad_messages_are_refused(text_model, tok, messages, error, match):
    eng = text_engine(text_model, tok)
    with pytest.raises(error, match=match):
        eng.chat([messages])
    assert idle(eng)


def test_chat_needs_a_chat_template(tiny, text_model, tok):
    with pytest.raises(ValueError, match="no tokenizer"):
        ids_engine(tiny).encode_chat(CHAT)
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        text_engine(text_model, plain).encode_chat(CHAT)


def test_cache_namespace_keeps_prefix_cache_hits_within_it(tiny):
    engine = ids_engine(tiny, num_pages=48)
    prompt = [(7 * j) % 200 + 1 for j in range(32)]  # 4 pages of 8

    def cached(namespace: str, **params: int) -> int:
        params = SamplingParams(max_new_tokens=2, **params)
        rid = engine.add_request(prompt, params, cache_namespace=namespace)
        done = [c for _ in range(100) if engine.has_unfinished() for c in engine.step()]
        return [c for c in done if c.request_id == rid][-1].cached_tokens

    assert cached("a", prompt_logprobs=0) == 0  # (computed whole, its pages cached in "a")
    assert cached("b") == 0  # not a's
    assert cached("") == 0  # the default namespace is one too
    assert cached("a") == 31  # a's own (one token left to compute)
    assert cached("") == 31
    with pytest.raises(TypeError, match="cache_namespace"):
        engine.add_request(prompt, cache_namespace=b"a")
    assert not engine.has_unfinished()
