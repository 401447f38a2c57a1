"""Forks: a request's stream copied to another of its labels.

``dst`` becomes a copy of ``src`` as stored now: full pages are shared (one
more owner each; a full page is never written again) and a partially filled
last page is copied into a page of the step's reservation, so no two streams
ever write one page. A ``dst`` that existed is replaced: its old stream stays
(``Replaced`` in the journal) until the step ends. Every change is journaled.
"""

from __future__ import annotations

from typing import Any

from mstar.engine.resources.kv.journal import Journal, Made, Replaced
from mstar.engine.resources.kv.pages import PagePool
from mstar.engine.resources.kv.streams import StreamTable


class Forks:
    """Applies label forks to ``streams``; with a ``cache``, copies the
    partial pages' KV (``cache.copy_pages``)."""

    def __init__(self, streams: StreamTable, pool: PagePool, page_size: int, cache: Any) -> None:
        self.streams = streams
        self.pool = pool
        self.page_size = page_size
        self.cache = cache

    def apply(
        self, forks: tuple[tuple[str, str], ...], requests: dict[str, None], journal: Journal
    ) -> None:
        """Each fork ``(src, dst)``, in order, for each of ``requests``."""
        for src, dst in forks:
            for request_id in requests:
                self._fork(request_id, src, dst, journal)

    def copy_chains(self, forks: tuple[tuple[str, str], ...], requests: dict[str, None]) -> None:
        """Prefix cache: fork targets continue their sources' token chains."""
        for src, dst in forks:
            for request_id in requests:
                labels = self.streams.labels(request_id)
                self.streams.prefix.copy(labels[src], labels[dst])

    def _fork(self, request_id: str, src: str, dst: str, journal: Journal) -> None:
        streams = self.streams
        src_slot = streams.labels(request_id)[src]
        stored = int(streams.stored[src_slot])
        full, tail = divmod(stored, self.page_size)
        table = streams.tables[src_slot][: full + (tail > 0)].copy()
        if tail:
            page = journal.take(1)  # a raise below is undone with the rest
            if self.cache is not None:
                self.cache.copy_pages(table[full:], page)
            table[full] = page[0]
        self.pool.share(table[:full])
        if dst in streams.labels(request_id):
            journal.add(Replaced((request_id, dst), streams.unmap(request_id, dst)))
        slot = streams.make(request_id, dst, table, stored, int(streams.base[src_slot]))
        journal.add(Made((request_id, dst), slot))
        if streams.prefix is not None:
            streams.prefix.copy(src_slot, slot)
