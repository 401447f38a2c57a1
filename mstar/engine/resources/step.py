"""What one engine step asks of the KV resource.

The scheduler speaks in segments: request ``r``'s stream ``label`` grows by
``span`` tokens this step. The KV manager turns a step into a plan; nothing
downstream of the plan sees these records.
"""

from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    """One step's addition to the (request_id, label) stream.

    ``span`` may be 0: the segment reads its stream without extending it.
    """

    request_id: str
    label: str
    span: int
