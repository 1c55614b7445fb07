"""No false safety: a choice an implementation may legitimately make never comes out as a safety finding.

The mirror of ``test_tiers`` (a safety bug is filed under safety whatever is declared).  Every member of the
zoo whose every claim is a convention or caller-contract rule, and the reference declaring each value of each
convention it did not choose, runs with every rule but the safety rules already known: each example goes on
past its convention and caller-contract findings, the model set aside, for as long as it can.  No safety rule
may fail.  A safety finding here is one that a correct engine making that choice would get: a safety rule
judged on the model, not on the implementation's own state and the caller's ledger.

The teeth: a block-pool machine whose safety check is handed the model's holders instead of the caller's
ledger makes a safety finding of a pool that only queues blocks released together in reverse.

In ``ci`` each member runs in the machines its claims name, with a third of the profile's examples; under
``thorough``, in every machine that counts a component it brings.
"""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import settings as Settings
from hypothesis.stateful import invariant

from kvspec.impl.broken import block_pool as broken_block_pool
from kvspec.properties import suite
from kvspec.properties.findings import Finding
from kvspec.properties.harness import LockstepMachine
from kvspec.properties.loading import load_implementation
from kvspec.properties.meta.teeth import DETECTION, zoo
from kvspec.properties.profiles import default_profile
from kvspec.properties.running import run_machine
from kvspec.properties.test_block_pool import BlockPoolMachine
from kvspec.spec import block_pool
from kvspec.spec.conventions import (
    Conventions,
    ManagerConventions,
    PoolConventions,
    RadixConventions,
    StoreConventions,
    WindowConventions,
)
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import REGISTRY

NOT_SAFETY = frozenset(rule for rule in REGISTRY.values() if rule.tier != "safety")
THOROUGH = default_profile() == "thorough"


def legal_members() -> dict[str, tuple[str, ...]]:
    """Each zoo member caught by no safety rule, with the machines its claims name."""
    claims: dict[str, list[tuple[str, str]]] = {}
    for factory, catch in zoo():
        claims.setdefault(factory, []).append((catch.invariant.tier, catch.machine))
    return {
        factory: tuple(dict.fromkeys(machine for _, machine in found))
        for factory, found in sorted(claims.items())
        if all(tier != "safety" for tier, _ in found)
    }


def counting(implementation: Implementation) -> tuple[str, ...]:
    """The machines that count a component ``implementation`` brings and can run against it."""
    own = implementation.own_components()
    return tuple(
        d.title for d in suite.declarations() if d.machine.uses & own and not d.machine.not_offered(implementation)
    )


def false_safety(implementation: Implementation, machine: type[LockstepMachine]) -> list[Finding]:
    """The safety findings of ``machine`` on ``implementation`` once every other rule is known."""
    scale = 1.0 if THOROUGH else 1 / 3
    base = Settings(Settings(), derandomize=True, database=None, phases=DETECTION)
    settings = Settings(base, max_examples=max(10, int(base.max_examples * scale)))
    outcome = run_machine(machine, implementation, settings, known=NOT_SAFETY)
    return [finding for finding in outcome.findings if finding.tier in ("safety", "harness")]


def shown(findings: list[Finding]) -> str:
    return "\n".join(
        f"{f.invariant.name if f.invariant else 'uncaught error'}: {f.detail}\n    " + "\n    ".join(f.steps)
        for f in findings
    )


LEGAL = legal_members()
CASES = [
    (factory, title)
    for factory, machines in LEGAL.items()
    for title in (counting(load_implementation(factory)) if THOROUGH else machines)
]


