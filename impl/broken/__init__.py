"""The zoo: deliberately broken implementations, each naming the invariant that must catch it.

A member is declared once, in one line, beside the broken component it builds::

    pool = members("block_pool", "block pool")
    ...
    leaks_on_free = pool("leaks on free", LeaksOnFree, spec.invariant_no_leak)

``member`` (which ``members`` calls) returns the ``Implementation`` itself
(``kvspec check --impl kvspec.impl.broken.block_pool:leaks_on_free`` runs
it): those components, each offering every optional operation of its kind
(as the reference it subclasses does), every other component borrowed from
the reference.  Its claims pair each invariant the member breaks with a
machine's title in ``kvspec.properties.suite``: that machine,
checking the invariant alone, must find the violation.  One meta-test
(``properties/meta/test_zoo.py``) runs every claim of every module here.  A
factory function may declare its claims with ``@caught_by(invariant,
machine)`` instead (stackable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def catches(claims: Iterable[tuple[Invariant, str] | Catch]) -> tuple[Catch, ...]:
    return tuple(claim if isinstance(claim, Catch) else Catch(*claim) for claim in claims)


@attrs.frozen
class Member(Implementation):
    """A broken implementation, with the claims of what catches it."""

    caught_by: tuple[Catch, ...] = attrs.field(default=(), converter=catches)


def member(
    name: str,
    conventions: Conventions = REFERENCE,
    *,
    caught_by: Iterable[tuple[Invariant, str]] = (),
    **components: Callable[..., Any] | None,
) -> Member:
    """A broken implementation: ``components`` (None: the reference's), each offering every optional operation."""
    offers: dict[str, Any] = {kind: Offer(f, every_operation(kind)) for kind, f in components.items() if f is not None}
    return Member(name=name, conventions=conventions, caught_by=caught_by, **offers)


def members(kind: str, machine: str, **shared: Callable[..., Any]) -> Callable[..., Member]:
    """Members of one layer's zoo, one line each: ``declare(name, component, *rules, conventions=..., also=...)``
    is the member ``broken: name`` whose ``kind`` is ``component`` (beside the ``shared`` components), caught in
    ``machine`` by each of ``rules``, and by each further (rule, machine) of ``also``."""

    def declare(
        name: str,
        component: Callable[..., Any],
        *rules: Invariant,
        conventions: Conventions = REFERENCE,
        also: Iterable[tuple[Invariant, str]] = (),
    ) -> Member:
        claims = [*((rule, machine) for rule in rules), *also]
        return member(f"broken: {name}", conventions, caught_by=claims, **shared, **{kind: component})

    return declare


def caught_by(invariant: Invariant, machine: str) -> Callable[[Factory], Factory]:
    """Declare a claim on a factory function (a member declared by ``member(..., caught_by=...)`` needs none)."""

    def declare(factory: Factory) -> Factory:
        factory.caught_by = (Catch(invariant, machine), *getattr(factory, "caught_by", ()))  # type: ignore[attr-defined]
        return factory

    return declare
