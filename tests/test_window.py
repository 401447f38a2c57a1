"""Sliding-window models hold only their window: a ``KVManager(...,
window=W)`` releases the full pages behind it, its plans describe the kept
pages alone (``SequenceView.start``, ``KVPlanOutput.kv_offsets``), positions
stay absolute, and the models stay exact against their own forward and
generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.position import positions
from mstar.engine.resources.step import KVStep, Segment

transformers = pytest.importorskip("transformers")

from test_architectures import _pair  # noqa: E402
from test_hf import _check_stream, _prompt  # noqa: E402
from test_hf_manager import ManagedRunner  # noqa: E402

from mstar.models.hf import forward_step, kv_spec  # noqa: E402

W = 5
WINDOWED = {
    "mistral": ("MistralConfig", {"sliding_window": W}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": W}),
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 0},
    ),
}


def _bound(window: int, page_size: int) -> int:
    return -(-window // page_size) + 1


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_models_stay_exact_holding_only_their_window(name):
    """Chunked prefill crossing the window and pages beside another
    stream's decode rows, then decode far past the window: every step's
    logits against one full forward, greedy tokens against generate, and
    between steps each stream holds at most ceil(W / page_size) + 1 pages."""
    reference, paged = _pair(*WINDOWED[name])
    assert kv_spec(paged).window == W
    a, b = ("a", "main"), ("b", "main")
    prompt_a, prompt_b = _prompt(13, seed=21), _prompt(4, seed=22)
    run = ManagedRunner(paged, page_size=3, num_pages=32, window=W)
    run.step({a: prompt_a[:7], b: prompt_b})
    run.step({b: [run.next_token(b)], a: prompt_a[7:11]})
    run.step({a: prompt_a[11:], b: [run.next_token(b)]})
    released = False
    for _ in range(14):
        plans = run.decode([a, b])
        released |= bool(plans["main"].kv_offsets.any())
        for stream in (a, b):
            assert run.mgr.held_pages(*stream) <= _bound(W, 3)
        run.mgr.check_invariants()
    assert released, "no page went back: the test would not see a release"
    assert run.mgr.stored_len(*a) == len(run.tokens[a])
    _check_stream(reference, run, a, len(prompt_a))
    _check_stream(reference, run, b, len(prompt_b))


def test_a_model_reading_released_keys_is_refused():
    """A plan whose released keys the model still reads (its window is
    wider than the manager's) is refused before anything is computed."""
    _, paged = _pair("MistralConfig", {"sliding_window": 8})
    run = ManagedRunner(paged, page_size=2, num_pages=32, window=3)
    s = ("a", "main")
    run.step({s: _prompt(9, seed=3)})
    step = KVStep((Segment("a", "main", 1),))
    run.mgr.admit(step)
    plan = run.mgr.plan(step)["main"]
    before = run.cache.layer(0).clone()
    with pytest.raises(ValueError, match="released"):
        forward_step(paged, torch.tensor([1]), plan, run.cache)
    assert torch.equal(run.cache.layer(0), before)
    run.mgr.abort(step)
    run.mgr.check_invariants()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"window": 0}, ValueError),
        ({"window": 2.0}, ValueError),
        ({"window": True}, ValueError),
        ({"window": 4, "prefix_cache": True}, ValueError),
    ],
)
def test_a_bad_window_is_refused(kwargs, error):
    with pytest.raises(error, match="window"):
        KVManager(8, 4, **kwargs)


