"""kvspec: an executable, property-tested specification of KV-cache management.

``kvspec.run_conformance(factory, titled=..., profile=...)`` returns the
conformance verdict that ``kvspec check`` prints (``kvspec.conformance``):
a ``Verdict`` of ``RuleVerdict`` rows, ``Violation`` findings and
``MachineRun`` rows.  ``kvspec.replay(token)`` runs a finding's example
again.  A factory returns an ``Implementation``; one that cannot be used
raises ``AdapterError``, a request that names nothing ``UsageError``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and readers; at run time, __getattr__ below
    from kvspec.conformance import MachineRun, RuleVerdict, Verdict, Violation, replay, run_conformance
    from kvspec.properties.loading import AdapterError, UsageError
    from kvspec.spec.implementation import Implementation

# each name of the API and the module it lives in, imported on first use (the conformance API loads
# Hypothesis; the spec alone does not)
API = {
    "run_conformance": "kvspec.conformance",
    "replay": "kvspec.conformance",
    "Verdict": "kvspec.conformance",
    "RuleVerdict": "kvspec.conformance",
    "Violation": "kvspec.conformance",
    "MachineRun": "kvspec.conformance",
    "Implementation": "kvspec.spec.implementation",
    "AdapterError": "kvspec.properties.loading",
    "UsageError": "kvspec.properties.loading",
}
__all__ = [
    "run_conformance",
    "replay",
    "Verdict",
    "RuleVerdict",
    "Violation",
    "MachineRun",
    "Implementation",
    "AdapterError",
    "UsageError",
]


def __getattr__(name: str) -> Any:
    if name in API:
        return getattr(importlib.import_module(API[name]), name)
    raise AttributeError(f"module 'kvspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The API beside what is loaded: ``dir(kvspec)`` shows ``run_conformance`` before its first use."""
    return sorted({*globals(), *__all__})
