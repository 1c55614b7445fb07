"""The suite's teeth: a broken implementation must be caught, by the right invariant.

Meta-tests are derandomized in every profile and stop at the first failing
example: which invariant fires is then a fixed fact of the suite, and the
minutes Hypothesis would spend shrinking are saved (users running the suite
against a broken implementation still get the shrunk sequence).
"""

from __future__ import annotations

from hypothesis import Phase
from hypothesis import settings as Settings

from kvspec.properties.harness import LockstepMachine, load_implementation, run_machine

DETECTION = (Phase.explicit, Phase.generate)


def assert_caught(machine: type[LockstepMachine], factory: str, invariant: str) -> None:
    """Run ``machine`` against the broken ``factory``; it must fail on ``invariant``."""
    settings = Settings(Settings(), derandomize=True, database=None, phases=DETECTION)
    outcome = run_machine(machine, load_implementation(factory), settings)
    shown = "\n    ".join(outcome.steps)
    assert outcome.invariant == invariant, (
        f"{factory} should violate {invariant}, got {outcome.invariant or 'no violation'}: {outcome.detail}\n    {shown}"
    )
    assert outcome.steps, f"{factory}: the violation of {invariant} came without its operation sequence"
