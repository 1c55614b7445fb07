"""The zoo: deliberately broken implementations, each naming the invariant that must catch it.

Every factory is declared with ``@caught_by(invariant, machine)`` (stackable,
one line per invariant it breaks): ``machine`` is a machine's title in
``kvspec.properties.suite.MACHINES``, and that machine, checking ``invariant``
alone, must find the violation.  One meta-test
(``properties/meta/test_zoo.py``) runs every declaration of every module here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from kvspec.spec.components import Offer, every_operation
from kvspec.spec.conventions import REFERENCE, Conventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import Invariant

Factory = TypeVar("Factory", bound=Callable[[], Implementation])


@attrs.frozen
class Catch:
    """A broken member's claim: ``machine`` catches it by ``invariant``."""

    invariant: Invariant
    machine: str


def caught_by(invariant: Invariant, machine: str) -> Callable[[Factory], Factory]:
    def declare(factory: Factory) -> Factory:
        factory.caught_by = (Catch(invariant, machine), *getattr(factory, "caught_by", ()))  # type: ignore[attr-defined]
        return factory

    return declare


def member(name: str, conventions: Conventions = REFERENCE, **components: Callable[..., Any] | None) -> Implementation:
    """A broken implementation: these components, each offering every optional operation of its kind (as the
    reference it subclasses does); every other component is borrowed from the reference."""
    offers: dict[str, Any] = {
        kind: Offer(factory, every_operation(kind)) for kind, factory in components.items() if factory
    }
    return Implementation(name=name, conventions=conventions, **offers)
