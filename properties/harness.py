"""Lockstep machines: drive an implementation and the spec model side by side.

A machine in ``properties/`` is written once, against ``LockstepMachine``, and
bound to an implementation with ``Machine.bind(implementation)`` -- the same
rules then run against the reference, a user's allocator or a broken member
of the zoo (as Hypothesis's provider conformance test does).

Every operation goes through one dispatch, by name: ``self.pool("allocate", 2)``
calls ``spec.block_pool.allocate(model, 2)`` and ``pool.allocate(2)``, where
``self.pool`` is a ``Subject`` (an implementation object, the spec module that
models it and the model's current state).  The spec's transition answers a
new state, an answer, or both (``(state, answer)``; ``(state, state, answer)``
for a call that involves a second subject); the dispatch keeps the new state
and checks, per call:

* a call the spec refuses as ``InvalidOperation`` is out of contract: the
  implementation must refuse it too, with the same class and no change
  (``invariant_out_of_contract_call_rejected``).  To an implementation that
  trusts its caller such calls are not sent at all;
* otherwise the verdicts agree (``invariant_verdict_matches_spec``), a call
  refused for want of room changes nothing
  (``invariant_failed_operation_changes_nothing``), and the answers agree
  (``invariant_result_matches_spec``, or the invariant the call names).

Buffer ownership (``recycles_buffers``, on by default in every profile): the
caller owns every list it hands over and every list it is handed back, as
an engine that recycles its token buffers and table rows each step does.
The implementation gets its list arguments in buffers of the harness's;
right after the call each buffer is overwritten (every item ``OVERWRITTEN``)
and kept for the next call's list, so one list object carries request after
request; a list the implementation answers is copied for the caller and
overwritten too.  An implementation that keeps an alias of either -- or
remembers anything by a buffer's identity -- reads another request's data.

The line each call records is made from the call itself, so the operation
sequence a failure prints is exactly the calls that ran.  Invariants are
``spec`` objects, checked one by one (``check``) or by group
(``check_group``).  A machine can be bound to check ``only`` some invariants
(the meta-tests prove each able to fail alone) or to discard the examples
that break ``known`` ones (a verdict's reruns look past what it has found).
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import attrs
from hypothesis import HealthCheck, Phase, assume, event
from hypothesis import settings as Settings
from hypothesis.control import current_build_context
from hypothesis.errors import Flaky, Unsatisfiable
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvspec.spec.errors import InvalidOperation, KVSpecError, verdict
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import (
    Group,
    Invariant,
    InvariantViolation,
    invariant_failed_operation_changes_nothing,
    invariant_out_of_contract_call_rejected,
    invariant_result_matches_spec,
    invariant_verdict_matches_spec,
)

REFERENCE = "kvspec.impl:reference"
ENVIRONMENT_VARIABLE = "KVSPEC_IMPL"
EVERY_OPERATION = frozenset({"*"})  # spared: no out-of-contract call is sent
OVERWRITTEN = -1  # what the caller writes over a list it has handed over: no token, block or id

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


@attrs.frozen
class Answer:
    """What one call answered: the model's expectation and the implementation's answer."""

    expected: Any
    actual: Any


class Subject:
    """An implementation object driven in lockstep with the spec module that models it.

    ``model`` is the model's current state (None: no model, the implementation
    runs alone and every call is only recorded); ``snapshot`` reads the
    implementation's abstract state (default: its ``snapshot()``).
    """

    def __init__(
        self,
        machine: LockstepMachine,
        name: str,
        spec: ModuleType | None,
        model: Any,
        impl: Any,
        snapshot: Callable[[], object] | None = None,
    ) -> None:
        self.machine, self.name, self.spec, self.model, self.impl = machine, name, spec, model, impl
        self.snapshot = snapshot or (lambda: impl.snapshot())

    def __repr__(self) -> str:
        return self.name

    def __call__(
        self, operation: str, *args: Any, judged_by: Invariant | None = invariant_result_matches_spec, note: str = ""
    ) -> Answer | None:
        """Run ``operation`` on both sides; None when it was refused (or, out of contract, not sent)."""
        return self.machine.dispatch(self, operation, args, judged_by, note)


class LockstepMachine(RuleBasedStateMachine):
    """Base of every conformance machine; see the module docstring."""

    implementation: ClassVar[Implementation]
    only: ClassVar[frozenset[Invariant] | None] = None
    known: ClassVar[frozenset[Invariant]] = frozenset()
    spared: ClassVar[frozenset[str]] = frozenset()  # operations whose out-of-contract calls are not sent
    recycles_buffers: ClassVar[bool] = True  # see "Buffer ownership" in the module docstring
    last_steps: ClassVar[tuple[str, ...]] = ()
    runs: ClassVar[int] = 0
    steps_explored: ClassVar[int] = 0
    checks: ClassVar[Counter[Invariant]]
    reached: ClassVar[list[frozenset[str]]]  # the events of each example (the score: bench_exploration)
    operations: ClassVar[Counter[str]]  # examples in which each operation was called

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[str] = []
        self.buffers: list[list[Any]] = []  # lists handed over and overwritten, to carry the next call's
        self.called: set[str] = set()
        type(self).runs += 1

    @classmethod
    def bind(
        cls: type[M],
        implementation: Implementation,
        *,
        only: frozenset[Invariant] | None = None,
        known: frozenset[Invariant] = frozenset(),
        spared: frozenset[str] | None = None,
    ) -> type[M]:
        """This machine against ``implementation``.

        ``only``: check only these invariants.  ``known``: discard the examples that break these.
        ``spared``: the operations whose out-of-contract calls are not sent (default: every one to an
        implementation that trusts its caller, none to another).
        """
        if spared is None:
            spared = EVERY_OPERATION if implementation.conventions.trusts_caller else frozenset()
        namespace: dict[str, Any] = {
            "implementation": implementation,
            "only": only,
            "known": known,
            "spared": spared,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "checks": Counter(),
            "reached": [],
            "operations": Counter(),
        }
        return type(cls.__name__, (cls,), namespace)

    @property
    def conventions(self) -> Any:
        return self.implementation.conventions

    def subject(
        self, name: str, spec: ModuleType | None, model: Any, impl: Any, snapshot: Callable[[], object] | None = None
    ) -> Subject:
        return Subject(self, name, spec, model, impl, snapshot)

    def record(self, text: str) -> None:
        self.steps.append(text)
        type(self).steps_explored += 1

    def check(self, rule: Invariant, *args: Any, operation: str = "") -> None:
        """Evaluate ``rule`` on ``args``; raise if it does not hold (discard the example if it is known)."""
        if self.only is not None and rule not in self.only:
            return
        type(self).checks[rule] += 1
        problem = rule(*args)
        if problem is None:
            return
        if rule in self.known:
            assume(False)
        raise InvariantViolation(rule, problem, operation)

    def check_group(self, group: Group, *args: Any) -> None:
        for rule, arguments in group.evaluations(*args):
            self.check(rule, *arguments)

    def dispatch(
        self, subject: Subject, operation: str, args: tuple[Any, ...], judged_by: Invariant | None, note: str
    ) -> Answer | None:
        """One call on both sides, checked; see the module docstring."""
        label = f"{subject.name}.{operation}({', '.join(map(repr, args))})" + (f"  # {note}" if note else "")
        self.called.add(operation)
        subjects = [subject, *(arg for arg in args if isinstance(arg, Subject))]
        lent: list[list[Any]] = []
        impl_args = [arg.impl if isinstance(arg, Subject) else self.lend(arg, lent) for arg in args]
        if subject.spec is None:
            self.record(label)
            try:
                return Answer(None, self.take_back(getattr(subject.impl, operation)(*impl_args)))
            finally:
                self.overwrite(lent)
        try:
            model_args = [arg.model if isinstance(arg, Subject) else arg for arg in args]
            result, spec_error = getattr(subject.spec, operation)(subject.model, *model_args), None
        except KVSpecError as error:
            result, spec_error = None, error
        out_of_contract = isinstance(spec_error, InvalidOperation)
        if out_of_contract and (self.spared == EVERY_OPERATION or operation in self.spared):
            self.overwrite(lent)
            return None
        self.record(label)

        def snapshots() -> object:
            return subjects[0].snapshot() if len(subjects) == 1 else tuple(s.snapshot() for s in subjects)

        before = snapshots()
        try:
            actual, impl_error = getattr(subject.impl, operation)(*impl_args), None
        except Exception as error:  # an untyped error is a verdict too: the wrong one
            actual, impl_error = None, error
        self.overwrite(lent)
        actual = self.take_back(actual)
        if out_of_contract:
            rejected = (verdict(spec_error), verdict(impl_error), before, snapshots())
            self.check(invariant_out_of_contract_call_rejected, *rejected, operation=operation)
            event(f"{operation} out of contract, rejected")
            return None
        self.check(invariant_verdict_matches_spec, verdict(spec_error), verdict(impl_error))
        if impl_error is not None:
            event(f"{operation} rejected with {verdict(impl_error)}")
            self.check(invariant_failed_operation_changes_nothing, before, snapshots())
            return None
        if spec_error is not None:  # the verdicts differ, and only other invariants are checked
            return None
        states, expected = split_result(result, [s.model for s in subjects])
        for s, state in zip(subjects, states, strict=True):
            s.model = state
        if judged_by is not None:
            self.check(judged_by, expected, actual)
        return Answer(expected, actual)

    def lend(self, value: Any, lent: list[list[Any]]) -> Any:
        """``value`` as the implementation gets it: each list (in lists and tuples too) in a reused buffer."""
        if not self.recycles_buffers or not isinstance(value, list | tuple):
            return value
        items = [self.lend(item, lent) for item in value]
        if isinstance(value, tuple):
            return tuple(items)
        if self.buffers:
            event("caller recycled a list it had handed over")
        buffer = self.buffers.pop() if self.buffers else []
        buffer[:] = items
        lent.append(buffer)
        return buffer

    def overwrite(self, lent: list[list[Any]]) -> None:
        """The caller reuses what it handed over: every item overwritten, each buffer kept for the next call."""
        for buffer in lent:
            buffer[:] = [OVERWRITTEN] * len(buffer)
        self.buffers += reversed(lent)

    def take_back(self, answer: Any) -> Any:
        """The caller's copy of an answered list; the list itself is overwritten, as the caller may."""
        if not self.recycles_buffers or type(answer) is not list:
            return answer
        mine = list(answer)
        answer[:] = [OVERWRITTEN] * len(answer)
        return mine

    def teardown(self) -> None:
        type(self).last_steps = tuple(self.steps)
        type(self).operations.update(self.called)
        type(self).reached.append(frozenset(map(str, getattr(current_build_context().data, "events", {}))))