def _snapshot(mgr: KVManager, keys) -> tuple:
    return (
        mgr.num_free_pages,
        [(mgr.stored_len(*k), mgr.held_pages(*k)) for k in keys if mgr.labels(k[0])],
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_hold_the_window_and_keep_positions_absolute(seed):
    """Random chunked steps, decode rows, forks and aborts on a windowed
    manager: positions count every token ever stored, each row's keys
    reach its window from its kept pages, released pages are free, an
    aborted step changes nothing, and between steps each stream holds at
    most ceil(W / page_size) + 1 pages."""
    rng = np.random.default_rng(seed)
    page_size, window = int(rng.integers(1, 5)), int(rng.integers(1, 10))
    mgr = KVManager(256, page_size, window=window)
    keys = [(f"r{i}", "main") for i in range(3)]
    total = dict.fromkeys(keys, 0)
    for _ in range(40):
        rows = [k for k in keys if rng.random() < 0.7] or keys[:1]
        spans = [int(rng.integers(1, 3 * page_size + 2)) if rng.random() < 0.3 else 1 for _ in rows]
        forks = ()
        if rng.random() < 0.15 and total[rows[0]]:
            forks = (("main", "side"),)
        step = KVStep(
            tuple(Segment(r, label, n) for (r, label), n in zip(rows, spans)), post_forks=forks
        )
        before = _snapshot(mgr, keys)
        mgr.admit(step)
        plan = mgr.plan(step)["main"]
        expect = np.concatenate([np.arange(total[k], total[k] + n) for k, n in zip(rows, spans)])
        assert positions(plan).tolist() == expect.tolist()
        for view, offset in zip(plan.views, plan.kv_offsets.tolist()):
            first = offset + view.start + view.length - view.to_compute  # first query
            assert offset + view.start == max(first - (window - 1), 0)
            assert view.length - view.to_compute == min(first, window - 1)
        if rng.random() < 0.2:
            mgr.abort(step)
            assert _snapshot(mgr, keys) == before
            mgr.check_invariants()
            continue
        mgr.commit(step)
        for k, n in zip(rows, spans):
            total[k] += n
            assert mgr.stored_len(*k) == total[k]
            assert mgr.held_pages(*k) <= _bound(window, page_size)
            if forks:
                assert mgr.stored_len(k[0], "side") == total[k]
                assert mgr.held_pages(k[0], "side") <= _bound(window, page_size)
        mgr.check_invariants()
    held = sum(mgr.held_pages(r, label) for r in dict(keys) for label in mgr.labels(r))
    assert mgr.num_free_pages >= 256 - held  # released pages are free (shared ones counted once)


def test_the_engine_admits_a_long_generation_on_a_windowed_model():
    """A generation whose full KV would need far more pages than the pool
    has runs on a windowed model (its streams hold their window alone) and
    equals HF generate; with the prefix cache on, pages are kept and the
    same request is refused up front."""
    from mstar.engine import Engine, RequestTooLarge, SamplingParams

    reference, paged = _pair("MistralConfig", {"sliding_window": W})
    prompts = [_prompt(10, seed=31), _prompt(7, seed=32)]
    params = SamplingParams(max_new_tokens=40)
    options = {"num_pages": 8, "page_size": 4, "token_budget": 8}
    eng = Engine(paged, prefix_cache=False, **options)
    assert eng.peak_pages(10, params) == 3  # ceil((W + 4 - 2 + min(8, W)) / 4), not 13
    ids = [eng.add_request(p, params) for p in prompts]
    finished = {}
    for _ in range(100):  # bounded: 47 token steps serve both
        finished.update((c.request_id, c) for c in eng.step() if c.finished)
        if not eng.has_unfinished():
            break
    assert sorted(finished) == sorted(ids)
    for prompt, completion in zip(prompts, (finished[i] for i in ids)):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, max_new_tokens=40, do_sample=False)[0, len(prompt) :]
        assert completion.outputs[0].token_ids == expected.tolist()
    assert eng.stats.peak_pages <= 8 and eng.stats.preemptions == 0
    assert eng.mgr.num_free_pages == 8
    keeping = Engine(paged, prefix_cache=True, **options)
    with pytest.raises(RequestTooLarge, match="needs 13 KV pages"):
        keeping.add_request(prompts[0], params)


def test_hybrid_models_share_no_window():
    """Alternating sliding/full layers (Gemma 2) share no window: the spec
    names none (one manager for every layer keeps every page) and two KV
    groups (tests/test_groups.py: a manager per group)."""
    _, paged = _pair(
        "Gemma2Config",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    )
    assert kv_spec(paged).window is None
    assert kv_spec(paged).groups == ((4, (0,)), (None, (1,)))


def test_by_default_the_engine_releases_on_windowed_models_and_caches_prefixes_on_others():
    """``prefix_cache=None`` (the default): off with a window in any layer
    (window-only: one windowed manager; hybrid: KV groups), on without."""
    from mstar.engine import Engine
    from mstar.engine.resources.groups import KVGroups

    options = {"num_pages": 8, "page_size": 4}
    _, mistral = _pair("MistralConfig", {"sliding_window": W})
    eng = Engine(mistral, **options)
    assert not eng.prefix_cache and eng.mgr.window == W
    _, gemma = _pair(
        "Gemma2Config",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    )
    eng = Engine(gemma, **options)
    assert not eng.prefix_cache and isinstance(eng.mgr, KVGroups)
    _, llama = _pair("LlamaConfig", {})
    eng = Engine(llama, **options)
    assert eng.prefix_cache and eng.mgr.window is None
    assert Engine(mistral, prefix_cache=True, **options).mgr.window is None
    with pytest.raises(TypeError, match="prefix_cache a bool or None"):
        Engine(llama, prefix_cache=1, **options)
