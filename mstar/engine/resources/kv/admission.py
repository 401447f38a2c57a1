"""Admission: a step checked, its rows resolved to streams, its pages counted.

``check`` validates a step (a typed error naming the row, before anything
changes), resolves each row to its stream's slot and counts the pages each
row takes beyond those its stream holds, with the pages its forks copy in the
same count; the manager reserves that many. Nothing here changes a stream.

A decode step's rows are mostly the last committed step's. ``remember`` keeps
that step's rows checked and resolved; a next step with the same rows (or
those rows after a few left ahead of them, with rows joining or leaving
behind) reuses them rather than checking and resolving each again. Reuse holds
while those rows' streams are the ones they were resolved to (their epochs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import compress, count
from operator import itemgetter, ne
from typing import Any

import numpy as np

from mstar.engine.resources.kv.errors import AllocationFailed, InvalidStep, UnknownStream
from mstar.engine.resources.kv.journal import Journal
from mstar.engine.resources.kv.lengths import INT32_MAX
from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.paths import LEFT_AHEAD, Paths
from mstar.engine.resources.kv.plan import group_by_plan_label
from mstar.engine.resources.kv.prefix import TokenError, step_tokens
from mstar.engine.resources.kv.streams import StreamTable
from mstar.engine.resources.step import KVStep, Segment

_KEY = itemgetter(0, 1)  # a segment's (request_id, label)


@dataclass(eq=False)
class ResolvedRows:
    """A step's rows, checked and resolved: once it commits, a next step
    with the same rows reuses them while every stream is the same (its
    epoch)."""

    segments: tuple[Segment, ...]
    columns: tuple[tuple, ...]  # the segments' fields: request ids, labels, spans, tokens
    keys: list[tuple[str, str]]
    spans: np.ndarray  # int32 [B]
    combined: dict[tuple[str, ...], str]
    slots: np.ndarray  # int64 [B]
    groups: dict[str, np.ndarray | None]
    epochs: np.ndarray | None = None  # int64 [B], from the step's commit
    made: int = -1  # the stream table's count of streams made and freed then

    @cached_property
    def requests(self) -> dict[str, None]:
        """The rows' request ids, in order (asked for only while steps overlap,
        and by forks)."""
        return dict.fromkeys(self.columns[0])


@dataclass(eq=False)
class Admitted:
    """An admitted step: its rows, what they take, and (from ``admit`` on)
    its journal. ``ends``, ``num_pages`` and ``grow`` are lists of ints when
    ``few`` (see ``Paths.few_rows``), else int64 arrays."""

    keys: list[tuple[str, str]]  # [B] (request_id, label), batch order
    columns: tuple[tuple, ...]  # the segments' fields (see ``ResolvedRows``)
    new: list[int]  # rows whose stream the step creates
    slots: np.ndarray  # int64 [B]; 0 for a stream the step creates (until applied)
    spans: np.ndarray  # int32 [B]
    forks: bool  # whether the step has pre- or post-forks
    few: bool
    ends: Any  # [B]: each stream's length with the span
    num_pages: Any  # [B]: pages holding ``ends`` tokens
    grow: Any  # [B]: pages each row takes
    groups: dict[str, np.ndarray | None]  # plan label -> rows (None: all, in order)
    resolved: ResolvedRows  # its rows: the last step's, reused, or its own
    tokens: Any = None  # with a prefix cache: the rows' tokens (see ``step_tokens``)
    need: int = 0  # pages to reserve
    journal: Journal | None = None  # its reserved pages and changes (set by ``admit``)
    planned: bool = False

    @property
    def requests(self) -> dict[str, None]:
        """The step's request ids, in order."""
        return self.resolved.requests