def split_result(result: Any, models: list[Any]) -> tuple[list[Any], Any]:
    """A transition's result as (the subjects' new states, the answer).

    A transition returns its subjects' new states first (one per subject, in order), then at most one
    answer; a query returns only the answer and leaves the states as they were.
    """
    state_type = type(models[0])
    if isinstance(result, state_type):
        return [result], None
    if isinstance(result, tuple) and result and isinstance(result[0], state_type):
        states, rest = list(result[: len(models)]), result[len(models) :]
        return states, rest[0] if len(rest) == 1 else (rest or None)
    return models, result


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
class Finding:
    """One violated invariant: what broke, on which call, and the shrunk sequence that shows it."""

    invariant: Invariant | None  # None: the machine itself failed (an uncaught error)
    detail: str
    operation: str
    steps: tuple[str, ...]


@attrs.frozen
class Outcome:
    """One run of one machine against one implementation: its first finding (if any) and what it checked."""

    machine: str
    finding: Finding | None
    runs: int
    steps_explored: int
    checks: dict[Invariant, int]
    unsatisfiable: bool = False  # every example broke a known invariant: nothing more could be reached

    @property
    def held(self) -> bool:
        return self.finding is None


def run_machine(
    machine: type[LockstepMachine],
    implementation: Implementation,
    settings: Settings | None = None,
    *,
    only: frozenset[Invariant] | None = None,
    known: frozenset[Invariant] = frozenset(),
    spared: frozenset[str] | None = None,
) -> Outcome:
    """Run ``machine`` against ``implementation``; its first invariant violated, shrunk."""
    bound = machine.bind(implementation, only=only, known=known, spared=spared)
    settings = conformance_settings(settings)
    phases = [phase for phase in settings.phases if phase is not Phase.explain]  # slow, and adds nothing here
    settings = Settings(settings, report_multiple_bugs=False, phases=phases)
    finding, unsatisfiable = None, False
    try:
        run_state_machine_as_test(bound, settings=settings)
    except InvariantViolation as violation:
        finding = Finding(violation.invariant, violation.detail, violation.operation, bound.last_steps)
    except Unsatisfiable:
        unsatisfiable = True
    except (Flaky, Exception) as error:
        finding = Finding(None, f"{type(error).__name__}: {error}", "", bound.last_steps)
    return Outcome(
        machine=machine.__name__,
        finding=finding,
        runs=bound.runs,
        steps_explored=bound.steps_explored,
        checks=dict(bound.checks),
        unsatisfiable=unsatisfiable,
    )
