"""The suite's teeth: a broken implementation must be caught, by the right invariant."""

from __future__ import annotations

from hypothesis import settings as Settings

from properties.harness import LockstepMachine, load_implementation, run_machine


def assert_caught(
    machine: type[LockstepMachine], factory: str, invariant: str, settings: Settings | None = None
) -> None:
    """Run ``machine`` against the broken ``factory``; it must fail on ``invariant``."""
    outcome = run_machine(machine, load_implementation(factory), settings)
    shown = "\n    ".join(outcome.steps)
    assert outcome.invariant == invariant, (
        f"{factory} should violate {invariant}, got {outcome.invariant or 'no violation'}: {outcome.detail}\n    {shown}"
    )
    assert outcome.steps, f"{factory}: the violation of {invariant} came without its operation sequence"
