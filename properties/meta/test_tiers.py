"""A safety bug is filed under safety, whatever the implementation declares.

Every member of the zoo caught by a safety invariant goes through the verdict's machinery twice: as shipped
(``test_zoo``, whose proof of a safety member is its verdict) and here, declaring every convention choice
other than the reference's and that it trusts its caller.  Both times its invariant must come out VIOLATED
in the safety tier: a convention or caller-contract finding made first must not wash it out.  The reference,
declaring all of those choices it did not make, must show no safety finding at all.

A member whose bug is accepting out-of-contract calls (it is caught by the caller-contract rule too) is
checked as shipped only: declaring that it trusts its caller makes that bug its declared choice, and what
such a call breaks is reported as the call's consequence; so is a member whose bug is one of the other
choices (``IS_ANOTHER_CHOICE``): ignoring extra keys is what declaring them no namespaces says.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings as Settings

from kvspec import conformance, rounds
from kvspec.impl.broken import Catch
from kvspec.properties import suite
from kvspec.properties.loading import load_implementation
from kvspec.properties.meta.teeth import DETECTION, assert_filed_under_safety, zoo
from kvspec.spec.conventions import Conventions, ManagerConventions, PoolConventions, RadixConventions
from kvspec.spec.invariants import invariant_out_of_contract_call_rejected

EVERY_OTHER_CHOICE = Conventions(
    pool=PoolConventions(unhashed_free_position="head", duplicate_hash="keep", policies=("lru",)),
    manager=ManagerConventions(fork_partial_block="copy"),
    radix=RadixConventions(
        eviction_granularity="whole_leaves",
        recency="per_node",
        lock_by="handle",
        extra_key_namespaces=False,
        page_reuse="last_freed_first",
    ),
    trusts_caller=True,
)
ZOO = zoo()
ACCEPTS_OUT_OF_CONTRACT = {
    factory for factory, catch in ZOO if catch.invariant is invariant_out_of_contract_call_rejected
}
# a member whose bug is one of those other choices: declaring it makes the bug the declared convention
IS_ANOTHER_CHOICE = {"kvspec.impl.broken.radix_cache:ignores_extra_keys": "extra_key_namespaces=False"}
SAFETY = [
    (factory, catch)
    for factory, catch in ZOO
    if catch.invariant.tier == "safety" and factory not in ACCEPTS_OUT_OF_CONTRACT | IS_ANOTHER_CHOICE.keys()
]


@pytest.mark.parametrize(("factory", "catch"), SAFETY, ids=[f"{f}-{c.invariant.name}" for f, c in SAFETY])
def test_a_safety_member_declaring_other_conventions_is_filed_under_safety(factory: str, catch: Catch) -> None:
    assert_filed_under_safety(factory, catch, EVERY_OTHER_CHOICE)


@pytest.mark.parametrize(
    "title",
    ["block pool", "prefix cache", "radix cache", "scheduler (recompute)"],  # prefix cache: over a manager
)
def test_declarations_never_make_a_safety_finding(title: str) -> None:
    reference = attrs.evolve(load_implementation("kvspec.impl:reference"), conventions=EVERY_OTHER_CHOICE)
    run = rounds.Run(reference, "kvspec.impl:reference")
    base = Settings(Settings(), derandomize=True, database=None, phases=DETECTION)
    run.machines.append(rounds.run_one(run, suite.declaration_titled(title), base))
    found = conformance.verdict_of(run, "ci")
    assert not [v for v in found.violations if v.tier == "safety"], str(found)
