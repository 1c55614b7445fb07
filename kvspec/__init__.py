"""kvspec: an executable, property-tested specification of KV-cache management.

``kvspec.run_conformance(factory, layers=..., profile=...)`` returns the
conformance verdict that ``kvspec check`` prints (``kvspec.conformance``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and readers; at run time, __getattr__ below
    from kvspec.conformance import Verdict, run_conformance

__all__ = ["run_conformance", "Verdict"]


def __getattr__(name: str) -> Any:
    """The conformance API, imported on first use (it loads Hypothesis; the spec alone does not)."""
    if name in __all__:
        from kvspec import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'kvspec' has no attribute {name!r}")
