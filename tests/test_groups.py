"""KV groups: hybrid models (sliding-window and full layers) through a
``KVManager`` per group of equal size, all on one page pool and one
``KVCache``. The windowed groups hold only their window, the full groups
every page, pages a windowed group gives back serve the full groups, and
the models stay exact against their own forward and generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.engine.resources.groups import GroupPlans, KVGroups, block_groups
from mstar.engine.resources.kv.errors import AllocationFailed
from mstar.engine.resources.step import KVStep, Segment

transformers = pytest.importorskip("transformers")

from test_architectures import _pair  # noqa: E402
from test_hf import _check_stream, _prompt  # noqa: E402
from test_hf_manager import ManagedRunner  # noqa: E402

from mstar.models.hf import forward_step, kv_spec  # noqa: E402

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
# groups of 2 layers: (W, (0, 1)), (W, (3,)) with a slot unused, (None, (2, 4))
UNEVEN = (
    "Gemma3TextConfig",
    {
        "num_hidden_layers": 5,
        "layer_types": ["sliding_attention"] * 2
        + ["full_attention", "sliding_attention", "full_attention"],
        "sliding_window": W,
    },
)


def _bound(window: int, page_size: int) -> int:
    return -(-window // page_size) + 1


class GroupRunner(ManagedRunner):
    """``ManagedRunner`` through ``KVGroups``: each plan label's forward
    gets a ``GroupPlans`` and the groups' cache."""

    def __init__(self, model: torch.nn.Module, page_size: int, num_pages: int = 64) -> None:
        self.model = model
        spec = kv_spec(model)
        self.mgr = KVGroups(spec.groups, num_pages, page_size, cache=spec.cache_kwargs())
        self.cache = self.mgr.cache
        self.tokens, self.logits = {}, {}


CASES = {**HYBRID, "gemma3_uneven": UNEVEN}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hybrid_models_stay_exact_with_windowed_groups_holding_their_window(name):
    """Chunked prefill crossing the window and pages beside another
    stream's decode rows, a fork, then decode far past the window: every
    step's logits against one full forward, greedy tokens against generate;
    the windowed groups' streams hold at most ceil(W / page_size) + 1 pages
    between steps, the full groups' every page, all on one pool."""
    reference, paged = _pair(*CASES[name])
    spec = kv_spec(paged)
    assert spec.window is None and len(spec.groups) == 2
    a, b = ("a", "main"), ("b", "main")
    prompt_a, prompt_b = _prompt(13, seed=21), _prompt(4, seed=22)
    page_size = 3
    run = GroupRunner(paged, page_size=page_size)
    windowed = [i for i, w in enumerate(run.mgr.windows) if w is not None]
    assert run.mgr.windows.count(None) == 1 and len(windowed) == 2
    run.step({a: prompt_a[:7], b: prompt_b})
    run.step({b: [run.next_token(b)], a: prompt_a[7:11]})
    run.step({a: prompt_a[11:], b: [run.next_token(b)]})
    run.fork(b, ["side"])
    c = ("b", "side")
    released = False
    for _ in range(14):
        plans = run.decode([a, b, c]).values()
        for group, window in enumerate(run.mgr.windows):
            plan = next(iter(plans)).plans[group]
            released |= window is not None and bool(plan.kv_offsets.any())
            assert (plan.kv_offsets is None) == (window is None)
        for stream in (a, b, c):
            held = run.mgr.held_pages(*stream)
            for group, window in enumerate(run.mgr.windows):
                if window is None:
                    assert held[group] == -(-run.mgr.stored_len(*stream) // page_size)
                else:
                    assert held[group] <= _bound(W, page_size)
        run.mgr.check_invariants()
    assert released, "no page went back: the test would not see a release"
    _check_stream(reference, run, a, len(prompt_a))
    _check_stream(reference, run, b, len(prompt_b))
    _check_stream(reference, run, c, len(prompt_b))


def test_block_groups_split_each_window_into_groups_of_the_fewest_layers():
    gemma3 = ((W, (0, 1, 2, 3, 4, 6, 7)), (None, (5, 8)))
    assert block_groups(gemma3) == (
        (W, (0, 1)), (W, (2, 3)), (W, (4, 6)), (W, (7,)), (None, (5, 8)),
    )  # fmt: skip
    assert block_groups(gemma3, 5) == ((W, (0, 1, 2, 3, 4)), (W, (6, 7)), (None, (5, 8)))
    assert block_groups(((None, (0, 1)),)) == ((None, (0, 1)),)
    groups = KVGroups(gemma3, 8, 4, cache={"num_layers": 9, "num_kv_heads": 1, "head_dim": 2,
                                          "v_head_dim": 2})  # fmt: skip
    assert groups.size == groups.cache.num_layers == 2 and len(groups.managers) == 5
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="expected size"):
            block_groups(gemma3, bad)


