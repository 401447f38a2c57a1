"""Speculative decoding: n-gram drafts, verified in one step.

Before a step, each decoding stream may get a draft: the tokens that followed
the latest earlier occurrence of its longest suffix (``min_n`` to ``max_n``
tokens) in its own prompt and output (prompt lookup). The draft rides in the
stream's row (a verify row: ``to_compute = 1 + len(draft)``, through the same
plan and forward), with logits at every one of its positions.

Verification goes position by position through the engine's own token choice
(``Engine.pipeline.rows``' penalties and grammar masks, then
``Emitter.on_logits``: the sampler, its generator, the stops): the
token chosen at a position is emitted; when it equals the draft's token there
the next position's logits hold (they saw exactly the emitted tokens), else
the row ends. For a deterministic draft this is rejection sampling: the draft
token ``x`` is accepted with probability ``p(x)``, and a rejection's token is
drawn from ``p`` without ``x``, renormalised, so outputs keep the model's
distribution (and greedy keeps its argmax, token for token). Each emitted
token draws once from the sample's generator, as one-token decoding does, so
a seeded sample draws the same numbers. Stops (EOS, stop ids, stop strings,
``max_new_tokens``) end the row where one-token decoding would end it.

The KV manager then commits each verify row's last token and accepted draft
tokens only (``KVManager.commit(step, kept)``): rejected tokens never reach
the prefix cache, a window releases by the accepted length.

Drafting adapts: a stream whose drafts are rarely accepted drafts less (and
then only now and then, to notice when copying starts), and a step with more
than ``max_batch`` decoding streams drafts nothing (a big batch's forward is
bound by arithmetic, so extra query tokens cost what they would save).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mstar.engine.request import GUIDED, Request
from mstar.engine.resources.step import KVStep

if TYPE_CHECKING:
    import torch

METHODS = ("ngram",)


def ngram_draft(history: np.ndarray, k: int, min_n: int = 2, max_n: int = 4) -> np.ndarray:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest
    suffix of ``history`` of ``min_n`` to ``max_n`` tokens (the latest one
    followed by ``k`` tokens, else the latest; empty when none occurs).
    Vectorized: one pass over the history for the last token, then one array
    step per suffix length over the candidates."""
    last = len(history) - 1
    if last < min_n or k < 1:
        return history[:0]
    ends = np.flatnonzero(history[:last] == history[last])  # suffix matches of length 1
    found = ends if min_n <= 1 else ends[:0]
    for m in range(1, min(max_n, last + 1)):  # extend the matches to length m + 1
        ends = ends[ends >= m]
        ends = ends[history[ends - m] == history[last - m]]
        if not len(ends):
            break
        if m + 1 >= min_n:
            found = ends
    if not len(found):
        return history[:0]
    whole = found[found <= last - k]
    best = int(whole[-1] if len(whole) else found[-1])
    return history[best + 1 : best + 1 + k]


