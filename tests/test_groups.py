"""KV groups: hybrid models (sliding-window and full layers) through one
``KVManager`` and one ``KVCache`` per group. The windowed groups hold only
their window, the full groups every page, and the models stay exact against
their own forward and generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.engine.resources.groups import GroupPlans, KVGroups
from mstar.engine.resources.kv.errors import AllocationFailed
from mstar.engine.resources.step import KVStep, Segment

transformers = pytest.importorskip("transformers")

from test_architectures import _pair  # noqa: E402
from test_hf import _check_stream, _prompt  # noqa: E402
from test_hf_manager import ManagedRunner  # noqa: E402

from mstar.integrations.hf import forward_step, kv_spec  # noqa: E402

W = 5
# sliding, full, sliding: a group's layers need not be contiguous
LAYERS = {
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": W,
}
HYBRID = {
    "cohere2": ("Cohere2Config", LAYERS),
    "gemma2": ("Gemma2Config", {**LAYERS, "attn_logit_softcapping": 2.0}),
    "gemma3_text": ("Gemma3TextConfig", LAYERS),
    "gpt_oss": ("GptOssConfig", {**LAYERS, "intermediate_size": 32}),  # sinks
    "olmo3": ("Olmo3Config", LAYERS),
}


def _bound(window: int, page_size: int) -> int:
    return -(-window // page_size) + 1


class GroupRunner(ManagedRunner):
    """``ManagedRunner`` through ``KVGroups``: each plan label's forward
    gets a ``GroupPlans`` and the groups' caches."""

    def __init__(self, model: torch.nn.Module, page_size: int, num_pages: int = 64) -> None:
        self.model = model
        spec = kv_spec(model)
        self.mgr = KVGroups(spec.groups, num_pages, page_size, cache=spec.cache_kwargs())
        self.cache = self.mgr.caches
        self.tokens, self.logits = {}, {}


