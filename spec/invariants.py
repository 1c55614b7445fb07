"""Named invariants: the registry every layer of the spec writes into.

Rules:

* An invariant is a plain predicate over abstract states (and, for a
  transition, over the state before, the state after and the result).  It
  returns ``None`` when it holds and a one-line explanation when it does not.
* Each invariant is declared exactly once, with ``@invariant(why)``, in the
  ``spec`` module of the layer it belongs to.  Its name is the function's
  name; the registry refuses a second declaration of the same name.
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