@dataclass
class Speculator:
    """Drafts for an engine's decoding streams, their verification, and the
    tokens each verify row keeps. ``k``: most draft tokens a row."""

    k: int
    min_n: int = 2
    max_n: int = 4
    max_batch: int = 8
    adaptive: bool = True  # False: always ``k`` (tests)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    rows: int = 0  # verify rows
    _rate: dict[tuple[str, str], float] = field(default_factory=dict)  # acceptance, averaged
    _idle: dict[tuple[str, str], int] = field(default_factory=dict)  # steps since drafting
    _drafted: list[Request] = field(default_factory=list)
    _kept: dict[tuple[str, str], int] = field(default_factory=dict)

    def propose(self, requests: Iterable[Request], budget: int, stops: frozenset[int]) -> None:
        """Append a draft to each decoding stream that gets one (``req.draft``
        names it), keeping every decoding row within ``budget``."""
        rows = [
            (req, label, toks)
            for req in requests
            for label, toks in req.streams.items()
            if len(toks) - req.fed[label] == 1
        ]
        if not rows or len(rows) > self.max_batch:
            return
        room = budget - len(rows)
        for req, label, toks in rows:
            if room <= 0:
                break
            if label in GUIDED or not req.forked:
                continue
            sample = req.by_label[label]
            k = min(self._k(req.id, label), room)
            k = min(k, req.params.max_new_tokens - len(sample.token_ids) - 1)
            if k <= 0:
                continue
            draft = ngram_draft(np.array(toks), k, self.min_n, self.max_n).tolist()
            params = req.params
            for i, t in enumerate(draft):  # nothing after a stop token is ever emitted
                if t in params.stop_token_ids or (not params.ignore_eos and t in stops):
                    del draft[i + 1 :]
                    break
            if not draft:
                continue
            toks.extend(draft)
            req.draft[label] = draft
            self._drafted.append(req)
            self._idle[(req.id, label)] = 0
            room -= len(draft)

    def _k(self, request_id: str, label: str) -> int:
        """Draft tokens for the stream now: ``k`` while its drafts are taken,
        fewer as they are not, and none (but every 8th step) when they never are."""
        key = (request_id, label)
        rate = self._rate.get(key, 1.0)
        if rate >= 0.4 or not self.adaptive:
            return self.k
        if rate >= 0.15:
            return max(1, self.k // 2)
        idle = self._idle[key] = self._idle.get(key, 0) + 1
        return 1 if idle >= 8 else 0

    def verify(
        self, engine: Any, chosen: list[tuple[Request, str]], logits: torch.Tensor
    ) -> Iterator:
        """Emit the tokens of the verify rows among ``chosen`` (logits: one
        row per position of each, in order) through ``engine.emitter.on_logits``;
        yield ``((request, label), logits)`` of the other rows."""
        sizes = [1 + len(req.draft.get(label, ())) for req, label in chosen]
        if len(sizes) == len(logits):
            yield from zip(chosen, engine.pipeline.rows(logits, chosen))
            return
        for (req, label), block in zip(chosen, logits.split(sizes)):
            draft = req.draft.pop(label, None)
            if draft is None:
                yield (req, label), engine.pipeline.rows(block, [(req, label)])[0]
                continue
            toks = req.streams[label]
            del toks[-len(draft) :]
            req.fed[label] = fed = len(toks)
            sample, taken = req.by_label[label], 0
            for i, row in enumerate(block):  # each position's penalties and grammar mask
                row = engine.pipeline.rows(row[None], [(req, label)])[0]  # see the tokens before it
                engine.emitter.on_logits(req, label, row)
                if sample.finish_reason is not None or i == len(draft):
                    break
                if sample.token_ids[-1] != draft[i]:
                    break
                taken += 1
            if label in req.fed:
                req.fed[label] = fed + taken
            self._kept[(req.id, label)] = 1 + taken
            self.proposed += len(draft)
            self.rows += 1
            self.accepted += taken
            key = (req.id, label)
            self._rate[key] = 0.7 * self._rate.get(key, 1.0) + 0.3 * taken / len(draft)

    def kept(self, step: KVStep) -> list[int] | None:
        """The tokens each row of ``step`` keeps (None: all of every row)."""
        if not self._kept:
            return None
        kept, self._kept = self._kept, {}
        return [kept.get((s.request_id, s.label), s.span) for s in step.segments]

    def settle(self, stats: Any) -> None:
        """After a step: drafts of rows it did not verify come off their
        streams, ``stats`` gets the counts."""
        for req in self._drafted:
            for label, draft in req.draft.items():
                if label in req.streams:
                    del req.streams[label][-len(draft) :]
            req.draft.clear()
        self._drafted.clear()
        self._kept.clear()
        stats.spec_proposed, stats.spec_accepted = self.proposed, self.accepted
        if len(self._rate) > 1024:  # requests gone: learnt again if they are not
            self._rate.clear()
            self._idle.clear()


def speculator(method: Any, k: Any) -> Speculator | None:
    """The engine's ``Speculator`` for ``speculative=method`` (None: off) with
    ``num_speculative_tokens=k``; a bad option raises naming it."""
    if method is None:
        return None
    if method not in METHODS:
        raise ValueError(f"expected speculative None or one of {METHODS}, got {method!r}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"expected num_speculative_tokens an int, got {k!r}")
    if not 1 <= k <= 64:
        raise ValueError(f"expected num_speculative_tokens in [1, 64], got {k!r}")
    return Speculator(k)
