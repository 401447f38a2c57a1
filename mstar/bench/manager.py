"""Serving steps through ``KVManager`` (admit + plan + commit) against the
straightforward manager: Python-list page tables, every view a list slice,
the indices by list extends and ``torch.tensor``.

- ``decode step``: every row decodes one token; rows are staggered so every
  step some start a page. The floor is one ``np.copyto`` of the step's
  ``paged_kv_indices`` into a preallocated array: the least any plan built
  on the host spends. A step and a copy are timed in turns, one each a round
  (``turns_us``), so both meet the caches alike.
- ``churn step`` / ``mixed step``: the steps continuous batching really runs.
  Churn: each step 2 rows leave and 2 new requests join (their prefill
  untimed). Mixed: the decode rows plus one new 512-token prefill row. Timed
  warm, and cold: with the data caches evicted before each step (a 48 MiB
  write, one byte per 64), as after a model forward. The note compares each
  with the steady decode step of the same run.
- ``churn anywhere``: the step continuous batching runs most: rows leave
  from anywhere in the batch (``batch // 32`` a step, at random: answers
  ending after ~32 tokens on average) and as many newcomers join with a
  64-token prompt, prefilled in the same step as the decode rows. Their
  releases are untimed (the engine's previous step frees them). Timed in
  turns with the steady decode step of the same batch, at B=32 and B=256,
  warm and cold; the note compares the two.
- ``prefix cache``: the steady decode step with the prefix cache on against
  it off, in turns, a fresh step each time as the engine makes it: segments
  without tokens, the new tokens one array on the step (``KVStep.tokens``);
  on also with each segment carrying its token (the older way). Medians, and
  the median of means over runs of ``PAGE_SIZE`` steps (the decode steps'
  recording is done that many at a time; a run's mean spreads it, the
  median keeps out load spikes); ``match_prefix`` of a 4k-token prompt whose
  first 3.5k tokens are cached, against a hashlib digest and a dict lookup
  per page.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from mstar.bench import Row, time_us, turns_us
from mstar.bench.plan import baseline_build
from mstar.bench.prefix import baseline_match
from mstar.engine.resources.kv.manager import KVManager
from mstar.engine.resources.kv.plan import SequenceView
from mstar.engine.resources.step import KVStep, Segment

PAGE_SIZE = 16
MAX_STEPS = 4096  # decode steps timed per configuration, at most
HEADROOM_PAGES = MAX_STEPS // PAGE_SIZE + 2  # per row, for those steps
PREFILL = 512  # the mixed step's prefill chunk
JOIN = 64  # a newcomer's prompt in the churn-anywhere step
STEPS = 200  # churn/mixed steps timed one by one


class ListManager:
    """The baseline: one step at a time, the obvious way."""

    def __init__(self, num_pages: int, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self.free = list(range(num_pages))
        self.stored: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}

    def step(self, rows: list[tuple[str, int]]):
        ps = self.page_size
        for r, span in rows:  # admit: the pages each row's tokens need
            table = self.tables.setdefault(r, [])
            self.stored.setdefault(r, 0)
            while self.stored[r] + span > len(table) * ps:
                table.append(self.free.pop())
        views = []
        for r, span in rows:  # plan
            length = self.stored[r] + span
            views.append(SequenceView(r, "main", self.tables[r][: -(-length // ps)], length, span))
        out = baseline_build(views, ps)
        for r, span in rows:  # commit
            self.stored[r] += span
        return out

    def release(self, r: str) -> None:
        self.free.extend(self.tables.pop(r))
        del self.stored[r]


def _step(mgr: KVManager, segments: tuple[Segment, ...]):
    return _run(mgr, KVStep(segments))


def _run(mgr: KVManager, step: KVStep):
    mgr.admit(step)
    plans = mgr.plan(step)
    mgr.commit(step)
    return plans


def _prefilled(batch: int, context: int, spare: int = 0) -> tuple[KVManager, ListManager, list]:
    """Both managers with row ``i`` prefilled to ``context + i % page_size``."""
    per_row = -(-context // PAGE_SIZE) + HEADROOM_PAGES
    pages = batch * per_row + spare
    mgr, base = KVManager(num_pages=pages, page_size=PAGE_SIZE), ListManager(pages)
    rows = [(f"r{i}", context + i % PAGE_SIZE) for i in range(batch)]
    _step(mgr, tuple(Segment(r, "main", n) for r, n in rows))
    base.step(rows)
    return mgr, base, [r for r, _ in rows]


def _decode_rows(batch: int, context: int) -> Row:
    mgr, base, names = _prefilled(batch, context)
    segments = tuple(Segment(r, "main", 1) for r in names)
    ours_plan, base_plan = _step(mgr, segments)["main"], base.step([(r, 1) for r in names])
    assert len(ours_plan.cpu_indptrs.paged_kv_indices) == len(base_plan.paged_kv_indices)
    indices = ours_plan.cpu_indptrs.paged_kv_indices.numpy()
    target = np.empty_like(indices)
    # a step, then a copy of its indices, one call each a round (so both meet
    # the caches alike); the baseline on its own (it is 20-200x slower)
    ours, floor = turns_us(
        [lambda: _step(mgr, segments), lambda: np.copyto(target, indices)],
        rounds=201,
        target_s=0.0,
    )
    return Row(
        "decode step",
        f"batch={batch} context={context}",
        ours,
        time_us(lambda: base.step([(r, 1) for r in names]), max_calls=MAX_STEPS // 2),
        floor,
        params={"batch": batch, "context": context},
    )


class _Evictor:
    """Evicts the data caches: a 48 MiB write, one byte per 64 (a cache line)."""

    def __init__(self) -> None:
        self.buffer = np.zeros(48 << 20, dtype=np.uint8)
        self.tick = 0

    def __call__(self) -> None:
        self.tick += 1
        self.buffer[::64] = self.tick & 0xFF


def _median_us(step, steps: int, evict: _Evictor | None) -> float:
    """Median µs of ``step()``, each timed alone (after ``evict()``, if given)."""
    return _medians_us({"": step}, steps, evict)[""]


def _steady(mgr, names: list[str], baseline: bool):
    """Step ``i`` of steady decode: every row decodes one token."""
    if baseline:
        rows = [(r, 1) for r in names]
        return lambda i: lambda: mgr.step(rows)
    segments = tuple(Segment(r, "main", 1) for r in names)
    return lambda i: lambda: _step(mgr, segments)


def _churn(mgr, names: list[str], tag: str, join_len: int, baseline: bool):
    """Step ``i`` of churn: 2 rows leave, 2 join (prefilled untimed), then a
    decode step over the batch (returned, to be timed)."""

    def prepare(i: int):
        for r in names[:2]:
            mgr.release(r)
        del names[:2]
        joined = [(f"{tag}{i}.{j}", join_len) for j in range(2)]
        if baseline:
            mgr.step(joined)
        else:
            _step(mgr, tuple(Segment(r, "main", n) for r, n in joined))
        names.extend(r for r, _ in joined)
        if baseline:
            rows = [(r, 1) for r in names]
            return lambda: mgr.step(rows)
        segments = tuple(Segment(r, "main", 1) for r in names)
        return lambda: _step(mgr, segments)

    return prepare


def _mixed(mgr, names: list[str], tag: str, baseline: bool):
    """Step ``i`` of mixed: the batch decodes beside a new 512-token prefill
    row (released before the next step, untimed)."""
    last: list[str] = []

    def prepare(i: int):
        for r in last:
            mgr.release(r)
        last[:] = [f"{tag}{i}"]
        if baseline:
            rows = [(r, 1) for r in names] + [(last[0], PREFILL)]
            return lambda: mgr.step(rows)
        segments = (*(Segment(r, "main", 1) for r in names), Segment(last[0], "main", PREFILL))
        return lambda: _step(mgr, segments)

    return prepare


def _churn_anywhere(mgr, names: list[str], tag: str, baseline: bool):
    """Step ``i`` of churn anywhere: ``len(names) // 32`` rows at random
    places leave (untimed), then the decode rows and as many newcomers'
    64-token prefill rows in one step (returned, to be timed)."""
    rng = np.random.default_rng(0)  # the same rows leave on both sides
    leave = max(1, len(names) // 32)

    def prepare(i: int):
        for j in sorted(rng.choice(len(names), leave, replace=False).tolist(), reverse=True):
            mgr.release(names.pop(j))
        joined = [f"{tag}{i}.{j}" for j in range(leave)]
        if baseline:
            rows = [(r, 1) for r in names] + [(r, JOIN) for r in joined]
            names.extend(joined)
            return lambda: mgr.step(rows)
        segments = (
            *(Segment(r, "main", 1) for r in names),
            *(Segment(r, "main", JOIN) for r in joined),
        )
        names.extend(joined)
        return lambda: _step(mgr, segments)

    return prepare


def _medians_us(steps_by_kind: dict, steps: int, evict: _Evictor | None) -> dict[str, float]:
    """``_median_us`` of several kinds of step, taken in turns (see ``_times_us``)."""
    return {kind: float(np.median(t)) for kind, t in _times_us(steps_by_kind, steps, evict).items()}


def _times_us(steps_by_kind: dict, steps: int, evict: _Evictor | None) -> dict[str, np.ndarray]:
    """µs of each step of several kinds, taken in turns (one step of each
    kind, then the next), so a machine's drift moves them alike."""
    times: dict[str, list[float]] = {kind: [] for kind in steps_by_kind}
    for i in range(steps):
        for kind, step in steps_by_kind.items():
            prepare = step(i)
            if evict is not None:
                evict()
            t0 = time.perf_counter()
            prepare()
            times[kind].append(time.perf_counter() - t0)
    return {kind: np.array(t) * 1e6 for kind, t in times.items()}


