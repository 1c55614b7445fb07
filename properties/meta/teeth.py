"""The suite's teeth: every broken member of the zoo is caught, by each invariant it names.

A member of ``impl/broken/`` declares the (invariant, machine) pairs that catch it
(``member(..., caught_by=...)``, or a line of its layer's ``members``); the proof runs that machine against it checking that invariant *alone*, so the
invariant is shown able to fail by itself, whatever else the member breaks.
A safety member's proof is its verdict instead (``assert_filed_under_safety``):
every rule checked, its invariant must come out violated in the safety tier,
which shows both that the invariant fails and that nothing washes it out.
Meta-tests are derandomized in every profile and stop at the first failing
example (``DETECTION``): which invariant fires is then a fixed fact of the
suite, and the minutes Hypothesis would spend shrinking are saved.
"""

from __future__ import annotations

import importlib
import pkgutil

import attrs
from hypothesis import Phase
from hypothesis import settings as Settings

from kvspec import conformance, rounds
from kvspec.impl import broken
from kvspec.impl.broken import Catch, Member
from kvspec.properties import suite
from kvspec.properties.harness import LockstepMachine
from kvspec.properties.loading import load_implementation
from kvspec.properties.running import replay, run_machine
from kvspec.spec.conventions import Conventions
from kvspec.spec.invariants import Invariant

DETECTION = (Phase.explicit, Phase.generate)


def zoo() -> list[tuple[str, Catch]]:
    """Every declaration of every broken member: (``module:factory``, what catches it)."""
    declared = []
    for module_info in pkgutil.iter_modules(broken.__path__):
        module = importlib.import_module(f"{broken.__name__}.{module_info.name}")
        members = ((name, value) for name, value in sorted(vars(module).items()) if isinstance(value, Member))
        declared += [(f"{module.__name__}:{name}", catch) for name, member in members for catch in member.caught_by]
    return declared


def assert_caught(machine: type[LockstepMachine], factory: str, rule: Invariant) -> None:
    """Run ``machine`` against the broken ``factory``, checking ``rule`` alone; it must be violated, and the
    example that shows it must replay to the same finding on the same printed sequence."""
    settings = Settings(Settings(), derandomize=True, database=None, phases=DETECTION)
    implementation = load_implementation(factory)
    outcome = run_machine(machine, implementation, settings, only=frozenset({rule}))
    finding = outcome.finding
    assert finding is not None, (
        f"{factory} should violate {rule.name}; {outcome.statistics.examples} examples found nothing"
    )
    shown = "\n    ".join(finding.steps)
    got = finding.invariant.name if finding.invariant else "no invariant"
    assert finding.invariant is rule, f"{factory} should violate {rule.name}, got {got}: {finding.detail}\n    {shown}"
    assert finding.steps, f"{factory}: the violation of {rule.name} came without its operation sequence"
    replayed = replay(machine, implementation, finding.blob, only=frozenset({rule}))
    assert replayed is not None, f"{factory}: the example of {rule.name} did not replay"
    assert (replayed.invariant, replayed.steps) == (rule, finding.steps), f"{factory}: replayed {replayed}"


def assert_filed_under_safety(factory: str, catch: Catch, conventions: Conventions | None = None) -> None:
    """The verdict of ``catch.machine`` on ``factory`` -- as shipped, or declaring ``conventions`` -- files
    the bug under safety (its rounds stop at their first failing example; the run, as shipped, once the rule
    is filed, and declaring other conventions at its first safety finding).  Where that finding is ``catch.invariant``'s (its own, or failing at another finding's step)
    and the member is as shipped, the example it prints replays to it; where another safety rule the same
    bug breaks fired first, the bug is filed under safety, and as shipped the rule's teeth are shown alone
    (``assert_caught``)."""
    implementation = load_implementation(factory)
    if conventions is not None:
        implementation = attrs.evolve(implementation, conventions=conventions)
    wanted = catch.invariant.name

    def filed(run: rounds.Run) -> list[conformance.Violation]:
        """Safety findings of the rule itself, or at whose step it failed too (another safety rule first)."""
        found = [v for v, _ in run.found.values() if v.tier == "safety"]
        return [v for v in found if v.invariant == wanted] + [
            v for v in found if any(c.invariant == wanted and c.tier == "safety" for c in v.consequences)
        ]

    def masked(run: rounds.Run) -> bool:
        """Another safety rule the same bug breaks fired first: the bug is filed under safety, and the rule's
        own teeth are shown alone (``assert_caught``)."""
        return any(v.tier == "safety" for v, _ in run.found.values())

    # as shipped, on until the rule itself is filed; declaring other conventions, a safety finding answers
    run = rounds.Run(implementation, factory, answered=masked if conventions else lambda run: bool(filed(run)))
    base = Settings(Settings(), derandomize=True, database=None, phases=DETECTION)
    # the whole budget of the profile, whatever share of it the suite gives the machine under pytest
    declaration = attrs.evolve(suite.declaration_titled(catch.machine), examples=1.0)
    run.machines.append(rounds.run_one(run, declaration, base))
    declared = "as shipped" if conventions is None else "declaring other conventions"
    found = filed(run)
    if not found and masked(run):  # filed under safety; as shipped, the rule's teeth are shown alone
        if conventions is None:
            assert_caught(suite.machine_titled(catch.machine), factory, catch.invariant)
        return
    assert found, f"{factory} ({declared}): {wanted} is not filed under safety\n{conformance.verdict_of(run, 'ci')}"
    if conventions is None:
        _, replayed = conformance.replay(found[0].replay)
        assert replayed is not None, f"{factory}: the example of {wanted} did not replay"
        again = {replayed.invariant, *(rule for rule, _ in replayed.consequences)}
        assert catch.invariant in again, f"{factory}: replayed {replayed}"
