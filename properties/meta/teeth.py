"""The suite's teeth: every broken member of the zoo is caught, by each invariant it names.

A member of ``impl/broken/`` declares ``@caught_by(invariant, machine)``; the
proof runs that machine against it checking that invariant *alone*, so the
invariant is shown able to fail by itself, whatever else the member breaks.
Meta-tests are derandomized in every profile and stop at the first failing
example (``DETECTION``): which invariant fires is then a fixed fact of the
suite, and the minutes Hypothesis would spend shrinking are saved.
"""

from __future__ import annotations

import importlib
import pkgutil

from hypothesis import Phase
from hypothesis import settings as Settings

from kvspec.impl import broken
from kvspec.impl.broken import Catch
from kvspec.properties.harness import LockstepMachine, replay, run_machine
from kvspec.properties.loading import load_implementation
from kvspec.spec.invariants import Invariant

DETECTION = (Phase.explicit, Phase.generate)


def zoo() -> list[tuple[str, Catch]]:
    """Every declaration of every broken member: (``module:factory``, what catches it)."""
    declared = []
    for module_info in pkgutil.iter_modules(broken.__path__):
        module = importlib.import_module(f"{broken.__name__}.{module_info.name}")
        for name, factory in sorted(vars(module).items()):
            for catch in getattr(factory, "caught_by", ()):
                declared.append((f"{module.__name__}:{name}", catch))
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
