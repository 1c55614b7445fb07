"""A safety bug is filed under safety whatever the implementation declares, and a declaration never makes one.

Every member of the zoo caught by a safety invariant goes through the verdict's own loop (the rounds of
``kvspec.conformance`` over the machine that catches it) twice: as shipped, and declaring every convention
other than the reference's and that it trusts its caller.  Both times its invariant must come out VIOLATED
in the safety tier: a convention or caller-contract finding made first must not wash it out.  The reference,
declaring all of those choices it did not make, must show no safety finding at all.

A member whose bug is accepting out-of-contract calls (it is caught by the caller-contract rule too) is
checked as shipped only: declaring that it trusts its caller makes that bug its declared choice, and what
such a call breaks is reported as the call's consequence.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings as Settings

from kvspec import conformance
from kvspec.impl.broken import Catch
from kvspec.properties import suite
from kvspec.properties.loading import load_implementation
from kvspec.properties.meta.teeth import DETECTION, zoo
from kvspec.spec.conventions import Conventions, PoolConventions, RadixConventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import invariant_out_of_contract_call_rejected

EVERY_OTHER_CHOICE = Conventions(
    pool=PoolConventions(unhashed_free_position="head", duplicate_hash="keep", policies=("lru",)),
    radix=RadixConventions(
        eviction_granularity="whole_leaves", recency="per_node", lock_by="handle", extra_key_namespaces=False
    ),
    trusts_caller=True,
)
ZOO = zoo()
ACCEPTS_OUT_OF_CONTRACT = {
    factory for factory, catch in ZOO if catch.invariant is invariant_out_of_contract_call_rejected
}
SAFETY = [
    (factory, catch, declared)
    for factory, catch in ZOO
    if catch.invariant.tier == "safety"
    for declared in ("as shipped", "every other convention")
    if declared == "as shipped" or factory not in ACCEPTS_OUT_OF_CONTRACT
]


def verdict(implementation: Implementation, title: str) -> conformance.Verdict:
    """The verdict of one machine, its rounds stopping at their first failing example (no shrinking: the tier
    a finding is filed under is decided at its step, whatever the example)."""
    run = conformance.Run(implementation, "meta-test")
    base = Settings(Settings(), derandomize=True, database=None, phases=DETECTION)
    run.machines.append(conformance.run_one(run, title, suite.machine_titled(title), base))
    return conformance.verdict_of(run, "current")


@pytest.mark.parametrize(
    ("factory", "catch", "declared"), SAFETY, ids=[f"{f}-{c.invariant.name}-{d}" for f, c, d in SAFETY]
)
def test_a_safety_member_is_filed_under_safety(factory: str, catch: Catch, declared: str) -> None:
    implementation = load_implementation(factory)
    if declared != "as shipped":
        implementation = attrs.evolve(implementation, conventions=EVERY_OTHER_CHOICE)
    found = verdict(implementation, catch.machine)
    safety = {v.invariant for v in found.violations if v.tier == "safety"}
    safety |= {k.invariant for v in found.violations for k in v.knock_ons if k.tier == "safety"}
    rows = {r.invariant: r.verdict for r in found.rules}
    assert catch.invariant.name in safety, (
        f"{factory} ({declared}): {catch.invariant.name} is {rows[catch.invariant.name]}\n{found}"
    )


@pytest.mark.parametrize(
    "title", ["block pool", "block manager", "prefix cache", "radix cache", "scheduler (recompute)"]
)
def test_declarations_never_make_a_safety_finding(title: str) -> None:
    reference = attrs.evolve(load_implementation("kvspec.impl:reference"), conventions=EVERY_OTHER_CHOICE)
    found = verdict(reference, title)
    assert not [v for v in found.violations if v.tier == "safety"], str(found)
