"""The journal: what applying one admitted step changed, so it can be undone.

A step reserves its pages at ``admit`` and takes them as its forks and spans
apply; each change to the stream table is one typed entry, newest last.
``undo`` to a mark reverts every entry after it, newest first, and gives the
pages taken since back to the reservation: a ``plan`` or ``commit`` that
raises, and an ``abort``, all roll back through it and nothing else.

Invariants: pages ``reserved[:taken]`` are the ones handed out, in order; a
fork target the step replaced (``Replaced``) keeps its slot and pages until
the step ends (``replaced`` lists them).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mstar.engine.resources.kv.streams import StreamTable


class Grew(NamedTuple):
    """Streams that took pages, and their page counts before."""

    slots: np.ndarray
    had: np.ndarray

    def undo(self, streams: StreamTable, taken: np.ndarray) -> None:
        streams.npages[self.slots] = self.had
        streams.touch(self.slots)


class Advanced(NamedTuple):
    """Streams whose lengths grew by ``spans`` (a commit)."""

    slots: np.ndarray
    spans: np.ndarray

    def undo(self, streams: StreamTable, taken: np.ndarray) -> None:
        streams.stored[self.slots] -= self.spans
        streams.touch(self.slots)


class Made(NamedTuple):
    """A stream the step made (a new row, a fork target)."""

    key: tuple[str, str]
    slot: int

    def undo(self, streams: StreamTable, taken: np.ndarray) -> None:
        streams.unmap(*self.key)
        streams.free(self.slot, keep=taken)  # pages from the reservation go back to it


class Replaced(NamedTuple):
    """A fork target's old stream, unnamed but kept until the step ends."""

    key: tuple[str, str]
    slot: int

    def undo(self, streams: StreamTable, taken: np.ndarray) -> None:
        streams.map(*self.key, self.slot)


Entry = Grew | Advanced | Made | Replaced


class Journal:
    """One admitted step's reserved pages and its entries."""

    def __init__(self, reserved: np.ndarray) -> None:
        self.reserved = reserved
        self.taken = 0
        self.entries: list[Entry] = []
        self.add = self.entries.append  # one entry, newest last

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` reserved pages."""
        pages = self.reserved[self.taken : self.taken + n]
        assert len(pages) == n, "a step takes only the pages it reserved"
        self.taken += n
        return pages

    def mark(self) -> tuple[int, int]:
        return len(self.entries), self.taken

    def undo(self, mark: tuple[int, int], streams: StreamTable) -> None:
        """Revert every change since ``mark``: streams made go (their reserved
        pages back to the reservation, shared ones released), streams that
        grew or advanced shrink back, replaced fork targets return."""
        entries, taken = mark
        mine = self.reserved[taken : self.taken]
        while len(self.entries) > entries:
            self.entries.pop().undo(streams, mine)
        self.taken = taken

    def replaced(self) -> list[int]:
        """Slots of the fork targets the step replaced (freed when it ends)."""
        return [e.slot for e in self.entries if type(e) is Replaced]
