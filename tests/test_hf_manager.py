"""A Hugging Face decoder run on plans from the real KVManager (over a
KVCache, so forks copy tail pages through ``copy_pages``) matches its own
full-sequence forward (logits) and its own generate (greedy tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import SIZES, _check_stream, _models, _prompt  # noqa: E402

from mstar.engine.resources.kv.cache import KVCache  # noqa: E402
from mstar.engine.resources.kv.manager import KVManager  # noqa: E402
from mstar.engine.resources.kv.plan import KVPlanOutputs  # noqa: E402
from mstar.engine.resources.step import KVStep, Segment  # noqa: E402
from mstar.models.hf import forward_step, kv_spec  # noqa: E402

Stream = tuple[str, str]  # (request_id, label)


@pytest.fixture(scope="module")
def llama():
    return _models(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SIZES))


class ManagedRunner:
    """Feeds (request, label) streams through ``forward_step``, one forward per
    plan label, and keeps each stream's tokens and logits (the interface
    ``test_hf._check_stream`` reads). A fork target inherits its source's, as
    it inherits its pages."""

    def __init__(
        self, model: torch.nn.Module, page_size: int, num_pages: int = 64, window: int | None = None
    ) -> None:
        self.model = model
        self.cache = KVCache(
            num_pages=num_pages, page_size=page_size, **kv_spec(model).cache_kwargs()
        )
        self.mgr = KVManager(num_pages, page_size, cache=self.cache, window=window)
        self.tokens: dict[Stream, list[int]] = {}
        self.logits: dict[Stream, list[torch.Tensor]] = {}

    def step(self, feeds: dict[Stream, list[int]], **kwargs) -> KVPlanOutputs:
        """One step: each stream grows by its tokens (``kwargs`` go to KVStep)."""
        segments = tuple(Segment(r, label, len(ids)) for (r, label), ids in feeds.items())
        step = KVStep(segments, **kwargs)
        self.mgr.admit(step)
        plans = self.mgr.plan(step)
        for plan in plans.values():
            ids = torch.tensor([t for row in plan.rows for t in feeds[row]])
            logits = forward_step(self.model, ids, plan, self.cache)
            counts = np.diff(plan.cpu_indptrs.qo_indptr.numpy()).tolist()
            for row, rows_logits in zip(plan.rows, logits.split(counts)):
                self.tokens.setdefault(row, []).extend(feeds[row])
                self.logits.setdefault(row, []).append(rows_logits)
        self.mgr.commit(step)
        return plans

    def decode(self, streams: list[Stream], **kwargs) -> KVPlanOutputs:
        """One step feeding each stream its greedy next token."""
        return self.step({s: [self.next_token(s)] for s in streams}, **kwargs)

    def fork(self, source: Stream, targets: list[str]) -> None:
        """A fork-only step: admitted and committed, nothing to compute (a
        plan label without tokens has no forward)."""
        request_id, label = source
        forks = tuple((label, target) for target in targets)
        step = KVStep((Segment(request_id, label, 0),), post_forks=forks)
        self.mgr.admit(step)
        self.mgr.commit(step)
        for target in targets:
            self.tokens[(request_id, target)] = list(self.tokens[source])
            self.logits[(request_id, target)] = list(self.logits[source])

    def next_token(self, stream: Stream) -> int:
        return int(self.logits[stream][-1][-1].argmax())


def test_chunked_prefill_beside_decode_rows(llama):
    """One prompt's chunks share steps with the other's decode rows, then
    identical decode steps (planned off the previous one) cross pages."""
    reference, paged = llama
    a, b = ("a", "main"), ("b", "main")
    prompt_a, prompt_b = _prompt(11, seed=5), _prompt(6, seed=6)
    run = ManagedRunner(paged, page_size=4)
    run.step({a: prompt_a[:5], b: prompt_b})
    run.step({b: [run.next_token(b)], a: prompt_a[5:9]})
    run.step({a: prompt_a[9:], b: [run.next_token(b)]})
    for _ in range(5):
        run.decode([a, b])
    _check_stream(reference, run, a, len(prompt_a))
    _check_stream(reference, run, b, len(prompt_b))


def test_forked_samples_continue_the_prompt(llama):
    """Two samples forked off a prefilled prompt share its full pages and
    copy its partial last page (10 tokens, pages of 4); s0 continues from the
    most likely token, s1 from the second, both greedy after, and neither
    needs the source once forked."""
    reference, paged = llama
    prompt = _prompt(10, seed=7)
    main, s0, s1 = ("p", "main"), ("p", "s0"), ("p", "s1")
    run = ManagedRunner(paged, page_size=4)
    run.step({main: prompt[:6]})
    source = run.step({main: prompt[6:]})["main"].views[0].page_idxs
    run.fork(main, ["s0", "s1"])
    assert run.mgr.shared_pages() == 2 * 2  # two full pages, three owners each
    first, second = run.logits[main][-1][-1].topk(2).indices.tolist()
    plans = run.step({s0: [first], s1: [second]})
    pages = [list(plans[label].views[0].page_idxs) for label in ("s0", "s1")]
    assert pages[0][:2] == pages[1][:2] == list(source[:2])
    assert len({pages[0][2], pages[1][2], source[2]}) == 3
    run.mgr.release("p", "main")
    for _ in range(5):
        run.decode([s0, s1])
    _check_stream(reference, run, s0, len(prompt) + 1)
    _check_stream(reference, run, s1, len(prompt) + 1)


def test_combined_labels_share_one_forward(llama):
    """cond and uncond packed under one plan label, beside a standalone one:
    each row's logits are those of the model's own forward on its prompt."""
    reference, paged = llama
    cfg = {("cond", "uncond"): "cfg"}
    cond, uncond, other = ("g", "cond"), ("g", "uncond"), ("h", "main")
    prompts = {cond: _prompt(9, seed=8), uncond: _prompt(5, seed=9), other: _prompt(4, seed=10)}
    run = ManagedRunner(paged, page_size=3)
    plans = run.step(
        {other: prompts[other], uncond: prompts[uncond], cond: prompts[cond]}, combined_labels=cfg
    )
    assert list(plans) == ["cfg", "main"] and plans["cfg"].rows == [cond, uncond]
    for _ in range(3):
        run.decode([uncond, other, cond], combined_labels=cfg)
    for stream, prompt in prompts.items():
        _check_stream(reference, run, stream, len(prompt))
