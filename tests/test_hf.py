"""A Hugging Face decoder run step by step through plans matches its own
full-sequence forward (logits) and its own generate (greedy tokens)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from oracles import Streams

transformers = pytest.importorskip("transformers")

from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention  # noqa: E402
from mstar.engine.resources.kv.cache import KVCache  # noqa: E402
from mstar.engine.resources.kv.plan import KVPlanOutput  # noqa: E402
from mstar.models import hf, hf_attention  # noqa: E402
from mstar.models.hf import forward_step, register  # noqa: E402

SIZES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # No end-of-sequence token: generate always runs max_new_tokens.
    "bos_token_id": None,
    "eos_token_id": None,
}
TOL = 1e-4


def _models(model_cls, config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded model (the oracle, SDPA attention) and its twin on the plan."""
    torch.manual_seed(0)
    reference = model_cls(config).eval()
    paged = copy.deepcopy(reference)
    paged.set_attn_implementation(register())
    return reference, paged


@pytest.fixture(scope="module")
def llama():
    return _models(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SIZES))


class Runner:
    """Feeds streams through ``forward_step`` with hand-built plans and
    keeps each stream's tokens and logits."""

    def __init__(
        self,
        model: torch.nn.Module,
        page_size: int,
        num_pages: int = 64,
        flashinfer: FlashInferPagedAttention | None = None,
        fused: bool = True,
    ) -> None:
        self.model = model
        self.flashinfer, self.fused = flashinfer, fused
        self.streams = Streams(num_pages, page_size, seed=1)
        self.cache = KVCache(
            num_pages=num_pages, page_size=page_size, **hf.kv_spec(model).cache_kwargs()
        )
        self.tokens: dict[str, list[int]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}

    def prefill(self, chunks: list[tuple[str, list[int]]]) -> None:
        """One general step; a chunk of one token is a decode row in it."""
        self._run(self.streams.plan([(name, len(ids)) for name, ids in chunks]), chunks)

    def decode(self, names: list[str], *, allow_views: bool = True) -> None:
        """One decode-plan step feeding each stream its greedy next token
        (unless ``allow_views``, building the plan's views raises)."""
        feeds = [(name, [self.next_token(name)]) for name in names]
        self._run(self.streams.decode_plan(names, allow_views=allow_views), feeds)

    def next_token(self, name: str) -> int:
        return int(self.logits[name][-1][-1].argmax())

    def _run(self, plan: KVPlanOutput, feeds: list[tuple[str, list[int]]]) -> None:
        ids = torch.tensor([t for _, chunk in feeds for t in chunk])
        logits = forward_step(
            self.model, ids, plan, self.cache, flashinfer=self.flashinfer, fused=self.fused
        )
        for (name, chunk), rows in zip(feeds, logits.split([len(c) for _, c in feeds])):
            self.tokens.setdefault(name, []).extend(chunk)
            self.logits.setdefault(name, []).append(rows)


def _check_stream(reference: torch.nn.Module, run: Runner, name: str, prompt_len: int) -> None:
    """Logits of every step against one full forward; greedy tokens against
    generate from the prompt."""
    tokens = torch.tensor([run.tokens[name]])
    with torch.no_grad():
        expected = reference(tokens, use_cache=False).logits[0]
    got = torch.cat(run.logits[name])
    err = (got - expected).abs().max().item()
    assert err <= TOL, f"{name}: max abs logit error {err}"
    new = tokens.shape[1] - prompt_len + 1
    generated = reference.generate(tokens[:, :prompt_len], max_new_tokens=new, do_sample=False)
    greedy = [*run.tokens[name][prompt_len:], run.next_token(name)]
    assert generated[0, prompt_len:].tolist() == greedy


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SIZES["vocab_size"], (n,), generator=gen).tolist()


@pytest.mark.parametrize("fused", [True, False])
def test_chunked_prefill_then_decode(llama, fused):
    reference, paged = llama
    prompt = _prompt(11, seed=0)
    run = Runner(paged, page_size=3, fused=fused)
    for lo, hi in ((0, 4), (4, 9), (9, 11)):
        run.prefill([("a", prompt[lo:hi])])
    for _ in range(4):
        run.decode(["a"])
    _check_stream(reference, run, "a", len(prompt))


@pytest.mark.parametrize("fused", [True, False])
def test_a_decode_step_never_builds_views(llama, fused):
    """Positions, cache writes and attention of a decode plan read its index
    arrays alone (its view builder raises), and the logits stay exact."""
    reference, paged = llama
    a, b = _prompt(6, seed=12), _prompt(3, seed=13)
    run = Runner(paged, page_size=4, fused=fused)
    run.prefill([("a", a), ("b", b)])
    for _ in range(4):
        run.decode(["a", "b"], allow_views=False)
    _check_stream(reference, run, "a", len(a))
    _check_stream(reference, run, "b", len(b))


