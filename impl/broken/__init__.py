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
(``properties/meta/test_zoo.py``) runs every claim of every module here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvspec.spec.components import Offer, every_operation
from kvspec.spec.conventions import REFERENCE, Conventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import Invariant


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
    offers = {kind: Offer(f, every_operation(kind)) for kind, f in components.items() if f is not None}
    return Member(name=name, components=offers, conventions=conventions, caught_by=caught_by)


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