def test_a_step_must_bring_a_plan_per_group_and_their_cache():
    """A hybrid's forward refuses a mismatched layout before it computes
    anything; one plan and one cache over every layer (all pages kept) is
    served as before."""
    from mstar.engine.resources.kv.cache import KVCache

    reference, paged = _pair(*HYBRID["gemma2"])
    run = GroupRunner(paged, page_size=2)
    step = KVStep((Segment("a", "main", 4),))
    run.mgr.admit(step)
    plans = run.mgr.plan(step)["main"]
    ids = torch.tensor(_prompt(4, seed=1))
    every_layer = KVCache(num_pages=64, page_size=2, **kv_spec(paged).cache_kwargs())
    before = run.cache.layer(0).clone()
    for plan, cache in (
        (plans.plans[0], run.cache),  # a cache of 1 layer for a plan over every layer
        (GroupPlans(plans.plans[:2]), run.cache),
        (plans, every_layer),  # groups of 3 layers: 2 of them
        (plans, (run.cache,) * 3),
    ):
        with pytest.raises(ValueError, match=r"KV group|expected a cache|expected cache a"):
            forward_step(paged, ids, plan, cache)
    assert torch.equal(run.cache.layer(0), before)
    run.mgr.abort(step)
    keep_all = ManagedRunner(paged, page_size=2)
    keep_all.step({("a", "main"): ids.tolist()})
    _check_stream(reference, keep_all, ("a", "main"), 4)