@pytest.mark.parametrize("fused", [True, False])
def test_two_streams_batched(llama, fused):
    """Chunks and decode rows of two streams share steps."""
    reference, paged = llama
    a, b = _prompt(7, seed=1), _prompt(5, seed=2)
    run = Runner(paged, page_size=4, fused=fused)
    run.prefill([("a", a[:4]), ("b", b)])
    run.prefill([("b", [run.next_token("b")]), ("a", a[4:])])
    for _ in range(3):
        run.decode(["a", "b"])
    _check_stream(reference, run, "a", len(a))
    _check_stream(reference, run, "b", len(b))


def test_sliding_window_follows_the_model():
    """Mistral passes its sliding window per layer; the plan's attention
    honours it (the sequence is longer than the window)."""
    config = transformers.MistralConfig(**SIZES, sliding_window=4)
    reference, paged = _models(transformers.MistralForCausalLM, config)
    prompt = _prompt(10, seed=3)
    run = Runner(paged, page_size=3)
    run.prefill([("a", prompt[:6])])
    run.prefill([("a", prompt[6:])])
    for _ in range(3):
        run.decode(["a"])
    _check_stream(reference, run, "a", len(prompt))


def test_flashinfer_adapter_is_planned_once_per_step(llama, fake_flashinfer):
    """Through a FlashInfer adapter (a stand-in here), every layer runs on
    one plan per step and the logits are those of the portable path."""
    _, paged = llama
    adapter, log = fake_flashinfer()
    prompt = _prompt(9, seed=4)
    plain = Runner(paged, page_size=4, fused=False)  # HF's forward, as the adapter's
    fused = Runner(paged, page_size=4, flashinfer=adapter)
    for run in (plain, fused):
        run.prefill([("a", prompt)])
        run.decode(["a"])
        run.decode(["a"])
    assert [kind for kind, _ in log] == ["prefill", "decode", "decode"]
    assert torch.equal(torch.cat(fused.logits["a"]), torch.cat(plain.logits["a"]))


def test_a_step_with_no_tokens_gives_no_logits(llama):
    """A zero-span step (one that only reads, or only forks) runs no forward."""
    _, paged = llama
    run = Runner(paged, page_size=4)
    run.prefill([("a", [5, 6, 7])])
    plan = run.streams.plan([("a", 0)])
    logits = forward_step(paged, torch.tensor([], dtype=torch.long), plan, run.cache)
    assert logits.shape == (0, paged.config.vocab_size)


def test_an_empty_logits_at_still_writes_the_steps_kv(llama):
    """Logits at no token (a prefill chunk that ends no stream) still run the
    forward: the chunk's keys and values land in the cache."""
    _, paged = llama
    written = []
    for logits_at in (None, torch.tensor([], dtype=torch.int64)):
        run = Runner(paged, page_size=4)
        plan = run.streams.plan([("a", 5)])
        ids = torch.tensor([5, 6, 7, 8, 9])
        logits = forward_step(paged, ids, plan, run.cache, logits_at=logits_at)
        assert logits.shape == ((5 if logits_at is None else 0), paged.config.vocab_size)
        written.append(run.cache.layer(0).clone())
    assert written[1].abs().sum() > 0 and torch.equal(written[0], written[1])


def test_forward_step_rejects_bad_input(llama):
    reference, paged = llama
    run = Runner(paged, page_size=4)
    plan = run.streams.plan([("a", 3)])
    with pytest.raises(ValueError, match="expected the model's attention implementation"):
        forward_step(reference, torch.zeros(3, dtype=torch.long), plan, run.cache)
    with pytest.raises(ValueError, match=r"expected input_ids of shape \(3,\), got \(1, 3\)"):
        forward_step(paged, torch.zeros(1, 3, dtype=torch.long), plan, run.cache)


def test_attention_needs_the_plan(llama):
    """Called without forward_step, the attention function says what to do."""
    _, paged = llama
    message = r"got none: run the model through .*forward_step"
    with pytest.raises(ValueError, match=message), torch.no_grad():
        paged(torch.zeros(1, 3, dtype=torch.long), use_cache=False)


def _call_attention(paged, run, plan, batch: int = 1, layer: int = 0, **extra) -> None:
    """The registered attention function, called as a decoder layer would
    inside forward_step (the step's context set)."""
    attention = transformers.AttentionInterface()[register()]
    q, kv = torch.zeros(batch, 4, 3, 16), torch.zeros(batch, 2, 3, 16)
    module = paged.model.layers[layer].self_attn
    step = hf_attention.PagedStep((plan,), (run.cache,), None, (None, None))
    token = hf_attention.CONTEXT.set(step)
    try:
        attention(module, q, kv, kv, None, scaling=0.25, **extra)
        attention(module, q, kv, kv, None, scaling=0.25, **extra)
    finally:
        hf_attention.CONTEXT.reset(token)


