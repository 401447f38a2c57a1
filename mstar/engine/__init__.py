"""The serving engine: ``Engine``, ``SamplingParams`` and the completions it returns.

Exports load lazily: ``mstar.engine.resources`` (the plan layer) imports
without pulling in transformers through the engine.
"""

from __future__ import annotations

from importlib import import_module
from types import MappingProxyType
from typing import Any

_EXPORTS = MappingProxyType(
    {
        "AsyncEngine": "mstar.engine.async_engine",
        "Completion": "mstar.engine.request",
        "CompletionOutput": "mstar.engine.request",
        "Engine": "mstar.engine.engine",
        "EngineStats": "mstar.engine.records",
        "RequestTooLarge": "mstar.engine.intake",
        "SamplingParams": "mstar.engine.sampling.params",
        "StepFailed": "mstar.engine.records",
        "StructuredOutputs": "mstar.engine.sampling.structured",
    }
)
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mstar.engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
