"""Named invariants: the registry every layer of the spec writes into.

Rules:

* An invariant is a plain predicate over abstract states (and, for a
  transition, over the state before, the state after and the result).  It
  returns ``None`` when it holds and a one-line explanation when it does not.
* Each invariant is declared exactly once, with ``@invariant(why)``, in the
  ``spec`` module of the layer it belongs to.  Its name is the function's
  name; the registry refuses a second declaration of the same name.
* Two invariants hold for every layer and live here: an implementation
  rejects exactly what the spec rejects, with the same error class
  (``invariant_verdict_matches_spec``) and answers what the spec answers
  (``invariant_result_matches_spec``), and a rejected operation changes
  nothing (``invariant_failed_operation_changes_nothing``).
* Property suites, the conformance report and the meta-tests refer to an
  invariant only by that name, so a failure always says which rule broke and
  why the rule exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

Predicate = TypeVar("Predicate", bound=Callable[..., "str | None"])


@attrs.frozen
class Invariant:
    """A rule of the spec: its name, the layer it belongs to and why it exists."""

    name: str
    layer: str
    why: str
    check: Callable[..., str | None] = attrs.field(eq=False, repr=False)


REGISTRY: dict[str, Invariant] = {}


def invariant(why: str) -> Callable[[Predicate], Predicate]:
    """Register ``predicate`` under its own name with the sentence that justifies it."""

    def register(predicate: Predicate) -> Predicate:
        name = predicate.__name__
        if not name.startswith("invariant_"):
            raise ValueError(f"invariant {name!r} must be named invariant_...")
        if name in REGISTRY:
            raise ValueError(f"invariant {name!r} is declared twice")
        layer = predicate.__module__.rsplit(".", 1)[-1]
        REGISTRY[name] = Invariant(name=name, layer=layer, why=why, check=predicate)
        return predicate

    return register


class InvariantViolation(AssertionError):
    """Raised by a property suite when an invariant does not hold."""

    def __init__(self, name: str, detail: str) -> None:
        rule = REGISTRY.get(name)
        why = f" (why it matters: {rule.why})" if rule else ""
        super().__init__(f"{name} violated: {detail}{why}")
        self.invariant = name
        self.detail = detail


def require(name: str, *args: Any) -> None:
    """Evaluate the registered invariant ``name`` and raise if it does not hold."""
    problem = REGISTRY[name].check(*args)
    if problem is not None:
        raise InvariantViolation(name, problem)


@invariant("a caller must be able to tell retry-later (out of blocks) from never (invalid) exactly as the spec does")
def invariant_verdict_matches_spec(expected: str, actual: str) -> str | None:
    """``expected`` and ``actual`` are verdicts: 'ok' or the typed error's class name."""
    if expected != actual:
        return f"the spec's verdict is {expected}, the implementation's is {actual}"
    return None


@invariant("callers act on what an operation answers (a lookup's block, a read's tokens): it must be the spec's answer")
def invariant_result_matches_spec(expected: object, actual: object) -> str | None:
    if expected != actual:
        return f"the spec answers {expected!r}, the implementation {actual!r}"
    return None


@invariant("a rejected operation must leave no trace, so that the caller can recover and retry")
def invariant_failed_operation_changes_nothing(before: object, after: object) -> str | None:
    if before != after:
        return f"state changed by a failed operation:\n  before {before}\n  after  {after}"
    return None


def diff_states(actual: object, expected: object) -> str:
    """Name the fields in which two attrs records differ."""
    parts = []
    for field in attrs.fields(type(expected)):
        a, e = getattr(actual, field.name), getattr(expected, field.name)
        if a != e:
            parts.append(f"{field.name}: implementation {a!r}, spec {e!r}")
    return "; ".join(parts) or f"{actual!r} != {expected!r}"