@pytest.mark.parametrize("name", sorted(HYBRID))
def test_hybrid_models_stay_exact_with_windowed_groups_holding_their_window(name):
    """Chunked prefill crossing the window and pages beside another
    stream's decode rows, a fork, then decode far past the window: every
    step's logits against one full forward, greedy tokens against generate;
    the windowed group's streams hold at most ceil(W / page_size) + 1 pages
    between steps, the full group's every page."""
    reference, paged = _pair(*HYBRID[name])
    spec = kv_spec(paged)
    assert spec.window is None and spec.groups == ((W, (0, 2)), (None, (1,)))
    a, b = ("a", "main"), ("b", "main")
    prompt_a, prompt_b = _prompt(13, seed=21), _prompt(4, seed=22)
    page_size = 3
    run = GroupRunner(paged, page_size=page_size)
    run.step({a: prompt_a[:7], b: prompt_b})
    run.step({b: [run.next_token(b)], a: prompt_a[7:11]})
    run.step({a: prompt_a[11:], b: [run.next_token(b)]})
    run.fork(b, ["side"])
    c = ("b", "side")
    released = False
    for _ in range(14):
        plans = run.decode([a, b, c])
        windowed, full = plans["main"].plans
        released |= bool(windowed.kv_offsets.any())
        assert full.kv_offsets is None
        for stream in (a, b, c):
            held_w, held_f = run.mgr.held_pages(*stream)
            assert held_w <= _bound(W, page_size)
            assert held_f == -(-run.mgr.stored_len(*stream) // page_size)
        run.mgr.check_invariants()
    assert released, "no page went back: the test would not see a release"
    _check_stream(reference, run, a, len(prompt_a))
    _check_stream(reference, run, b, len(prompt_b))
    _check_stream(reference, run, c, len(prompt_b))


def test_a_step_must_bring_a_plan_and_a_cache_per_group():
    """A hybrid's forward refuses a mismatched layout before it computes
    anything; one plan and one cache over every layer (all pages kept) is
    served as before."""
    reference, paged = _pair(*HYBRID["gemma2"])
    run = GroupRunner(paged, page_size=2)
    step = KVStep((Segment("a", "main", 4),))
    run.mgr.admit(step)
    plans = run.mgr.plan(step)["main"]
    ids = torch.tensor(_prompt(4, seed=1))
    before = [c.layer(0).clone() for c in run.cache]
    for plan, cache in (
        (plans.plans[0], run.cache),
        (plans, run.cache[:1]),
        (GroupPlans(plans.plans[:1]), run.cache),
        (plans, run.cache[::-1]),  # each cache sized to its group's layers
    ):
        with pytest.raises(ValueError, match=r"KV group|expected a cache"):
            forward_step(paged, ids, plan, cache)
    assert all(torch.equal(c.layer(0), b) for c, b in zip(run.cache, before))
    run.mgr.abort(step)
    keep_all = ManagedRunner(paged, page_size=2)
    keep_all.step({("a", "main"): ids.tolist()})
    _check_stream(reference, keep_all, ("a", "main"), 4)


def _snapshot(groups: KVGroups, keys) -> tuple:
    return tuple(
        (
            mgr.num_free_pages,
            [(mgr.stored_len(*k), mgr.held_pages(*k)) for k in keys if mgr.labels(k[0])],
        )
        for mgr in groups.managers
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_keep_the_groups_in_step(seed):
    """Random chunked steps, decode rows, forks, releases and aborts through
    KVGroups on a pool small enough to refuse steps: every group holds the
    same streams at the same lengths, a refused or aborted step changes no
    group, each group's invariants hold, windowed streams hold their window
    and full ones every page."""
    rng = np.random.default_rng(seed)
    page_size, window = int(rng.integers(1, 5)), int(rng.integers(1, 10))
    groups = KVGroups(((window, (0, 2)), (None, (1,))), 40, page_size)
    windowed, full = groups.managers
    keys = [(f"r{i}", "main") for i in range(3)]
    total = dict.fromkeys(keys, 0)
    refused = 0
    for _ in range(60):
        rows = [k for k in keys if rng.random() < 0.7] or keys[:1]
        spans = [int(rng.integers(1, 3 * page_size + 2)) if rng.random() < 0.3 else 1 for _ in rows]
        forks = (("main", "side"),) if rng.random() < 0.15 and total[rows[0]] else ()
        step = KVStep(
            tuple(Segment(r, label, n) for (r, label), n in zip(rows, spans)), post_forks=forks
        )
        before = _snapshot(groups, keys)
        try:
            groups.admit(step)
        except AllocationFailed:  # the full group ran out: release the longest stream
            refused += 1
            assert _snapshot(groups, keys) == before
            longest = max(total, key=total.get)
            groups.release(longest[0])
            total[longest] = 0
            continue
        plans = groups.plan(step)["main"]
        assert plans.rows == [p.rows for p in plans.plans][1]
        if rng.random() < 0.2:
            groups.abort(step)
            assert _snapshot(groups, keys) == before
            groups.check_invariants()
            continue
        groups.commit(step)
        for k, n in zip(rows, spans):
            total[k] += n
            for key in (k, (k[0], "side")) if forks else (k,):
                assert windowed.stored_len(*key) == full.stored_len(*key) == total[k]
                assert windowed.held_pages(*key) <= _bound(window, page_size)
                assert full.held_pages(*key) == -(-total[k] // page_size)
        for r, _ in keys:
            assert windowed.labels(r) == full.labels(r)
        groups.check_invariants()
    assert refused, "no step was refused: the test would not see a rollback"


def test_the_engine_serves_a_hybrid_through_groups():
    """The engine (prefix cache off) serves Gemma 2 through KV groups on a
    pool that forces preemption: two samples forked off each prompt and a
    generation far past the window equal HF generate, an aborted request
    gives its pages back in every group, the windowed group holds its window
    alone while the full group holds every page, and admission counts the
    full group. With the prefix cache on it keeps one manager for all."""
    from mstar.engine import Engine, RequestTooLarge, SamplingParams
    from mstar.report import windows_note

    reference, paged = _pair(*HYBRID["gemma2"])
    prompts = [_prompt(10, seed=31), _prompt(7, seed=32)]
    eng = Engine(paged, prefix_cache=False, num_pages=24, page_size=4, token_budget=8)
    assert isinstance(eng.mgr, KVGroups) and eng.mgr.window is None
    params = SamplingParams(max_new_tokens=30, n=2, ignore_eos=True)
    with pytest.raises(RequestTooLarge, match="needs 25 KV pages"):  # the full group's
        eng.add_request(prompts[0], SamplingParams(max_new_tokens=90))
    ids = [eng.add_request(p, params) for p in prompts]
    dropped = eng.add_request(_prompt(5, seed=33), params)
    held, finished = [], {}
    for i in range(200):  # bounded: about 80 steps serve both
        finished.update((c.request_id, c) for c in eng.step() if c.finished)
        if i == 3:
            eng.abort(dropped)
        held.append([m.num_pages - m.num_free_pages for m in eng.mgr.managers])
        eng.mgr.check_invariants()
        if not eng.has_unfinished():
            break
    assert sorted(finished) == sorted(ids) and eng.stats.preemptions > 0
    for prompt, completion in zip(prompts, (finished[i] for i in ids)):
        tokens = torch.tensor([prompt])
        expected = reference.generate(tokens, max_new_tokens=30, do_sample=False)[0, len(prompt) :]
        for output in completion.outputs:
            assert output.token_ids == expected.tolist()
    windowed, full = max(w for w, _ in held), max(f for _, f in held)
    assert windowed <= 4 * (_bound(W, 4) + 2) < full  # 2 requests x 2 samples, + a chunk
    assert [m.num_free_pages for m in eng.mgr.managers] == [24, 24]
    keeping = Engine(paged, prefix_cache=True, num_pages=24, page_size=4)
    assert keeping.mgr.window is None and not isinstance(keeping.mgr, KVGroups)
    assert windows_note(eng).startswith("KV groups: window 5 on layers 0, 2; full on layers 1")
    assert windows_note(keeping) == "every page kept (the prefix cache is on: no release)"


def test_bench_window_prints_pages_held_with_and_without_release(capsys, tmp_path):
    """``mstar-kv bench --window``: a windowed group holds its window, a full
    one (and the keep-all baseline) every page."""
    import json

    from mstar.cli import main

    path = tmp_path / "window.json"
    assert main(["bench", "--window", "--quick", "--json", str(path)]) == 0
    assert "| Gemma 2-like (1:1) | 96 / 96 | 33 / 32 | 96 |" in capsys.readouterr().out
    rows = {r["model"]: r for r in json.loads(path.read_text())}
    assert rows["Mistral-like"]["windowed_peak"] == _bound(512, 16)
    assert rows["Mistral-like"]["admission"] < rows["Mistral-like"]["admission_keep_all"]
    assert rows["Gemma 3-like (5:1)"]["memory_released"] == 5 * 33 + 96


def test_demo_window_serves_a_hybrid_keeping_and_releasing(capsys):
    """``mstar-kv demo --window gemma2 --check``: both engines agree with HF
    generate; the windowed group's peak is below the full group's."""
    import re

    from mstar.cli import main

    argv = ["demo", "--window", "gemma2", "--requests", "2", "--max-new-tokens", "30"]
    assert main([*argv, "--pages", "40", "--check"]) == 0
    out = capsys.readouterr().out
    assert "outputs equal between the two engines: yes" in out
    assert "against HF generate: 2 passed, 0 failed" in out
    windowed = int(re.search(r"\| 16: 0, 2 \| (\d+) of 40", out)[1])
    full = int(re.search(r"\| full: 1, 3 \| (\d+) of 40", out)[1])
    assert windowed <= 2 * (_bound(16, 4) + 8) < full  # + a 32-token chunk in flight
    assert main([*argv, "--model", "random"]) == 2


def test_a_commit_failing_part_way_is_aborted_and_released():
    """A fork's page copy fails in the second group after the first group
    committed: ``abort`` rolls back the rest, releasing the request leaves
    every group empty and sound."""
    sizes = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 2, "v_head_dim": 2}
    groups = KVGroups(((3, (0,)), (None, (1,))), 8, 4, cache=sizes)
    prefill = KVStep((Segment("r", "main", 6),))
    groups.admit(prefill)
    groups.plan(prefill)
    groups.commit(prefill)

    def broken(src, dst):
        raise RuntimeError("copy failed")

    groups.caches[1].copy_pages = broken
    step = KVStep((Segment("r", "main", 1),), post_forks=(("main", "side"),))
    groups.admit(step)
    groups.plan(step)
    with pytest.raises(RuntimeError, match="copy failed"):
        groups.commit(step)
    assert groups.managers[0].labels("r") == ["main", "side"]
    assert groups.managers[1].labels("r") == ["main"]
    groups.abort(step)
    groups.release("r")
    groups.check_invariants()
    assert [m.num_free_pages for m in groups.managers] == [8, 8]