def _snapshot(groups: KVGroups, keys) -> tuple:
    return (
        groups.num_free_pages,
        groups.pool.refcount.tolist(),
        [
            [(mgr.stored_len(*k), mgr.held_pages(*k)) for k in keys if mgr.labels(k[0])]
            for mgr in groups.managers
        ],
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_keep_the_groups_in_step(seed):
    """Random chunked steps, decode rows, forks, releases and aborts through
    KVGroups on a shared pool small enough to refuse steps: every group holds
    the same streams at the same lengths, a refused or aborted step changes no
    group and not the pool, the pool's refcounts are the sum of the groups'
    owners, windowed streams hold their window and full ones every page."""
    rng = np.random.default_rng(seed)
    page_size, window = int(rng.integers(1, 5)), int(rng.integers(1, 10))
    groups = KVGroups(((window, (0, 2)), (None, (1,))), 60, page_size)
    windowed, _, full = groups.managers
    assert groups.windows == (window, window, None)
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
        except AllocationFailed:  # the pool ran out: release the longest stream
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
        owned = sum(m.owner_counts() for m in groups.managers)
        assert np.array_equal(owned, groups.pool.refcount)
        assert sum(groups.group_pages()) + groups.num_free_pages == groups.num_pages
    assert refused, "no step was refused: the test would not see a rollback"


def test_the_engine_serves_a_hybrid_through_groups_on_one_pool():
    """The engine (prefix cache off) serves Gemma 2 through KV groups on one
    pool of the memory of ``num_pages`` pages over every layer, small enough
    to force preemption: two samples forked off each prompt and a generation
    far past the window equal HF generate, an aborted request gives its pages
    back, the windowed groups hold their window alone while the full group
    holds every page, and admission counts every group's pages. A long
    generation a per-group pool of ``num_pages`` would refuse is admitted and
    exact. With the prefix cache on it keeps one manager for all."""
    from mstar.cli.report import windows_note
    from mstar.engine import Engine, RequestTooLarge, SamplingParams

    reference, paged = _pair(*HYBRID["gemma2"])
    prompts = [_prompt(10, seed=31), _prompt(7, seed=32)]
    eng = Engine(paged, prefix_cache=False, num_pages=14, page_size=4, token_budget=8)
    assert isinstance(eng.mgr, KVGroups) and eng.mgr.num_pages == 14 * 3  # 3 groups of 1 layer
    with pytest.raises(RequestTooLarge, match="needs 59 KV pages"):  # 53 full + 2 x 3 (chunk <= W)
        eng.add_request(prompts[0], SamplingParams(max_new_tokens=200))
    params = SamplingParams(max_new_tokens=30, n=2, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    dropped = eng.add_request(_prompt(5, seed=33), params)
    held, finished = [], {}
    for i in range(200):  # bounded: about 60 steps serve both
        finished.update((c.request_id, c) for c in eng.step() if c.finished)
        if i == 30:  # after the preemption
            eng.abort(dropped)
        held.append(eng.mgr.group_pages())
        eng.mgr.check_invariants()
        if not eng.has_unfinished():
            break
    assert sorted(finished) == sorted(ids) and eng.stats.preemptions > 0
    for prompt, completion in zip(prompts, (finished[i] for i in ids)):
        tokens = torch.tensor([prompt])
        expected = reference.generate(tokens, max_new_tokens=30, do_sample=False)[0, len(prompt) :]
        for output in completion.outputs:
            assert output.token_ids == expected.tolist()
    peaks = np.max(held, axis=0)
    assert max(peaks[:2]) <= 4 * (_bound(W, 4) + 2) < peaks[2]  # 2 requests x 2 samples, + a chunk
    assert eng.mgr.num_free_pages == 42 and eng.mgr.group_pages() == (0, 0, 0)
    # 25 pages in the full group alone: more than a pool of its own of 14 pages
    long = eng.generate(prompts[:1], SamplingParams(max_new_tokens=90, ignore_eos=True))[0]
    expected = reference.generate(torch.tensor(prompts[:1]), max_new_tokens=90, do_sample=False)
    assert long.outputs[0].token_ids == expected[0, 10:].tolist()
    assert eng.stats.peak_pages > 25 > 14
    keeping = Engine(paged, prefix_cache=True, num_pages=24, page_size=4)
    assert keeping.mgr.window is None and not isinstance(keeping.mgr, KVGroups)
    assert windows_note(eng).startswith(
        "KV groups: window 5 on layers 0; window 5 on layers 2; full on layers 1"
    )
    assert windows_note(keeping) == "every page kept (the prefix cache is on: no release)"


def test_pages_a_windowed_group_releases_serve_the_full_group():
    """One long decode through KVGroups on a shared pool of 2 x 10 pages: a
    page the windowed group gave back is later held by the full group, and
    the stream grows to 60 tokens (15 full-group pages). Per-group pools of
    the same memory (10 pages each, one manager per group) refuse it at 41
    tokens."""
    from mstar.engine.resources.kv.manager import KVManager

    shared = KVGroups(((None, (0,)), (4, (1,))), 20, 4)  # the full group allocates first
    own = [KVManager(10, 4), KVManager(10, 4, window=4)]
    full, windowed = shared.managers
    seen_windowed: set[int] = set()
    reused = refused_at = 0
    for n in range(1, 61):
        step = KVStep((Segment("r", "main", 1),))
        shared.admit(step)
        shared.plan(step)
        shared.commit(step)
        shared.check_invariants()
        seen_windowed |= set(windowed.page_ids("r", "main").tolist())
        reused += len(seen_windowed & set(full.page_ids("r", "main").tolist()))
        if not refused_at:
            try:
                for mgr in own:
                    mgr.admit(step)
                    mgr.commit(step)
            except AllocationFailed:
                refused_at = n
    assert full.held_pages("r", "main") == 15 and windowed.held_pages("r", "main") <= 2
    assert reused, "the full group never took a page the windowed group gave back"
    assert refused_at == 41


def test_bench_window_prints_pages_held_with_and_without_release(capsys, tmp_path):
    """``mstar-kv bench --window``: a windowed group holds its window, a full
    one (and the keep-all baseline) every page; on one shared pool a hybrid
    fits more requests than per-group pools of the same memory."""
    import json

    from mstar.cli import main

    path = tmp_path / "window.json"
    assert main(["bench", "--window", "--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| Gemma 2-like (1:1) | 2 | 96 / 96 | 33 / 32 | 96 | 129 / 192 (0.67x) |" in out
    rows = {r["model"]: r for r in json.loads(path.read_text())}
    assert rows["Mistral-like"]["windowed_peak"] == _bound(512, 16)
    assert rows["Mistral-like"]["admission"] < rows["Mistral-like"]["admission_keep_all"]
    assert rows["Gemma 3-like (5:1)"]["memory_released"] == 5 * 33 + 96
    gemma3 = rows["Gemma 3-like (5:1)"]
    assert gemma3["admission"] == (96 + 5 * (_bound(512, 16) + 16)) < gemma3["admission_keep_all"]
    assert gemma3["fit_keep_all"] == gemma3["fit_per_group"] == 4096 // 96
    assert gemma3["fit_shared"] == 6 * 4096 // (96 + 5 * 33) > 2 * gemma3["fit_per_group"]


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
    windowed = int(re.search(r"\| 16: 0, 2 \| (\d+) of 80 \(2 layers\)", out)[1])
    full = int(re.search(r"\| full: 1, 3 \| (\d+) of 80 \(2 layers\)", out)[1])
    assert windowed <= 2 * (_bound(16, 4) + 8) < full  # + a 32-token chunk in flight
    assert main([*argv, "--model", "random"]) == 2


def test_a_commit_failing_part_way_is_aborted_and_released():
    """A fork's page copy fails in the second group after the first group
    committed: ``abort`` rolls back the rest, releasing the request leaves
    every group empty and the pool sound."""
    sizes = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 2, "v_head_dim": 2}
    groups = KVGroups(((3, (0,)), (None, (1,))), 8, 4, cache=sizes)
    prefill = KVStep((Segment("r", "main", 6),))
    groups.admit(prefill)
    groups.plan(prefill)
    groups.commit(prefill)
    copies = []
    copy_pages = groups.cache.copy_pages

    def second_fails(src, dst):
        copies.append(dst)
        if len(copies) == 2:
            raise RuntimeError("copy failed")
        copy_pages(src, dst)

    groups.cache.copy_pages = second_fails
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
    assert groups.num_free_pages == 8 and groups.group_pages() == (0, 0)


def test_a_fork_copies_the_whole_page_of_its_group():
    """On the shared cache a fork's partial page is copied in every slot:
    the forked stream reads the same keys as its source in each group's
    layers (a group's layers are the cache's slots 0 .. k - 1)."""
    sizes = {"num_layers": 4, "num_kv_heads": 1, "head_dim": 2, "v_head_dim": 2}
    groups = KVGroups(((3, (0, 2)), (None, (1, 3))), 8, 4, cache=sizes)
    assert groups.size == 2
    prefill = KVStep((Segment("r", "main", 6),))
    groups.admit(prefill)
    groups.plan(prefill)
    groups.commit(prefill)
    for slot in range(2):
        layer = groups.cache.layer(slot)
        layer.copy_(torch.randn_like(layer))
    fork = KVStep((Segment("r", "main", 0),), post_forks=(("main", "side"),))
    groups.admit(fork)
    groups.commit(fork)
    for mgr in groups.managers:
        src, dst = mgr.page_ids("r", "main")[-1], mgr.page_ids("r", "side")[-1]
        assert src != dst
        for slot in range(2):
            layer = groups.cache.layer(slot)
            assert torch.equal(layer[src], layer[dst])
    groups.check_invariants()


def test_a_manager_takes_a_shared_pool_of_its_sizes_without_the_prefix_cache():
    from mstar.engine.resources.kv.manager import KVManager
    from mstar.engine.resources.kv.pages import PagePool

    pool = PagePool(8, 4)
    for kwargs, match in (
        ({"num_pages": 9}, "expected a pool of 9 pages of 4, got one of 8 pages of 4"),
        ({"page_size": 2}, "expected a pool of 8 pages of 2"),
        ({"prefix_cache": True}, "expected prefix_cache=False with a shared pool"),
    ):
        args = {"num_pages": 8, "page_size": 4, **kwargs}
        with pytest.raises(ValueError, match=match):
            KVManager(args.pop("num_pages"), args.pop("page_size"), pool=pool, **args)
    with pytest.raises(TypeError, match="expected pool a PagePool or None, got int"):
        KVManager(8, 4, pool=8)
    a, b = KVManager(8, 4, pool=pool), KVManager(8, 4, pool=pool, window=3)
    for mgr, n in ((a, 9), (b, 6)):
        step = KVStep((Segment("r", "main", n),))
        mgr.admit(step)
        mgr.commit(step)
    assert pool.num_free == 8 - 3 - 1 and a.num_free_pages == b.num_free_pages  # b released 1
    a.check_invariants()
    pool.refcount[a.page_ids("r", "main")[0]] = 0  # a page of a's the pool lost count of
    with pytest.raises(AssertionError, match="owns no more of a page than the pool counts"):
        a.check_invariants()


def test_a_refusal_names_the_first_request_that_does_not_fit_across_groups():
    """Rows a (8 tokens: 2 pages a group) and b (16 tokens: 4 a group) on a
    pool of 6 pages: the windowed group reserves 6 pages for both before the
    full group refuses at a; the refusal names b, as a fits alone (2 + 2),
    changes nothing, and a is then admitted on its own."""
    groups = KVGroups(((4, (0,)), (None, (1,))), 6, 4)
    step = KVStep((Segment("a", "main", 8), Segment("b", "main", 16)))
    with pytest.raises(AllocationFailed) as refused:
        groups.admit(step)
    assert (refused.value.request_id, refused.value.pages_short) == ("b", 6)
    assert groups.num_free_pages == 6 and not groups.labels("a")
    groups.check_invariants()
    alone = KVStep((Segment("a", "main", 8),))
    groups.admit(alone)
    groups.commit(alone)
    assert groups.held_pages("a", "main") == (1, 2) and groups.num_free_pages == 3  # 1 released
    groups.check_invariants()


def test_a_fork_the_pool_cannot_hold_is_refused_in_every_group():
    """A fork copying a partial page in each group (2 pages) with 1 free:
    the windowed group's reservation is undone, the refusal names the
    request and is 1 page short, nothing changed."""
    groups = KVGroups(((4, (0,)), (None, (1,))), 5, 4)
    prefill = KVStep((Segment("r", "main", 6),))
    groups.admit(prefill)
    groups.commit(prefill)
    assert groups.held_pages("r", "main") == (2, 2) and groups.num_free_pages == 1
    fork = KVStep((Segment("r", "main", 0),), post_forks=(("main", "side"),))
    with pytest.raises(AllocationFailed) as refused:
        groups.admit(fork)
    assert (refused.value.request_id, refused.value.pages_short) == ("r", 1)
    assert groups.num_free_pages == 1 and groups.labels("r") == ["main"]
    groups.check_invariants()
