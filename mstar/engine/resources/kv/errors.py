"""The errors the KV manager raises for a request it refuses (changing nothing)."""

from __future__ import annotations


class KVError(Exception):
    """A request the manager refuses; it changed nothing."""

    def __init__(self, message: str, request_id: str | None = None, label: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.label = label


class AllocationFailed(KVError):
    """Not enough free pages for the step: ``pages_short`` more were needed,
    and (``request_id``, ``label``) is the first stream that did not fit."""

    def __init__(self, pages_short: int, request_id: str, label: str):
        super().__init__(
            f"out of KV pages: {pages_short} short at request {request_id!r}, label {label!r}",
            request_id,
            label,
        )
        self.pages_short = pages_short


class InvalidStep(KVError, ValueError):
    """A step (or a call order) the manager cannot accept."""


class UnknownStream(KVError, LookupError):
    """A (request, label) stream the manager does not hold."""
