"""StepWriter: what an admitted step changes in the streams, and its undo.

``apply`` (at ``plan``, or at ``commit`` for an unplanned step) runs the
pre-forks, makes the step's new streams and hands each growing row its pages
from the reservation, journaling each change; ``undo`` rolls a step back to
a journal mark. ``settle`` (a commit's prefix records, freed fork targets,
a short commit's cut, a window's release) runs once nothing can fail, so it
is never undone. Whatever changes the pages a stream holds makes the index
builder forget its cached arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mstar.engine.resources.kv.journal import Grew, Made
from mstar.engine.resources.kv.rewind import kept_tokens
from mstar.engine.resources.step import KVStep

if TYPE_CHECKING:
    from mstar.engine.resources.kv.admission import Admission, Admitted
    from mstar.engine.resources.kv.forks import Forks
    from mstar.engine.resources.kv.index import IndexBuilder
    from mstar.engine.resources.kv.streams import StreamTable


@dataclass(slots=True)
class StepWriter:
    """Applies admitted steps to ``streams``; the caller holds the lock."""

    streams: StreamTable
    admission: Admission
    forks: Forks
    index: IndexBuilder
    window: int | None

    def apply(self, step: KVStep, rec: Admitted) -> None:
        """Pre-forks, then each row's new pages (new streams made)."""
        streams, journal = self.streams, rec.journal
        if rec.forks:
            self.forks.apply(step.pre_forks, rec.requests, journal)
            rec.slots = streams.resolve(rec.keys)
            rec.new = (rec.slots == 0).nonzero()[0].tolist()
            rec.ends, rec.num_pages, rec.grow = self.admission.sizes(rec.slots, rec.spans, rec.few)
        if rec.new:
            keys = [rec.keys[i] for i in rec.new]
            rooms = [rec.grow[i] for i in rec.new] if rec.few else rec.grow[rec.new].tolist()
            slots = streams.make_empty(keys, rooms)
            rec.slots[rec.new] = slots
            journal.entries.extend(map(Made, keys, slots))
        grow = rec.grow
        if rec.few:
            if not any(grow):
                return
            grow = np.array(grow, np.int64)
        growing = grow.nonzero()[0]
        if len(growing):  # their new pages, in row order, from the reservation
            slots, grow = rec.slots[growing], grow[growing]
            pages = journal.take(int(np.add.reduce(grow)))
            journal.add(Grew(slots, streams.extend(slots, grow, pages)))

    def settle(self, step: KVStep, rec: Admitted, ends: np.ndarray, cut: np.ndarray | None) -> None:
        """A commit's last part, once nothing can fail: the prefix cache
        records the committed tokens (a short commit's kept ones: ``cut``),
        fork targets the step replaced are freed, and a window's pages
        behind every later query go back."""
        if cut is not None:
            self._cut(rec, ends, cut)
        elif rec.tokens is not None:  # only now is the step's KV final
            self.streams.prefix.record(rec.slots, rec.ends, rec.spans, rec.tokens)
            if step.post_forks:  # (request ids are built only when asked)
                self.forks.copy_chains(step.post_forks, rec.requests)
        if rec.forks:
            for slot in rec.journal.replaced():  # fork targets it replaced go now
                self.streams.free(slot)
        if self.window is not None and step.commit:
            self._release_behind(rec)

    def _cut(self, rec: Admitted, ends: np.ndarray, cut: np.ndarray) -> None:
        """The pages past each row's kept tokens go back, and only kept
        tokens are recorded in the prefix cache."""
        self.shorten(rec.slots, ends)
        if rec.tokens is not None:
            prefix = self.streams.prefix
            tokens, keep = kept_tokens(rec.tokens, cut, rec.spans)
            kept = rec.spans - cut
            if keep is None:
                prefix.record(rec.slots, ends, kept, tokens)
            elif len(tokens):
                prefix.record(rec.slots[keep], ends[keep], kept[keep], tokens)

    def shorten(self, slots: np.ndarray, ends: np.ndarray) -> None:
        """Cut each stream to ``ends`` tokens, its pages wholly past them back."""
        if self.streams.shorten(slots, ends):
            self.index.forget()  # its arrays name pages that went back

    def _release_behind(self, rec: Admitted) -> None:
        """Release the full pages of the step's streams (its fork targets
        too) that no later query's window reaches."""
        streams, slots = self.streams, rec.slots
        if rec.forks:
            slots = np.array([s for r in rec.requests for s in streams.labels(r).values()])
        if streams.release_behind(slots, self.window):
            self.index.forget()  # its arrays name released pages

    def undo(self, rec: Admitted, mark: tuple[int, int]) -> None:
        """Roll the step back to ``mark`` through its journal."""
        rec.journal.undo(mark, self.streams)
        rec.slots = self.streams.resolve(rec.keys)
        self.index.forget()  # its arrays may name pages that went back
