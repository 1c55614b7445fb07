"""One meta-test over the whole zoo, and the rule that every invariant has teeth.

Every invariant of the registry is either caught, alone, in at least one
broken member, or says why it cannot fail without another named invariant.
"""

from __future__ import annotations

import pytest

from kvspec.impl.broken import Catch
from kvspec.properties import suite
from kvspec.properties.meta.teeth import assert_caught, assert_filed_under_safety, zoo
from kvspec.spec.invariants import REGISTRY

ZOO = zoo()


@pytest.mark.parametrize(("factory", "catch"), ZOO, ids=[f"{f}-{c.invariant.name}" for f, c in ZOO])
def test_broken_member_is_caught(factory: str, catch: Catch) -> None:
    if catch.invariant.tier == "safety":
        assert_filed_under_safety(factory, catch)
    else:
        assert_caught(suite.machine_titled(catch.machine), factory, catch.invariant)


def test_every_invariant_has_teeth() -> None:
    """Every rule of kvspec's spec; a third party's layer (the guide's example) proves its own."""
    caught = {catch.invariant for _, catch in ZOO}
    toothless = []
    for name, rule in sorted(REGISTRY.items()):
        if rule in caught or not rule.check.__module__.startswith("kvspec.spec."):
            continue
        others = [other for other in REGISTRY if other != name and other in rule.fails_only_with]
        if not others:
            toothless.append(name)
    assert not toothless, f"no broken member is caught by these, and none says what it fails only with: {toothless}"
