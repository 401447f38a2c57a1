"""Taking tokens back: a step that commits fewer tokens than it appended
(speculative decoding's verify rows), and a stream shortened after a commit.

A stream cut to ``n`` tokens keeps the pages holding them: pages wholly past
``n`` go back to the pool (a page another stream shares only loses this
owner), a partially kept last page stays, its stale slots written over by
the stream's next tokens. Checks here raise a typed error naming the
request, the label and the value before anything changes.

The prefix cache only ever sees kept tokens: a short commit records each
row's kept tokens alone, so no page holding a rejected token is registered.
A stream already registered past the point it is cut to cannot be rewound
(its registered page would be written over): ``rewind`` refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mstar.engine.resources.kv.admission import is_int
from mstar.engine.resources.kv.errors import InvalidStep
from mstar.engine.resources.step import KVStep

if TYPE_CHECKING:
    from mstar.engine.resources.kv.admission import Admitted
    from mstar.engine.resources.kv.streams import StreamTable


def check_kept(step: KVStep, rec: Admitted, kept: Any) -> np.ndarray | None:
    """Tokens each row of ``step`` takes back (int64 ``[B]``), from
    ``kept``: the tokens each row commits, in segment order, each in ``[0,
    span]``. None when every row keeps its whole span."""
    keys, spans = rec.keys, rec.spans
    arr = np.asarray(kept)
    if arr.shape != (len(keys),) or (arr.dtype.kind not in "iu" and arr.size):
        row = keys[0] if keys else (None, None)
        raise InvalidStep(
            f"expected kept {len(keys)} ints (one a row), got {kept!r:.80} (first row:"
            f" request {row[0]!r}, label {row[1]!r})",
            *row,
        )
    cut = spans - arr.astype(np.int64)
    bad = ((cut < 0) | (cut > spans)).nonzero()[0]
    if len(bad):
        i = int(bad[0])
        raise InvalidStep(
            f"expected kept in [0, {int(spans[i])}] (the span) for request {keys[i][0]!r},"
            f" label {keys[i][1]!r}, got {int(arr[i])}",
            *keys[i],
        )
    if not cut.any():
        return None
    if not step.commit or step.post_forks:
        row = keys[int(cut.nonzero()[0][0])]
        what = "commit=False" if not step.commit else "post-forks"
        raise InvalidStep(
            f"expected a step without {what} to commit fewer tokens (request {row[0]!r},"
            f" label {row[1]!r})",
            *row,
        )
    return cut


def kept_tokens(tokens: Any, cut: np.ndarray, spans: np.ndarray) -> tuple[Any, np.ndarray]:
    """A step's recorded tokens (``step_tokens``' form) cut to each row's
    kept ones, and which rows keep any (for a decode step's array form)."""
    kept = spans - cut
    if isinstance(tokens, np.ndarray):  # one a row: the rows that keep theirs
        keep = kept > 0
        return tokens[keep], keep
    return [t if t is None else t[:k] for t, k in zip(tokens, kept.tolist())], None


def check_rewind(
    streams: StreamTable,
    slot: int,
    request_id: str,
    label: str,
    n: Any,
    window: int | None,
) -> int:
    """The stream's page-space length after taking back ``n`` tokens;
    raises ``InvalidStep``/``TypeError`` for a rewind it cannot take."""
    where = f"request {request_id!r}, label {label!r}"
    if not is_int(n):
        raise TypeError(f"expected n an int, got {n!r} for {where}")
    stored, base, ps = int(streams.stored[slot]), int(streams.base[slot]), streams.page_size
    if not 0 <= n <= stored:
        raise InvalidStep(
            f"expected n in [0, {stored}] (the tokens it holds), got {n} for {where}",
            request_id,
            label,
        )
    new = stored - int(n)
    if base and window is not None and new < window - 1:
        raise InvalidStep(
            f"expected n <= {stored - window + 1} for {where}: its window would reach"
            f" released pages, got {n}",
            request_id,
            label,
        )
    if new % ps and n:
        page = streams.tables[slot][new // ps]
        if streams.pool.refcount[page] > 1:
            raise InvalidStep(
                f"expected a rewind into a page of its own for {where}, got n={n}: page"
                f" {int(page)} is shared (a fork or a cached prefix)",
                request_id,
                label,
            )
    prefix = streams.prefix
    if prefix is not None and prefix.on[slot] and new < prefix.keyed[slot] * ps:
        raise InvalidStep(
            f"expected a rewind behind no registered page for {where}, got n={n}: the prefix"
            f" cache holds its first {int(prefix.keyed[slot]) * ps} tokens (commit fewer"
            " instead: commit(step, kept))",
            request_id,
            label,
        )
    return new
