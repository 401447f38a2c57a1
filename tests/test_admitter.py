"""The engine's admission (``mstar.engine.admitter``) counts into whatever
``engine.stats`` is at the time: ``compiled_or_why`` swaps it out and back."""

import copy

import pytest

pytest.importorskip("transformers")

from mstar.engine import Engine, EngineStats, SamplingParams
from mstar.models.seeded import build_model


def test_counts_go_to_the_stats_the_engine_holds_now():
    _, twin = build_model(seed=0)
    eng = Engine(copy.deepcopy(twin), num_pages=6, page_size=8, token_budget=64)
    first = eng.stats
    eng.stats = EngineStats()  # as compiled_or_why restores its copy
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    done = eng.generate([[i + 1] * 14 for i in range(3)], params)  # 3 x 3 pages at the peak
    assert [len(c.outputs[0].token_ids) for c in done] == [10] * 3
    assert eng.stats.preemptions > 0 and eng.stats.refused > 0 and eng.stats.plan_s > 0
    assert (first.preemptions, first.refused, first.plan_s) == (0, 0, 0.0)


def _prefill(prompts, prefix_cache, logprobs=None, engine=None):
    """The completions' tokens and the prefill tokens computed for
    ``prompts`` all submitted at once (on ``engine``, else a new one)."""
    if engine is None:
        _, twin = build_model(seed=0)
        engine = Engine(
            twin, num_pages=64, page_size=8, token_budget=256, prefix_cache=prefix_cache
        )
    before = engine.stats.prefill_tokens
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=logprobs)
    done = engine.generate(prompts, params)
    return [c.outputs[0].token_ids for c in done], engine.stats.prefill_tokens - before, engine


SHARED = [(7 * i) % 250 + 1 for i in range(20)]  # a system prompt: 2.5 pages of 8


def test_requests_arriving_together_compute_a_shared_prefix_once():
    """Five prompts at once, one prefix of 20 tokens (two full pages of 8
    and 4 tokens of a third) and one a duplicate: the first computes its 25;
    the others wait a step for its pages and compute only what follows the
    20 (5 tokens: the third page's first 4 copied; the duplicate its last
    token alone, a one-token row). Same tokens as without the cache."""
    prompts = [SHARED + [200 + i] * 5 for i in range(4)] + [SHARED + [200] * 5]
    want, computed, _ = _prefill(prompts, prefix_cache=False)
    assert computed == 5 * 25
    got, computed, _ = _prefill(prompts, prefix_cache=True)
    assert got == want
    assert computed == 25 + 3 * 5


def test_a_stream_holding_a_matched_prefix_waits_for_the_next_shared_page():
    """The first page is cached from before; two prompts arriving together
    share the next one too: the second takes the first page, waits for the
    first prompt's second page and takes it as well (and the 4 shared
    tokens of its third, copied)."""
    _, _, engine = _prefill([SHARED[:8] + [3] * 9], prefix_cache=True)
    prompts = [SHARED + [200 + i] * 5 for i in range(2)]
    got, computed, _ = _prefill(prompts, prefix_cache=True, engine=engine)
    assert computed == (25 - 8) + 5
    assert got == _prefill(prompts, prefix_cache=False)[0]


def test_a_stream_holding_a_copied_partial_page_waits_for_that_page():
    """A tail of 12 tokens is cached from before (one page of 8 and 4 on
    the next): both prompts arriving together take it, at 12 tokens; the
    second shares the first's next 4 alone (to the page boundary, not 8
    past its start), waits for that page and computes only what follows."""
    _, _, engine = _prefill([SHARED[:12]], prefix_cache=True)
    prompts = [SHARED + [200] * 5, SHARED[:16] + [201] * 9]
    got, computed, _ = _prefill(prompts, prefix_cache=True, engine=engine)
    assert computed == (25 - 12) + (25 - 16)
    assert got == _prefill(prompts, prefix_cache=False)[0]


def test_prompt_logprobs_are_computed_whole_not_waited_for():
    prompts = [SHARED + [200 + i] * 5 for i in range(3)]
    _, computed, _ = _prefill(prompts, prefix_cache=True, logprobs=1)
    assert computed == 3 * 25


class _FetchOnce:
    """KV tiers whose first ``load`` starts a fetch that is done at once."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, str]] = []

    def load(self, stream, tokens, namespace="") -> bool:
        self.loads.append(stream)
        return len(self.loads) > 1  # False: in flight (installed on the next call)

    def busy(self, request_id: str) -> bool:
        return False

    def wait(self, seconds: float) -> None:
        pass

    def cancel(self, request_id: str) -> None:
        pass


def test_a_stream_whose_fetch_is_done_is_asked_again_in_the_same_step():
    """The tiers install fetched pages on the next ``load``: a stream whose
    fetch ended before the step was built asks again before it is matched."""
    _, twin = build_model(seed=0)
    engine = Engine(twin, num_pages=64, page_size=8, token_budget=256, prefix_cache=True)
    engine.admitter.tiers = tiers = _FetchOnce()
    done = engine.generate([SHARED + [200] * 5], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert len(done[0].outputs[0].token_ids) == 2
    assert len(tiers.loads) == 2 and engine.stats.steps == 2
