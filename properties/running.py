"""Running a machine: its settings, the test pytest collects, one run's outcome and the replay of one example."""

from __future__ import annotations

import re
import unittest
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, reproduce_failure
from hypothesis import settings as Settings
from hypothesis.errors import DidNotReproduce, Flaky, Unsatisfiable
from hypothesis.stateful import get_state_machine_test, run_state_machine_as_test

from kvspec.properties.findings import FINDING_KINDS, Finding, finding_of, leaves
from kvspec.properties.harness import LockstepMachine, Statistics, Variant
from kvspec.spec.components import DeclarationError
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import Invariant


def conformance_settings(base: Settings | None = None, examples: float = 1.0) -> Settings:
    """``base`` (default: the current profile) made fit for lockstep machines.

    Steps are not timed (a deadline would make a slow implementation flaky rather than wrong), and
    ``examples`` scales the example count for machines whose steps are costly.
    """
    base = base or Settings()
    return Settings(
        base,
        deadline=None,
        suppress_health_check=[
            *base.suppress_health_check,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
        max_examples=max(5, int(base.max_examples * examples)),
    )


@attrs.frozen
class ConformanceTest:
    """A machine as a test module declares it: the one declaration both routes to a verdict run.

    ``TestBlockPool = conformance_test(BlockPoolMachine, "block pool")`` in a module collected by pytest
    becomes the machine's Hypothesis ``TestCase`` bound to the implementation that ``--kv-impl`` names
    (``kvspec.pytest_plugin``): nothing is bound at import time.  ``kvspec.run_conformance`` walks the same
    declarations (``kvspec.properties.suite``) and runs each under the same ``settings``.  A machine the
    implementation does not offer what it needs for (``not_offered``) is skipped, with why.
    """

    machine: type[LockstepMachine]
    title: str  # how a verdict names it; ``--machine`` and ``run_conformance(titled=...)`` match its words
    examples: float = 1.0  # scales the profile's example count, for machines whose steps are costly

    def settings(self, base: Settings | None = None) -> Settings:
        """The settings this machine runs under, on either route: ``base`` (the profile) scaled by ``examples``."""
        return conformance_settings(base, self.examples)

    def bind(self, implementation: Implementation, base: Settings | None = None) -> type:
        test: type[Any] = self.machine.bind(implementation).TestCase
        test.settings = self.settings(base)
        test.kvspec_declaration = self  # pytest keeps the bound class where the module kept its declaration
        reason = self.machine.not_offered(implementation)
        return unittest.skip(reason)(test) if reason else test


def conformance_test(machine: type[LockstepMachine], title: str, examples: float = 1.0) -> ConformanceTest:
    return ConformanceTest(machine, title, examples)


def declaration_of(value: object) -> ConformanceTest | None:
    """The declaration ``value`` is, or that pytest bound it from (None: neither), so that a module's
    ``TestSlots`` names its declaration before and after pytest's collection."""
    declared = getattr(value, "kvspec_declaration", value)
    return declared if isinstance(declared, ConformanceTest) else None


@attrs.frozen
class Outcome:
    """One run of one machine against one implementation: its findings (one per tier at most), what it checked."""

    machine: str
    findings: tuple[Finding, ...]
    statistics: Statistics
    unsatisfiable: bool = False  # every example broke a known safety rule: nothing more could be reached

    @property
    def finding(self) -> Finding | None:
        """The finding of the highest tier, if any."""
        return min(self.findings, key=lambda f: FINDING_KINDS.index(f.tier), default=None)


def run_machine(
    machine: type[LockstepMachine],
    implementation: Implementation,
    settings: Settings | None = None,
    *,
    only: frozenset[Invariant] | None = None,
    known: frozenset[Invariant] = frozenset(),
    spared: frozenset[Variant] | None = None,
    probing: Variant | None = None,
) -> Outcome:
    """Run ``machine`` against ``implementation`` (``bind`` says what the keywords do); each distinct finding
    shrunk on its own.

    Raises ``DeclarationError`` when a component could not be built: the adapter's error, not a finding.
    """
    bound = machine.bind(implementation, only=only, known=known, spared=spared, probing=probing)
    settings = conformance_settings(settings)
    phases = [phase for phase in settings.phases if phase is not Phase.explain]  # slow, and adds nothing here
    settings = Settings(settings, report_multiple_bugs=True, phases=phases, print_blob=True)
    errors: list[BaseException] = []
    unsatisfiable = False
    try:
        run_state_machine_as_test(bound, settings=settings)
    except Unsatisfiable:
        unsatisfiable = True
    except unittest.SkipTest:  # told to run no example (only the phase that replays an empty database)
        pass
    except BaseExceptionGroup as group:
        errors = list(leaves(group))
    except (Flaky, Exception) as error:
        errors = [error]
    build_errors = [error for error in errors if isinstance(error, DeclarationError)]
    if build_errors:
        raise build_errors[0]
    findings = tuple(attrs.evolve(finding_of(error), blob=blob_of(error)) for error in errors)
    return Outcome(machine.__name__, findings, bound.statistics, unsatisfiable)


REPRODUCE = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


def blob_of(error: BaseException) -> str:
    """The example that raised ``error``, as Hypothesis prints it for ``@reproduce_failure``."""
    for note in getattr(error, "__notes__", ()):
        found = REPRODUCE.search(note)
        if found:
            return f"{found.group(1)}:{found.group(2)}"
    return ""


def replay(
    machine: type[LockstepMachine],
    implementation: Implementation,
    blob: str,
    *,
    only: frozenset[Invariant] | None = None,
    known: frozenset[Invariant] = frozenset(),
    spared: frozenset[Variant] | None = None,
    probing: Variant | None = None,
) -> Finding | None:
    """Run the one example ``blob`` names (``Finding.blob``) against ``implementation``, bound as it was found;
    its finding, or None if it no longer fails."""
    version, _, choices = blob.partition(":")
    bound = machine.bind(implementation, only=only, known=known, spared=spared, probing=probing)
    settings = Settings(
        conformance_settings(), database=None, print_blob=False, report_multiple_bugs=False, verbosity=Verbosity.quiet
    )
    # Hypothesis's public replay: @reproduce_failure on the machine class, which its state-machine test honours
    test = get_state_machine_test(reproduce_failure(version, choices.encode())(bound), settings=settings)
    try:
        test()
    except DidNotReproduce:
        return None
    except Exception as error:
        return finding_of(error)
    return None