class Admission:
    """Checks steps against ``streams`` and the steps in flight
    (``admitted``, the manager's); keeps the last committed step's rows."""

    def __init__(
        self,
        streams: StreamTable,
        pool: PagePool,
        page_size: int,
        paths: Paths,
        admitted: dict[KVStep, Admitted],
    ) -> None:
        self.streams = streams
        self.pool = pool
        self.page_size = page_size
        self.paths = paths
        self.admitted = admitted
        self.last: ResolvedRows | None = None  # the last committed step's rows, for the next

    def check(self, step: KVStep) -> Admitted:
        """The admission record of a valid step, with the pages it needs
        (``need``), which fit; else ``InvalidStep``/``UnknownStream``,
        ``AllocationFailed`` or ``TypeError``."""
        rec = self.sized(step)
        free = self.pool.num_free
        if rec.need > free:
            i = int(np.searchsorted(np.cumsum(rec.grow), free, side="right"))
            raise AllocationFailed(rec.need - free, *rec.keys[min(i, len(rec.keys) - 1)])
        return rec

    def sized(self, step: KVStep) -> Admitted:
        """``check`` but for the free pages: the record of a valid step with
        the pages it needs (``need``, ``grow`` per row); changes nothing."""
        if not isinstance(step, KVStep):
            raise TypeError(f"expected a KVStep, got {type(step).__name__}")
        if step in self.admitted:
            raise InvalidStep(f"step already admitted ({describe(step)})", *first_row(step))
        rec = self._resolved(step)
        if rec.forks:
            rec.need = self._fork_pages(step, rec)
        else:
            rec.need = sum(rec.grow) if rec.few else int(np.add.reduce(rec.grow))
        return rec

    def in_flight(self, requests: dict[str, None]) -> bool:
        """Whether any of ``requests`` is in an admitted step."""
        return any(not rec.requests.keys().isdisjoint(requests) for rec in self.admitted.values())

    def remember(self, step: KVStep, rec: Admitted) -> None:
        """A step committed: the next may reuse its rows. A step of new
        streams only (newcomers' prefill) leaves the last rows, which come next."""
        newcomers = self.last is not None and len(rec.new) == len(rec.keys)
        if rec.forks or newcomers:
            return
        rows = rec.resolved  # held by no other step in flight
        rows.segments, rows.columns, rows.spans = step.segments, rec.columns, rec.spans
        if rows is not self.last or rows.slots is not rec.slots:  # (re)resolved
            rows.slots, rows.epochs = rec.slots, self.streams.epoch[rec.slots]
        rows.made, self.last = self.streams.made, rows

    def sizes(self, slots: np.ndarray, spans: np.ndarray, few: bool) -> tuple[Any, Any, Any]:
        """Each row's length with its span, the pages holding it, and the
        pages it takes beyond those its stream holds: lists of ints for
        ``few`` rows (numpy calls cost more than the arithmetic there), else
        int64 arrays."""
        streams, ps = self.streams, self.page_size
        if few:
            stored, npages, slot_list = streams.stored, streams.npages, slots.tolist()
            ends = [stored.item(s) + n for s, n in zip(slot_list, spans.tolist())]
            num_pages = [-(-end // ps) for end in ends]
            grow = [max(n - npages.item(s), 0) for s, n in zip(slot_list, num_pages)]
            return ends, num_pages, grow
        ends = streams.stored[slots] + spans
        num_pages = ends + (ps - 1)
        num_pages //= ps
        grow = num_pages - streams.npages[slots]
        np.maximum(grow, 0, out=grow)
        return ends, num_pages, grow

    # --- rows -------------------------------------------------------------------------

    def _resolved(self, step: KVStep) -> Admitted:
        """The step's rows, validated and resolved; changes nothing."""
        segs = step.segments
        rows = self.last
        forks = _has_forks(step)
        reuse = (
            rows is not None
            and not self.admitted  # another step in flight: the checked path
            and not forks
            and step.combined_labels == rows.combined
        )
        if reuse and _equal_rows(segs, rows.segments) and self._same_streams(rows):
            # The last committed step's rows (a decode step): checked, resolved
            # and grouped then. Its slots are shared, never written in place.
            return self._sized(step, forks, rows, rows.columns, [], rows.slots, rows.spans)
        if segs and set(map(type, segs)) != {Segment}:
            bad = next(s for s in segs if type(s) is not Segment)
            raise TypeError(f"expected Segment rows, got {type(bad).__name__} {bad!r}")
        columns = tuple(zip(*segs)) or ((), (), (), ())  # one pass: ids, labels, spans, tokens
        request_ids, labels, span_values = columns[:3]
        if (
            reuse
            and request_ids == rows.columns[0]
            and labels == rows.columns[1]
            and self._same_streams(rows)
        ):  # the same streams with other spans or tokens
            spans = rows.spans if span_values == rows.columns[2] else _spans(span_values, rows.keys)
            return self._sized(step, forks, rows, columns, [], rows.slots, spans)
        old, k, pick = self._shared_rows(rows, request_ids, labels) if reuse else (None, 0, None)
        keys = list(zip(request_ids[k:], labels[k:]))
        if k:  # the last step's rows again (rows left among them, joined or left after)
            keys[:0] = pick(rows.keys)
            kept = rows.slots[old]
            slots = np.concatenate((kept, self.streams.resolve(keys[k:])))
            if span_values[:k] == pick(rows.columns[2]):
                spans = np.concatenate((rows.spans[old], _spans(span_values[k:], keys[k:])))
            else:
                spans = _spans(span_values, keys)
        else:
            kept = slots = self.streams.resolve(keys)
            spans = _spans(span_values, keys)
        rest = slots[k:]
        known = rest[rest != 0]  # the streams not reused that exist: mostly none
        new = (rest == 0).nonzero()[0]
        new = (new + k).tolist() if k else new.tolist()
        for i in new:  # a known stream's key was checked when it was made
            check_key(*keys[i])
        distinct = set(known.tolist())  # the rows not reused are each one stream:
        if (
            len(distinct) < len(known)
            or (k and distinct and not distinct.isdisjoint(kept.tolist()))
            or (len(new) > 1 and len({keys[i] for i in new}) < len(new))
        ):
            key = _first_repeat(keys)
            raise InvalidStep(
                f"expected one segment per stream, got two for request {key[0]!r},"
                f" label {key[1]!r}",
                *key,
            )
        if self.admitted and self.in_flight(dict.fromkeys(request_ids)):
            key = next(k for k in keys if self.in_flight({k[0]: None}))
            raise InvalidStep(
                f"request {key[0]!r} (label {key[1]!r}) is already in an admitted step", *key
            )
        _check_forks(step)
        groups = self._groups(step, keys, labels)
        combined = step.combined_labels
        rows = ResolvedRows(step.segments, columns, keys, spans, combined, slots, groups)
        return self._sized(step, forks, rows, columns, new, slots, spans)

    def _shared_rows(
        self, rows: ResolvedRows, request_ids: tuple, labels: tuple
    ) -> tuple[slice | np.ndarray | None, int, Any]:
        """``(old, k, pick)``: this step's first ``k`` rows are the last
        step's rows ``old`` (a slice, or row numbers), in order, on the same
        streams; ``pick`` takes those rows of a column of the last step's (a
        tuple or list). Mostly they are every row of the last step whose
        stream is still there (rows left from anywhere, others joined after):
        one comparison a column, the ids mostly the very same objects. Else
        runs of them, up to ``LEFT_AHEAD`` rows left before each, compared a
        run at a time."""
        old_ids, old_labels = rows.columns[0], rows.columns[1]
        if rows.made == self.streams.made:  # no stream made or freed since: all the same
            old: slice | np.ndarray = slice(0, len(old_ids))
        else:  # the rows whose streams are still the ones resolved (those left are not)
            old = (self.streams.epoch[rows.slots] == rows.epochs).nonzero()[0]
            if len(old) and old[-1] - old[0] == len(old) - 1:  # one run: a slice is cheaper
                old = slice(int(old[0]), int(old[-1]) + 1)
        k, pick = _picker(old)
        if (
            0 < k <= len(request_ids)
            and (  # the common case: every one still there, in order
                request_ids[:k] == pick(old_ids) and labels[:k] == pick(old_labels)
            )
        ):
            return old, k, pick
        runs: list[tuple[int, int]] = []  # (first old row, rows)
        k, d = 0, 0
        while k < len(request_ids):
            try:  # a few rows ahead of the run may have left
                d = old_ids.index(request_ids[k], d, d + LEFT_AHEAD + 1)
            except ValueError:
                break
            n = _common(request_ids, k, old_ids, d)
            if labels[k : k + n] != old_labels[d : d + n]:  # mostly equal: one C-level pass
                n = _common(labels[: k + n], k, old_labels, d)
            if not n:
                break
            runs.append((d, n))
            k, d = k + n, d + n
        if not runs:
            return None, 0, None
        if len(runs) == 1:
            old = slice(runs[0][0], runs[0][0] + k)
        else:
            mask = np.zeros(d, bool)
            for first, n in runs:
                mask[first : first + n] = True
            old = mask.nonzero()[0]
        if (
            rows.made != self.streams.made
            and not (self.streams.epoch[rows.slots[old]] == rows.epochs[old]).all()
        ):
            return None, 0, None
        return old, k, _picker(old)[1]

    def _same_streams(self, rows: ResolvedRows) -> bool:
        """Whether the rows' streams are those they were resolved to."""
        if rows.made == self.streams.made:  # no stream made or freed since
            return True
        return bool((self.streams.epoch[rows.slots] == rows.epochs).all())

    def _sized(self, step, forks: bool, rows: ResolvedRows, columns, new, slots, spans) -> Admitted:
        """The admission record once the rows are resolved (``rows``: the last
        step's, or this one's): lengths checked, page needs, tokens."""
        keys = rows.keys
        few = len(slots) <= self.paths.few_rows
        ends, num_pages, grow = self.sizes(slots, spans, few)
        if (max(ends, default=0) if few else np.maximum.reduce(ends)) > INT32_MAX:
            i = int(np.argmax(ends))
            raise InvalidStep(
                f"expected a stream length < 2**31, got {int(ends[i]) - int(spans[i])} + span"
                f" {int(spans[i])} for request {keys[i][0]!r}, label {keys[i][1]!r}",
                *keys[i],
            )
        tokens = None
        if self.streams.prefix is not None and step.commit:
            try:
                tokens = step_tokens(step.tokens, columns[3], spans, keys)
            except TokenError as err:
                raise InvalidStep(str(err)) from err
        return Admitted(
            keys, columns, new, slots, spans, forks, few, ends, num_pages, grow,
            rows.groups, rows, tokens,
        )  # fmt: skip

    def _groups(
        self, step: KVStep, keys: list[tuple[str, str]], labels: tuple[str, ...]
    ) -> dict[str, np.ndarray | None]:
        """Plan label -> the rows it packs (``group_by_plan_label``'s order)."""
        if not step.combined_labels and (not labels or labels.count(labels[0]) == len(labels)):
            return dict.fromkeys(labels[:1])  # one standalone label: every row, in order
        if not isinstance(step.combined_labels, dict):
            raise TypeError(
                f"expected combined_labels a dict, got {type(step.combined_labels).__name__}"
            )
        try:
            groups = group_by_plan_label(step.segments, step.combined_labels)
        except (KeyError, ValueError, TypeError) as err:
            raise InvalidStep(f"bad combined_labels: {err}", *first_row(step)) from err
        row = {key: i for i, key in enumerate(keys)}
        return {
            label: np.fromiter((row[_KEY(s)] for s in segs), np.int64, len(segs))
            for label, segs in groups.items()
        }

    # --- forks' pages -----------------------------------------------------------------

    def _fork_pages(self, step: KVStep, rec: Admitted) -> int:
        """Pages a step with forks takes, simulated per request on (stored,
        pages) pairs. Sets ``rec.grow`` to each row's share, in the order
        pages would run out."""
        ps = self.page_size
        rows: dict[str, list[int]] = {}
        for i, key in enumerate(rec.keys):
            rows.setdefault(key[0], []).append(i)
        grow = np.zeros(len(rec.keys), dtype=np.int64)
        for request_id, idx in rows.items():
            sim = {
                label: (int(self.streams.stored[slot]), int(self.streams.npages[slot]))
                for label, slot in self.streams.labels(request_id).items()
            }
            forks = 0

            def fork(src: str, dst: str, when: str, rid: str = request_id, s: dict = sim) -> int:
                if src not in s:
                    raise UnknownStream(
                        f"{when} {src!r} -> {dst!r}: request {rid!r} has no stream {src!r}",
                        rid,
                        src,
                    )
                stored = s[src][0]
                s[dst] = (stored, -(-stored // ps))
                return int(stored % ps != 0)  # a partial last page is copied

            for src, dst in step.pre_forks:
                forks += fork(src, dst, "pre-fork")
            for i in idx:
                stored, pages = sim.get(rec.keys[i][1], (0, 0))
                span = int(rec.spans[i])
                want = -(-(stored + span) // ps)
                sim[rec.keys[i][1]] = (stored + span * step.commit, max(pages, want))
                grow[i] = max(want - pages, 0)
            for src, dst in step.post_forks:
                forks += fork(src, dst, "post-fork")
            grow[idx[0]] += forks
        rec.grow = grow
        return int(grow.sum())


def _has_forks(step: KVStep) -> bool:
    return bool(step.pre_forks or step.post_forks)


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_key(request_id: Any, label: Any) -> None:
    if not isinstance(request_id, str) or not isinstance(label, str):
        raise TypeError(f"expected request_id and label to be str, got {request_id!r}, {label!r}")


def first_row(step: KVStep) -> tuple[str | None, str | None]:
    return (step.segments[0].request_id, step.segments[0].label) if step.segments else (None, None)


def describe(step: KVStep) -> str:
    rows = ", ".join(f"{s.request_id!r}/{s.label!r}" for s in step.segments[:3])
    more = f" and {len(step.segments) - 3} more" if len(step.segments) > 3 else ""
    return f"rows {rows}{more}" if rows else "no rows"


def _spans(values: list, keys: list[tuple[str, str]]) -> np.ndarray:
    """The spans as int32, each an integer in [0, 2**31); else a typed error
    naming the row."""
    if not values:
        return np.zeros(0, np.int32)
    if set(map(type, values)) == {int}:
        try:
            spans = np.array(values, dtype=np.int32)  # a Python int out of range raises
        except OverflowError:
            spans = None
        if spans is not None and np.minimum.reduce(spans) >= 0:
            return spans
    for value, (request_id, label) in zip(values, keys):  # the slow path names the row
        where = f"for request {request_id!r}, label {label!r}"
        if not is_int(value):
            raise TypeError(f"expected span an int, got {value!r} ({type(value).__name__}) {where}")
        if not 0 <= value <= INT32_MAX:
            raise InvalidStep(
                f"expected span >= 0 and < 2**31, got {value} {where}", request_id, label
            )
    return np.array([int(v) for v in values], dtype=np.int32)


def _common(a: tuple, i: int, b: tuple, j: int) -> int:
    """How many items ``a[i:]`` and ``b[j:]`` share from their starts."""
    n = min(len(a) - i, len(b) - j)
    return next(compress(count(), map(ne, a[i : i + n], b[j : j + n])), n)


def _picker(old: slice | np.ndarray) -> tuple[int, Any]:
    """How many rows ``old`` (a slice, or row numbers) names, and a function
    taking them from a column (a tuple or list, as the column's type or a tuple)."""
    if type(old) is slice:
        return old.stop - old.start, itemgetter(old)
    rows = old.tolist()
    if len(rows) > 1:
        return len(rows), itemgetter(*rows)
    return len(rows), lambda column: tuple(column[i] for i in rows)


def _equal_rows(a: tuple, b: tuple) -> bool:
    """Whether two steps' segments are equal (tokens compared too: numpy
    tokens that cannot be compared read as unequal)."""
    try:
        return a == b
    except (ValueError, TypeError):
        return False


def _check_forks(step: KVStep) -> None:
    for when, forks in (("pre-fork", step.pre_forks), ("post-fork", step.post_forks)):
        for fork in forks:
            if len(fork) != 2 or not all(isinstance(label, str) for label in fork):
                raise InvalidStep(
                    f"expected each {when} a (src, dst) pair of labels, got {fork!r}",
                    *first_row(step),
                )
            if fork[0] == fork[1]:
                raise InvalidStep(
                    f"expected a fork between two labels, got {fork[0]!r} -> {fork[1]!r}",
                    first_row(step)[0],
                    fork[0],
                )


def _first_repeat(keys: list[tuple[str, str]]) -> tuple[str, str]:
    seen = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("no repeated stream")