def _rows_in_turns(batch: int, context: int, spare: int, makers: dict, steps: int) -> list[Row]:
    """Rows for kinds of step (``makers``: kind -> ``make(manager, names,
    baseline)`` giving step ``i``'s preparation; the first kind is the
    steady step), warm and cold, ours against the list baseline, the kinds
    timed in turns; notes compare each with the steady step."""
    evict = _Evictor()
    out = []
    for temp, ev in (("warm", None), ("cold", evict)):
        figures: dict[str, list[float]] = {}
        for baseline in (False, True):
            kinds = {}
            for kind, make in makers.items():
                mgr, base, names = _prefilled(batch, context, spare)
                kinds[kind] = make(base if baseline else mgr, list(names), baseline)
            for kind, us in _medians_us(kinds, steps, ev).items():
                figures.setdefault(kind, []).append(us)
        first = next(iter(makers))
        for kind, (ours, theirs) in figures.items():
            out.append(
                Row(
                    f"{kind} step",
                    f"{batch}x{context} {temp}",
                    ours,
                    theirs,
                    params={"batch": batch, "context": context, "cold": int(ev is not None)},
                    note="" if kind == first else f"{ours / figures[first][0]:.2f}x steady",
                )
            )
    return out


def serving_rows(batch: int = 256, context: int = 4096, steps: int = STEPS) -> list[Row]:
    """Steady, churn and mixed steps at ``batch`` x ``context``, warm and cold,
    ours against the list baseline; the three kinds are timed in turns, and
    notes compare churn and mixed with the steady step."""
    spare = steps * 2 * (-(-context // PAGE_SIZE)) + -(-PREFILL // PAGE_SIZE) + 1
    makers = {
        "steady": _steady,
        "churn": lambda m, names, baseline: _churn(m, names, "j", context, baseline),
        "mixed": lambda m, names, baseline: _mixed(m, names, "m", baseline),
    }
    return _rows_in_turns(batch, context, spare, makers, steps)


def churn_anywhere_rows(
    batches: tuple[int, ...] = (32, 256), context: int = 4096, steps: int = STEPS
) -> list[Row]:
    """The churn-anywhere step against the steady decode step of the same
    batch, in turns, warm and cold, ours and the list baseline."""
    makers = {
        "steady": _steady,
        "churn anywhere": lambda m, names, baseline: _churn_anywhere(m, names, "n", baseline),
    }
    out = []
    for batch in batches:
        spare = steps * max(1, batch // 32) * (-(-JOIN // PAGE_SIZE) + 1)
        out += _rows_in_turns(batch, context, spare, makers, steps)
    return out


def _prefix_decode(mgr: KVManager, names: list[str], kind: str):
    """Step ``i`` of decode, fresh as a scheduler makes it: the tokens on the
    step (``step tokens``), on each segment (``segment tokens``) or none (``off``)."""

    def prepare(i: int):
        if kind == "step tokens":
            step = KVStep(
                tuple(Segment(r, "main", 1) for r in names), tokens=np.full(len(names), i)
            )
        else:
            tokens = [i] if kind == "segment tokens" else None
            step = KVStep(tuple(Segment(r, "main", 1, tokens) for r in names))
        return lambda: _run(mgr, step)

    return prepare


def prefix_rows(batch: int = 256, context: int = 4096, steps: int = STEPS) -> list[Row]:
    """The prefix cache's cost on a decode step, and ``match_prefix``."""
    per_row = -(-context // PAGE_SIZE) + HEADROOM_PAGES
    kinds = {}
    for kind in ("step tokens", "segment tokens", "off"):
        mgr = KVManager(num_pages=batch * per_row, page_size=PAGE_SIZE, prefix_cache=kind != "off")
        rng = np.random.default_rng(0)
        rows = [(f"r{i}", rng.integers(0, 50_000, context + i % PAGE_SIZE)) for i in range(batch)]
        _step(mgr, tuple(Segment(r, "main", len(t), t) for r, t in rows))
        kinds[kind] = _prefix_decode(mgr, [r for r, _ in rows], kind)
    out = []
    times = _times_us(kinds, steps - steps % PAGE_SIZE, None)  # on and off in turns
    stats = {  # decode steps are recorded PAGE_SIZE at a time: their mean spreads it
        "median": np.median,
        f"mean of {PAGE_SIZE}": lambda t: np.median(t.reshape(-1, PAGE_SIZE).mean(axis=1)),
    }
    for name, stat in stats.items():
        off = float(stat(times["off"]))
        for kind in ("step tokens", "segment tokens"):
            us = float(stat(times[kind]))
            out.append(
                Row(
                    "prefix cache",
                    f"decode {batch}x{context}, {kind}: on vs off, {name}",
                    us,
                    off,
                    params={"batch": batch, "context": context, "mean": int(name != "median")},
                    note=f"{us / off:.2f}x off",
                )
            )
    length, cached = 4096, 3504
    tokens = np.random.default_rng(1).integers(0, 50_000, length)
    mgr = KVManager(num_pages=2 * length // PAGE_SIZE, page_size=PAGE_SIZE, prefix_cache=True)
    _step(mgr, (Segment("warm", "main", cached, tokens[:cached]),))
    mgr.release("warm")
    by_key, key = {}, b""  # the baseline's cache of the same pages
    for i in range(cached // PAGE_SIZE):
        chunk = tokens[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
        key = hashlib.blake2b(key + chunk.tobytes(), digest_size=16).digest()
        by_key[key] = i

    def match(i):
        if i:
            mgr.release(f"q{i - 1}")
        return lambda: mgr.match_prefix(f"q{i}", "main", tokens)

    assert len(baseline_match(tokens[:-1], PAGE_SIZE, by_key)) == cached // PAGE_SIZE
    ours = _median_us(match, steps, None)
    assert mgr.stored_len(f"q{steps - 1}", "main") == cached // PAGE_SIZE * PAGE_SIZE
    out.append(
        Row(
            "prefix cache",
            f"match_prefix {length} tokens, {cached} cached",
            ours,
            time_us(lambda: baseline_match(tokens[:-1], PAGE_SIZE, by_key)),
            params={"tokens": length, "cached": cached},
        )
    )
    return out


def run(batches=(1, 32, 256), contexts=(1024, 4096, 32768)) -> list[Row]:
    rows = [_decode_rows(b, c) for b in batches for c in contexts]
    big, context = max(batches), 4096 if 4096 in contexts else max(contexts)
    return (
        rows
        + serving_rows(big, context)
        + churn_anywhere_rows(tuple(b for b in batches if b >= 32), context)
        + prefix_rows(big, context)
    )