@pytest.mark.parametrize(
    ("batch", "extra", "message"),
    [
        (1, {"encoder_hidden_states": None}, r"got \['encoder_hidden_states'\]"),
        (1, {"mstar_plan": None}, r"got \['mstar_plan'\]"),
        (2, {}, "expected a packed batch of 1, got batch 2"),
        (1, {"dropout": 0.1}, r"expected attention dropout 0 \(model.eval\(\)\), got 0.1"),
        (1, {}, "expected one attention call per layer and step, got a second in layer 0"),
    ],
)
def test_attention_rejects_what_it_cannot_honour(llama, batch, extra, message):
    """A keyword it does not know, a batch that is not one packed step,
    dropout, and a second call in one layer (whose K/V would overwrite the
    first's)."""
    _, paged = llama
    run = Runner(paged, page_size=4)
    with pytest.raises(ValueError, match=message):
        _call_attention(paged, run, run.streams.plan([("a", 3)]), batch=batch, **extra)


def test_logits_only_where_asked(llama):
    """logits_at picks token rows (any order, repeats allowed): the model's
    head runs on those rows alone and they equal the full step's."""
    _, paged = llama
    prompt = _prompt(9, seed=11)
    full, picked = Runner(paged, page_size=4), Runner(paged, page_size=4)
    plans = [run.streams.plan([("a", 6), ("b", 3)]) for run in (full, picked)]
    ids = torch.tensor(prompt)
    expected = forward_step(paged, ids, plans[0], full.cache)
    at = torch.tensor([5, 8, 0, 5])
    got = forward_step(paged, ids, plans[1], picked.cache, logits_at=at)
    assert got.shape == (4, SIZES["vocab_size"])
    torch.testing.assert_close(got, expected[at], atol=1e-5, rtol=1e-5)
    assert hf.kv_spec(paged).keeps_logits  # Llama takes logits_to_keep as indices
    assert forward_step(paged, ids, plans[1], picked.cache, logits_at=at[:0]).shape == (0, 128)


def test_logits_at_without_logits_to_keep(llama):
    """A model whose forward cannot keep given rows: the step's logits are
    all computed, then picked."""
    _, paged = llama
    twin = copy.deepcopy(paged)
    twin._mstar_support = dataclasses.replace(hf.kv_spec(paged), keeps_logits=False)
    full, picked = Runner(paged, page_size=4), Runner(paged, page_size=4)
    plans = [run.streams.plan([("a", 4)]) for run in (full, picked)]
    ids, at = torch.tensor(_prompt(4, seed=14)), torch.tensor([3, 1])
    expected = forward_step(paged, ids, plans[0], full.cache)[at]
    torch.testing.assert_close(
        forward_step(twin, ids, plans[1], picked.cache, logits_at=at), expected
    )


@pytest.mark.parametrize(
    ("at", "message"),
    [
        (torch.tensor([0, 3]), r"expected logits_at in \[0, 3\), got values in \[0, 3\]"),
        (torch.tensor([-1]), r"expected logits_at in \[0, 3\)"),
        (torch.arange(300) % 4 - 1, r"got values in \[-1, 2\]"),  # many: one reduction
        (torch.tensor([0], dtype=torch.int32), "expected logits_at an int64 tensor"),
        (torch.tensor([[0]]), "expected logits_at an int64 tensor"),
    ],
)
def test_logits_at_is_checked(llama, at, message):
    _, paged = llama
    run = Runner(paged, page_size=4)
    plan = run.streams.plan([("a", 3)])
    with pytest.raises(ValueError, match=message):
        forward_step(paged, torch.zeros(3, dtype=torch.long), plan, run.cache, logits_at=at)


def test_a_cache_that_does_not_fit_the_model_is_refused(llama):
    """Before anything runs: the model's K/V shape is read by the probe."""
    _, paged = llama
    run = Runner(paged, page_size=4)
    plan = run.streams.plan([("a", 3)])
    small = KVCache(2, 8, 4, 1, 16)
    with pytest.raises(ValueError, match=r"expected a cache of .*'num_kv_heads': 2.* got"):
        forward_step(paged, torch.zeros(3, dtype=torch.long), plan, small)
    assert not small.layer(0).any()


def test_flashinfer_refuses_what_it_lacks(fake_flashinfer):
    """A model with attention sinks through the FlashInfer adapter is refused
    before the forward; soft-capping is FlashInfer's logits_soft_cap."""
    config = transformers.GptOssConfig(
        **{**SIZES, "intermediate_size": 32}, num_local_experts=2, num_experts_per_tok=1
    )
    _, paged = _models(transformers.GptOssForCausalLM, config)
    adapter, log = fake_flashinfer()
    run = Runner(paged, page_size=4, flashinfer=adapter)
    with pytest.raises(ValueError, match=r"FlashInfer serves, got one with attention sinks"):
        run.prefill([("a", [1, 2, 3])])
    assert log == [] and not run.cache.layer(0).any()