@pytest.mark.parametrize(("factory", "title"), CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_a_legal_choice_makes_no_safety_finding(factory: str, title: str) -> None:
    found = false_safety(load_implementation(factory), suite.machine_titled(title))
    assert not found, f"{factory} in {title}:\n{shown(found)}"


def other_choices() -> list[tuple[str, Conventions]]:
    """The reference's conventions with one field set to each value it did not choose."""
    alternatives = {
        "pool": (PoolConventions, {"unhashed_free_position": "head", "duplicate_hash": "keep", "policies": ("lru",)}),
        "radix": (
            RadixConventions,
            {
                "eviction_granularity": "whole_leaves",
                "recency": "per_node",
                "lock_by": "handle",
                "extra_key_namespaces": False,
                "page_reuse": "last_freed_first",
            },
        ),
        "manager": (ManagerConventions, {"fork_partial_block": "copy"}),
        "window": (WindowConventions, {"slid_out": "ring", "window_of": "next_token", "release": "at_next_allocation"}),
        "store": (
            StoreConventions,
            {"reput": "skip", "stores": "pending", "eviction": "background", "refusal_adapts_policy": True},
        ),
    }
    choices = [("trusts_caller=True", Conventions(trusts_caller=True))]
    for family, (kind, values) in alternatives.items():
        for field, value in values.items():
            declared = attrs.evolve(Conventions(), **{family: kind(**{field: value})})
            choices.append((f"{family}.{field}={value}", declared))
    return choices


FAMILY_MACHINES = {
    "pool": ("block pool", "prefix cache"),
    "radix": ("radix cache", "radix pages (SGLang's page manager)"),
    "manager": ("block manager",),
    "window": ("sliding-window tables",),
    "store": ("tiered KV store (node faults)",),
    "trusts_caller": ("block pool", "scheduler (recompute)"),
}
DECLARED = [
    (name, conventions, title)
    for name, conventions in other_choices()
    for title in FAMILY_MACHINES[name.split(".")[0].split("=")[0]]
]


@pytest.mark.parametrize(("name", "conventions", "title"), DECLARED, ids=[f"{n}-{t}" for n, _, t in DECLARED])
def test_the_reference_declaring_another_choice_makes_no_safety_finding(
    name: str, conventions: Conventions, title: str
) -> None:
    reference = attrs.evolve(load_implementation("kvspec.impl:reference"), conventions=conventions)
    found = false_safety(reference, suite.machine_titled(title))
    assert not found, f"the reference declaring {name}, in {title}:\n{shown(found)}"


class ModelLedgerMachine(BlockPoolMachine):
    """The block-pool machine as it must never be: its holders read off the model's counts."""

    @invariant()
    def pool_matches_spec(self) -> None:
        held = Counter({block: count for block, count in enumerate(self.pool.model.refcounts) if count})
        self.check_group(block_pool.STATE, self.pool.snapshot(), held)


def test_the_test_has_teeth() -> None:
    """A safety rule fed from the model makes a false safety finding of a legal choice, and both this test and
    the source reading of ``provenance`` see it."""
    from kvspec.properties.meta.provenance import safety_checks_reading_the_model

    reversed_release = load_implementation(f"{broken_block_pool.__name__}:releases_together_in_reverse")
    assert not false_safety(reversed_release, BlockPoolMachine)
    assert false_safety(reversed_release, ModelLedgerMachine)
    flagged = [f.where for f in safety_checks_reading_the_model(__name__)]
    assert f"{__name__}:ModelLedgerMachine.pool_matches_spec" in flagged


COPYING_FORK = "kvspec.properties.test_block_manager:copying_fork_reference"  # HF's fork, the reference's way


@pytest.mark.parametrize("title", counting(load_implementation(COPYING_FORK)))
def test_a_manager_copying_the_partial_block_at_fork_makes_no_safety_finding_above_it(title: str) -> None:
    """The reference's scheduler and paged KV cache over a manager that copies at the fork, as over HF's: admission
    counts the copies, the cache copies their K and V."""
    found = false_safety(load_implementation(COPYING_FORK), suite.machine_titled(title))
    assert not found, f"{COPYING_FORK} in {title}:\n{shown(found)}"
