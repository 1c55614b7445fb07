"""Lockstep machines: drive an implementation and the spec model side by side.

A machine in ``properties/`` is written once, against ``LockstepMachine``, and
bound to an implementation with ``Machine.bind(implementation)`` -- the same
rules then run against the reference, a user's allocator or a broken member
of the zoo (as Hypothesis's provider conformance test does).  Every
operation goes through ``lockstep``: the spec transition and the
implementation call must agree on the verdict, and a rejected operation must
leave the implementation's snapshot untouched.  Invariants are evaluated by
name (``check``), so a failure always names the rule that broke; the steps
recorded with ``record`` are the shrunk operation sequence shown with it.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import attrs
from hypothesis import HealthCheck, Phase, event
from hypothesis import settings as Settings
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvspec.spec.errors import KVSpecError, verdict
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import InvariantViolation, require

REFERENCE = "kvspec.impl:reference"
ENVIRONMENT_VARIABLE = "KVSPEC_IMPL"

T = TypeVar("T")
U = TypeVar("U")
M = TypeVar("M", bound="LockstepMachine")


class BadImplementation(Exception):
    """The ``module:factory`` given for the implementation under test is unusable."""


def load_implementation(path: str) -> Implementation:
    """Import ``module:factory``, call it, and fill missing components from the reference."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise BadImplementation(f"expected module:factory, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise BadImplementation(f"cannot import {module_name!r}: {error}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise BadImplementation(f"{module_name!r} has no callable {attribute!r}")
    implementation = factory()
    if not isinstance(implementation, Implementation):
        raise BadImplementation(
            f"{path} returned {type(implementation).__name__}, not spec.implementation.Implementation"
        )
    if path != REFERENCE:
        implementation = implementation.complete_with(load_implementation(REFERENCE))
    return implementation


def select(path: str | None) -> tuple[str, Implementation]:
    """Choose the implementation under test: ``path``, else ``$KVSPEC_IMPL``, else the reference."""
    path = path or os.environ.get(ENVIRONMENT_VARIABLE) or REFERENCE
    return path, load_implementation(path)


class LockstepMachine(RuleBasedStateMachine):
    """Base of every conformance machine; see the module docstring."""

    implementation: ClassVar[Implementation]
    last_steps: ClassVar[tuple[str, ...]] = ()
    runs: ClassVar[int] = 0
    steps_explored: ClassVar[int] = 0
    checks: ClassVar[Counter[str]]

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[str] = []
        type(self).runs += 1

    @classmethod
    def bind(cls: type[M], implementation: Implementation) -> type[M]:
        """A subclass of this machine that runs against ``implementation``."""
        namespace = {
            "implementation": implementation,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "checks": Counter(),
        }
        return type(cls.__name__, (cls,), namespace)

    def record(self, text: str) -> None:
        self.steps.append(text)
        type(self).steps_explored += 1

    def check(self, name: str, *args: Any) -> None:
        type(self).checks[name] += 1
        require(name, *args)

    def lockstep(
        self,
        label: str,
        spec_call: Callable[[], T],
        impl_call: Callable[[], U],
        snapshot: Callable[[], object],
    ) -> tuple[T, U] | None:
        """Run both sides of one operation; None when both rejected it."""
        self.record(label)
        try:
            expected, spec_error = spec_call(), None
        except KVSpecError as error:
            expected, spec_error = None, error
        before = snapshot()
        try:
            actual, impl_error = impl_call(), None
        except Exception as error:  # an untyped error is a verdict too: the wrong one
            actual, impl_error = None, error
        self.check("invariant_verdict_matches_spec", verdict(spec_error), verdict(impl_error))
        if impl_error is not None:
            event(f"{label.split('(')[0]} rejected with {verdict(impl_error)}")
            self.check("invariant_failed_operation_changes_nothing", before, snapshot())
            return None
        return expected, actual  # type: ignore[return-value]

    def teardown(self) -> None:
        type(self).last_steps = tuple(self.steps)


def conformance_settings(base: Settings | None = None, examples: float = 1.0) -> Settings:
    """``base`` (default: the current profile) made fit for lockstep machines.

    Steps are not timed (a deadline would make a slow implementation flaky rather than wrong), and
    ``examples`` scales the example count for machines whose steps are costly.
    """
    base = base or Settings()
    return Settings(
        base,
        deadline=None,
        suppress_health_check=[*base.suppress_health_check, HealthCheck.too_slow, HealthCheck.data_too_large],
        max_examples=max(5, int(base.max_examples * examples)),
    )


@attrs.frozen
class ConformanceTest:
    """A machine as a test module declares it; kvspec's pytest plugin binds it at collection.

    ``TestBlockPool = conformance_test(BlockPoolMachine)`` in a module collected by pytest
    becomes the machine's Hypothesis ``TestCase`` bound to the implementation that
    ``--kv-impl`` names (``kvspec.pytest_plugin``): nothing is bound at import time.
    """

    machine: type[LockstepMachine]
    examples: float = 1.0  # scales the profile's example count, for machines whose steps are costly

    def bind(self, implementation: Implementation, base: Settings | None = None) -> type:
        test = self.machine.bind(implementation).TestCase
        test.settings = conformance_settings(base, self.examples)
        return test


def conformance_test(machine: type[LockstepMachine], examples: float = 1.0) -> ConformanceTest:
    return ConformanceTest(machine, examples)


@attrs.frozen
class Outcome:
    """The verdict of one machine against one implementation."""

    machine: str
    invariant: str | None
    detail: str
    steps: tuple[str, ...]
    runs: int
    steps_explored: int
    checks: dict[str, int]

    @property
    def held(self) -> bool:
        return self.invariant is None


def run_machine(
    machine: type[LockstepMachine], implementation: Implementation, settings: Settings | None = None
) -> Outcome:
    """Run ``machine`` against ``implementation``; report the first invariant violated, shrunk."""
    bound = machine.bind(implementation)
    settings = settings or Settings()
    phases = [phase for phase in settings.phases if phase is not Phase.explain]  # slow, and adds nothing here
    settings = Settings(settings, report_multiple_bugs=False, phases=phases)
    invariant, detail = None, ""
    try:
        run_state_machine_as_test(bound, settings=settings)
    except InvariantViolation as violation:
        invariant, detail = violation.invariant, violation.detail
    except (Flaky, Exception) as error:
        invariant, detail = f"uncaught {type(error).__name__}", str(error)
    return Outcome(
        machine=machine.__name__,
        invariant=invariant,
        detail=detail,
        steps=bound.last_steps if invariant else (),
        runs=bound.runs,
        steps_explored=bound.steps_explored,
        checks=dict(bound.checks),
    )
