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

import re
import sys
import traceback
import unittest
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, assume, event, reproduce_failure
from hypothesis import settings as Settings
from hypothesis.control import current_build_context
from hypothesis.errors import DidNotReproduce, Flaky, HypothesisException, Unsatisfiable
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, run_state_machine_as_test

if __name__ != "kvspec.properties.harness":  # a second copy would bind machines and file findings of its own
    raise ImportError(f"import kvspec.properties.harness, not {__name__}: kvspec is installed as one namespace")

from kvspec.spec.components import DeclarationError
from kvspec.spec.errors import InvalidOperation, KVSpecError, verdict
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import (
    REGISTRY,
    TIERS,
    Group,
    Invariant,
    InvariantViolation,
    invariant_answer_not_changed_later,
    invariant_failed_operation_changes_nothing,
    invariant_no_untyped_error,
    invariant_out_of_contract_call_rejected,
    invariant_result_matches_spec,
    invariant_verdict_matches_spec,
)

Variant = tuple[str, str]  # an out-of-contract call's operation and its kind (``variant_of``); "" is every kind
EVERY_OPERATION: frozenset[Variant] = frozenset({("*", "")})  # spared: no out-of-contract call is sent
OVERWRITTEN = -1  # what the caller writes over a list it has handed over: no token, block or id
KVSPEC_SOURCES = (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "spec"))

M = TypeVar("M", bound="LockstepMachine")


class SafetyViolation(InvariantViolation):
    """A finding filed under safety."""


class CallerContractViolation(InvariantViolation):
    """A finding filed under the caller contract."""


class ConventionViolation(InvariantViolation):
    """A finding filed under the declared conventions."""


VIOLATION_OF_TIER: Mapping[str, type[InvariantViolation]] = dict(
    zip(TIERS, (SafetyViolation, CallerContractViolation, ConventionViolation), strict=True)
)
_VIOLATION_CLASSES: dict[tuple[str, str, str], type[InvariantViolation]] = {}


def violation_class(rule: Invariant, operation: str, variant: str) -> type[InvariantViolation]:
    """One exception class per distinct finding (rule, and for a contract rule its call's kind): Hypothesis
    tells failures apart by class, so one run finds and shrinks each distinct finding on its own, and a
    shrink never slips from one tier's finding to another's."""
    key = (rule.name, operation, variant) if rule.tier == "caller contract" else (rule.name, "", "")
    if key not in _VIOLATION_CLASSES:
        name = f"{VIOLATION_OF_TIER[rule.tier].__name__}[{' '.join(filter(None, key))}]"
        _VIOLATION_CLASSES[key] = type(name, (VIOLATION_OF_TIER[rule.tier],), {"__module__": __name__})
    return _VIOLATION_CLASSES[key]


SEQUENCE_VALUE = re.compile(r"\((?:[^()]|\(\.\.\.\))*,(?:[^()]|\(\.\.\.\))*\)|\[[^\[\]]*\]")  # a tuple, a list
NAMED_BY_NUMBER = "block|blocks|page|pages|slot|seq|sequence|request|node|group|sample|key"


def variant_of(error: BaseException) -> str:
    """The kind of an out-of-contract call: the spec's reason with its values blurred by sign and shape
    (``cannot allocate -1 blocks`` and ``cannot allocate -5 blocks`` are one kind, ``... 0 blocks`` another;
    a name -- ``block 0``, ``sequence 3`` -- is blurred whatever its value: block 0 is no edge case; a key
    or a list is one value, whatever it holds)."""

    def blur(number: re.Match[str]) -> str:
        value = float(number.group("value"))
        if not value.is_integer():
            return "x"
        name = number.group("name") or ""
        if value < 0:
            return f"{name}-n"
        return f"{name}{'0' if value == 0 and not name else 'n'}"

    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'s'", str(error))
    text = re.sub(rf"(?P<name>\b(?:{NAMED_BY_NUMBER}) )?(?P<value>-?\d+(?:\.\d+)?)", blur, text)
    # a key or a list of blocks is one value, whatever it holds: (n, 0, n) and (0,) name one kind of call
    collapsed = None
    while collapsed != text:
        collapsed, text = text, SEQUENCE_VALUE.sub(lambda m: m.group()[0] + "..." + m.group()[-1], text)
    return text


@attrs.frozen
class Answer:
    """What one call answered: the model's expectation and the implementation's answer."""

    expected: Any
    actual: Any


@attrs.frozen
class Failure:
    """One rule that did not hold during a step, before the step's finding is filed."""

    invariant: Invariant
    detail: str
    operation: str
    variant: str = ""


Specs = ModuleType | tuple[ModuleType, ...]  # the spec module(s) that model a subject


class Subject:
    """An implementation object driven in lockstep with the spec module that models it.

    ``spec`` may be several modules: a layer and those that add operations to
    its component (the block manager and ``spec.tiered_swap``); an operation's
    transition is the first module's that has it.  ``model`` is the model's
    current state (None: no model, the implementation runs alone and every
    call is only recorded); ``snapshot`` reads the implementation's abstract
    state (default: its ``snapshot()``).
    """

    def __init__(
        self,
        machine: LockstepMachine,
        name: str,
        spec: Specs | None,
        model: Any,
        impl: Any,
        snapshot: Callable[[], Any] | None = None,
    ) -> None:
        self.machine, self.name, self.spec, self.model, self.impl = machine, name, spec, model, impl
        self.snapshot: Callable[[], Any] = snapshot or (lambda: impl.snapshot())  # the state's type is the layer's

    def __repr__(self) -> str:
        return self.name

    def transition(self, operation: str) -> Callable[..., Any]:
        """The spec's function for ``operation``."""
        modules = (self.spec,) if isinstance(self.spec, ModuleType) else self.spec or ()
        for module in modules:
            if hasattr(module, operation):
                transition: Callable[..., Any] = getattr(module, operation)
                return transition
        raise AttributeError(f"no spec module of {self.name} models {operation!r}")

    def __call__(
        self, operation: str, *args: Any, judged_by: Invariant | None = invariant_result_matches_spec, note: str = ""
    ) -> Answer | None:
        """Run ``operation`` on both sides; None when it was refused (or, out of contract, not sent)."""
        return self.machine._dispatch(self, operation, args, judged_by, note)


@attrs.define
class Statistics:
    """What the runs of one bound machine saw (each bound machine has its own)."""

    examples: int = 0
    steps: int = 0
    checks: Counter[Invariant] = attrs.field(factory=Counter)
    checks_after_known: Counter[Invariant] = attrs.field(factory=Counter)  # made after a known finding
    examples_after_known: int = 0
    reached: list[frozenset[str]] = attrs.field(factory=list)  # the events of each example (bench_exploration)
    operations: Counter[str] = attrs.field(factory=Counter)  # examples in which each operation was called


class LockstepMachine(RuleBasedStateMachine):
    """Base of every conformance machine; see the module docstring.

    A machine says which components it builds (``uses``), which optional
    operations it cannot run without (``requires``) and which layers' rules it
    checks (``judges``); against an implementation that does not offer what it
    requires it does not run.  Its rules reach optional operations through
    ``offers`` (a rule's precondition).

    Its rules, invariants and helpers may take any name but the harness's
    (``RESERVED``: ``subject``, ``check``, ``record``, ... and Hypothesis's),
    which ``bind`` refuses in one line; the harness keeps its own state in
    ``_`` names.
    """

    implementation: ClassVar[Implementation]
    uses: ClassVar[frozenset[str]] = frozenset()  # the component kinds it builds
    requires: ClassVar[Mapping[str, frozenset[str]]] = {}  # kind -> the optional operations it cannot run without
    judges: ClassVar[tuple[str, ...]] = ()  # the spec layers whose rules it checks, its own first
    _only: ClassVar[frozenset[Invariant] | None] = None
    _known: ClassVar[frozenset[Invariant]] = frozenset()
    _spared: ClassVar[frozenset[Variant]] = frozenset()  # out-of-contract calls not sent
    _probing: ClassVar[Variant | None] = None  # the one out-of-contract call sent, to see what it leads to
    recycles_buffers: ClassVar[bool] = True  # see "Buffer ownership" in the module docstring
    statistics: ClassVar[Statistics]
    _unoffered: ClassVar[frozenset[Invariant]] = frozenset()  # rules whose every needed operation is left out

    def __init__(self) -> None:
        super().__init__()
        self._steps: list[str] = []  # the calls recorded, as a failure prints them
        self._buffers: list[list[Any]] = []  # lists handed over and overwritten, to carry the next call's
        self._answers: list[tuple[list[Any], list[Any], str, int]] = []  # answered list, caller's copy, call, step
        self._failures: list[Failure] = []
        self._steps_at_release: int | None = None  # calls recorded when the last step ended
        self._after_known = False  # a known finding happened in this example: only safety is checked now
        self._accepted_at: int | None = None  # calls made when the probed out-of-contract call was accepted
        self._called: set[str] = set()
        type(self).statistics.examples += 1

    @classmethod
    def bind(
        cls: type[M],
        implementation: Implementation,
        *,
        only: frozenset[Invariant] | None = None,
        known: frozenset[Invariant] = frozenset(),
        spared: frozenset[Variant] | None = None,
        probing: Variant | None = None,
    ) -> type[M]:
        """This machine against ``implementation``.

        ``only``: check only these invariants.  ``known``: findings already made; an example that breaks
        one of them goes on checking safety alone (a known safety finding discards it).  ``spared``: the
        out-of-contract calls not sent, as (operation, kind) (default: every one to an implementation that
        trusts its caller, none to another).  ``probing``: send only this kind of out-of-contract call, and
        after the implementation accepts one, check safety alone: what breaks is its consequence.
        """
        check_names(cls)
        if spared is None:
            spared = EVERY_OPERATION if implementation.conventions.trusts_caller else frozenset()
        namespace: dict[str, Any] = {
            "_bound": True,
            "implementation": implementation,
            "_only": only,
            "_known": known,
            "_spared": spared,
            "_probing": probing,
            "statistics": Statistics(),
            "_unoffered": unoffered(implementation),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        return type(cls.__name__, (cls,), namespace)

    @classmethod
    def not_offered(cls, implementation: Implementation) -> str:
        """Why this machine cannot run against ``implementation`` ("" when it can)."""
        absent = sorted(kind for kind in cls.uses if kind not in implementation.offers())
        if absent:
            return f"not offered: no {', '.join(absent)}"
        missing = [
            f"{kind}.{operation}"
            for kind, operations in cls.requires.items()
            for operation in sorted(operations)
            if not implementation.offers_operation(kind, operation)
        ]
        return f"not offered: needs {', '.join(missing)}" if missing else ""

    @property
    def conventions(self) -> Any:
        return self.implementation.conventions

    def offers(self, kind: str, operation: str) -> bool:
        """Whether the implementation under test offers ``kind``'s optional ``operation``."""
        return self.implementation.offers_operation(kind, operation)

    def subject(
        self, name: str, spec: Specs | None, model: Any, impl: Any, snapshot: Callable[[], Any] | None = None
    ) -> Subject:
        return Subject(self, name, spec, model, impl, snapshot)

    def record(self, text: str) -> None:
        self._steps.append(text)
        type(self).statistics.steps += 1

    # -- checking ---------------------------------------------------------------------

    def check(
        self, rule: Invariant, *args: Any, operation: str = "", variant: str = "", against_model: bool = False
    ) -> None:
        """Evaluate ``rule`` on ``args``; a failure is filed at the end of the step, under the highest tier.

        ``against_model``: the arguments include the model's expectation, which stops meaning anything once
        the example has broken a known rule (the model and the implementation have parted).
        """
        if (self._only is not None and rule not in self._only) or rule in self._unoffered:
            return
        if self._after_known and (rule.tier != "safety" or against_model):
            return
        statistics = type(self).statistics
        (statistics.checks_after_known if self._after_known else statistics.checks)[rule] += 1
        problem = rule(*args)
        if problem is not None:
            self._failures.append(Failure(rule, problem, operation, variant))

    def check_group(self, group: Group, *args: Any) -> None:
        for rule, arguments in group.evaluations(*args):
            self.check(rule, *arguments)

    def check_invariants(self, settings: Settings, output: Callable[[str], object], runtimes: Any) -> None:
        """Hypothesis's end of a step: the machine's invariants, then the step's finding, if any, is filed."""
        super().check_invariants(settings, output, runtimes)
        self._release_answers()
        self._file_findings()

    def _file_findings(self) -> None:
        """Raise the step's finding under the highest tier that failed, naming the others as consequences.

        An implementation that trusts its caller is not answerable for what an out-of-contract call does:
        at a step where it accepted one, that call is the finding and the rest are its consequences.  When
        every rule that failed is already known: a known safety finding discards the example (its state is
        past the rules still to find); any other goes on checking safety alone.
        """
        failures, self._failures = self._failures, []
        fresh = [f for f in failures if not self._is_known(f)]
        if not fresh:
            if any(f.invariant.tier == "safety" for f in failures):
                assume(False)
            if failures and not self._after_known:
                self._after_known = True
                type(self).statistics.examples_after_known += 1
                event("broke a known rule: checking safety alone from here")
            return
        trusted = self.implementation.conventions.trusts_caller
        top = min(fresh, key=lambda f: (not (trusted and f.invariant.tier == "caller contract"), tier_rank(f)))
        consequences = tuple((f.invariant, f.detail) for f in failures if f is not top)
        after = None if self._accepted_at is None else len(self._steps) - self._accepted_at
        cls = violation_class(top.invariant, top.operation, top.variant)
        raise cls(top.invariant, top.detail, top.operation, consequences, tuple(self._steps), top.variant, after)

    def _is_known(self, failure: Failure) -> bool:
        """Known already: the rule was found, or it is the probed out-of-contract call being accepted."""
        probed = (failure.operation, failure.variant) == self._probing
        return (
            failure.invariant is invariant_out_of_contract_call_rejected and probed
        ) or failure.invariant in self._known

    # -- one call on both sides ---------------------------------------------------------

    def _dispatch(
        self, subject: Subject, operation: str, args: tuple[Any, ...], judged_by: Invariant | None, note: str
    ) -> Answer | None:
        """One call on both sides, checked; see the module docstring."""
        label = f"{subject.name}.{operation}({', '.join(map(repr, args))})" + (f"  # {note}" if note else "")
        self._called.add(operation)
        subjects = [subject, *(arg for arg in args if isinstance(arg, Subject))]
        lent: list[list[Any]] = []
        impl_args = [arg.impl if isinstance(arg, Subject) else self._lend(arg, lent) for arg in args]
        if subject.spec is None:
            self.record(label)
            try:
                return Answer(None, self._take_back(getattr(subject.impl, operation)(*impl_args), label))
            finally:
                self._overwrite(lent)
        try:
            model_args = [arg.model if isinstance(arg, Subject) else arg for arg in args]
            result, spec_error = subject.transition(operation)(subject.model, *model_args), None
        except KVSpecError as error:
            result, spec_error = None, error
        out_of_contract = isinstance(spec_error, InvalidOperation)
        variant = variant_of(spec_error) if spec_error is not None and out_of_contract else ""
        if out_of_contract and self._spares(operation, variant):
            self._overwrite(lent)
            return None
        self.record(label)

        def snapshots() -> object:
            return subjects[0].snapshot() if len(subjects) == 1 else tuple(s.snapshot() for s in subjects)

        before = snapshots()
        try:
            actual, impl_error = getattr(subject.impl, operation)(*impl_args), None
        except HypothesisException:  # Hypothesis's own (a frozen example past its deadline): never the engine's
            raise
        except Exception as error:  # an untyped error is a verdict too: a crash
            actual, impl_error = None, error
        self._overwrite(lent)
        actual = self._take_back(actual, label)
        self._watch_answers(label)
        if out_of_contract:
            answered = verdict(impl_error) if typed(impl_error) else crash_report(impl_error)
            rejected = (verdict(spec_error), answered, before, snapshots())
            self.check(invariant_out_of_contract_call_rejected, *rejected, operation=operation, variant=variant)
            event(f"{operation} out of contract, rejected")
            if impl_error is not None:
                return None
            if self._probing == (operation, variant) and self._accepted_at is None:
                self._accepted_at, self._after_known = len(self._steps), True
            # What a trusting implementation accepted, its caller now holds: the caller follows it.
            return Answer(actual, actual) if self._after_known or self.conventions.trusts_caller else None
        if not typed(impl_error):
            self.check(invariant_no_untyped_error, crash_report(impl_error), operation=operation)
            return None
        self.check(invariant_verdict_matches_spec, verdict(spec_error), verdict(impl_error))
        if impl_error is not None:
            event(f"{operation} rejected with {verdict(impl_error)}")
            self.check(invariant_failed_operation_changes_nothing, before, snapshots())
            return None
        if spec_error is not None:  # the verdicts differ: after a known finding the caller follows the implementation
            return Answer(actual, actual) if self._after_known else None
        states, expected = split_result(result, [s.model for s in subjects])
        for s, state in zip(subjects, states, strict=True):
            s.model = state
        if judged_by is not None:
            self.check(judged_by, expected, actual, against_model=True)
        return Answer(expected, actual)

    def _spares(self, operation: str, variant: str) -> bool:
        """Whether this out-of-contract call is not sent (see ``bind``)."""
        if self._probing is not None:
            return (operation, variant) != self._probing
        spared = self._spared
        return bool(spared) and (
            spared == EVERY_OPERATION or (operation, "") in spared or (operation, variant) in spared
        )

    # -- buffer ownership ---------------------------------------------------------------

    def _lend(self, value: Any, lent: list[list[Any]]) -> Any:
        """``value`` as the implementation gets it: each list (in lists and tuples too) in a reused buffer."""
        if not self.recycles_buffers or not isinstance(value, list | tuple):
            return value
        items = [self._lend(item, lent) for item in value]
        if isinstance(value, tuple):
            return tuple(items)
        if self._buffers:
            event("caller recycled a list it had handed over")
        buffer = self._buffers.pop() if self._buffers else []
        buffer[:] = items
        lent.append(buffer)
        return buffer

    def _overwrite(self, lent: list[list[Any]]) -> None:
        """The caller reuses what it handed over: every item overwritten, each buffer kept for the next call."""
        for buffer in lent:
            buffer[:] = [OVERWRITTEN] * len(buffer)
        self._buffers += reversed(lent)

    def _take_back(self, answer: Any, call: str) -> Any:
        """The caller's copy of an answered list; the list itself is watched until the next step ends."""
        if not self.recycles_buffers or type(answer) is not list:
            return answer
        mine = list(answer)
        self._answers.append((answer, list(answer), call, len(self._steps)))
        return mine

    def _watch_answers(self, by: str) -> None:
        for answered, kept, call, _ in self._answers:
            self.check(invariant_answer_not_changed_later, answered, kept, call, by)

    def _release_answers(self) -> None:
        """A step is over: the caller reuses the lists it was answered before it, as buffers of its next calls."""
        step = len(self._steps)
        if self._steps_at_release is not None:
            for answered, _, _, at in self._answers:
                if at <= self._steps_at_release:
                    answered[:] = [OVERWRITTEN] * len(answered)
                    self._buffers.append(answered)
            self._answers = [entry for entry in self._answers if entry[3] > self._steps_at_release]
        self._steps_at_release = step

    def teardown(self) -> None:
        statistics = type(self).statistics
        statistics.operations.update(self._called)
        statistics.reached.append(frozenset(map(str, getattr(current_build_context().data, "events", {}))))
        in_flight = sys.exc_info()[1]  # what ended the example, if it did not end well
        if self._failures and not isinstance(in_flight, InvariantViolation):
            self._file_findings()  # the rules that failed before the step crashed are its finding
        crashed = isinstance(in_flight, Exception) and not isinstance(in_flight, InvariantViolation)
        if crashed and self._after_known:
            assume(False)  # past a known finding the machine follows a model that has parted: spare the example
        if crashed:
            try:
                setattr(in_flight, STEPS_OF_A_CRASH, tuple(self._steps))
            except AttributeError:  # an exception type without a __dict__: its finding comes without steps
                pass


def tier_rank(failure: Failure) -> int:
    return TIERS.index(failure.invariant.tier)


OVERRIDABLE = frozenset({"uses", "requires", "judges", "recycles_buffers", "teardown"})  # a machine's to set
RESERVED = (
    frozenset(name for name in dir(LockstepMachine) if not name.startswith("__")) | {"implementation", "statistics"}
) - OVERRIDABLE
"""The harness's names, and Hypothesis's: a machine that defines one (a rule named ``record``, ``check``, ``subject``)
would replace what the harness calls.  ``bind`` refuses such a machine in one line."""


def check_names(machine: type[LockstepMachine]) -> None:
    """Refuse a machine that defines a name the harness reserves (``RESERVED``), before anything runs."""
    own = {name for klass in machine.__mro__ if is_written(klass) for name in vars(klass)}
    clashes = sorted(own & RESERVED)
    if clashes:
        raise TypeError(
            f"{machine.__qualname__} defines {', '.join(clashes)}: reserved by LockstepMachine or Hypothesis, rename it"
        )


def is_written(klass: type) -> bool:
    """A machine class a person wrote: below ``LockstepMachine``, not a class ``bind`` made."""
    return issubclass(klass, LockstepMachine) and klass is not LockstepMachine and not vars(klass).get("_bound")


def unoffered(implementation: Implementation) -> frozenset[Invariant]:
    """The rules no machine reaches against ``implementation``: it offers none of the operations each needs."""
    return frozenset(rule for rule in REGISTRY.values() if not offers_any(implementation, rule.needs))


def offers_any(implementation: Implementation, needs: tuple[str, ...]) -> bool:
    """Whether ``implementation`` offers one of ``needs`` ("kind.operation"); a rule that needs nothing, yes."""
    return not needs or any(implementation.offers_operation(*need.split(".", 1)) for need in needs)


STEPS_OF_A_CRASH = "_kvspec_steps"  # the calls made before an uncaught error, attached to it by ``teardown``


def typed(error: BaseException | None) -> bool:
    return error is None or isinstance(error, KVSpecError)


def crash_report(error: BaseException | None) -> str:
    """An untyped error as a finding states it: class, message and the frame that raised it."""
    assert error is not None
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame else ""
    return f"{type(error).__name__}: {error}{where}"


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
    ``--kv-impl`` names (``kvspec.pytest_plugin``): nothing is bound at import time.  A machine
    the implementation does not offer what it needs for (``not_offered``) is skipped, with why.
    """

    machine: type[LockstepMachine]
    examples: float = 1.0  # scales the profile's example count, for machines whose steps are costly

    def bind(self, implementation: Implementation, base: Settings | None = None) -> type:
        test: type[Any] = self.machine.bind(implementation).TestCase
        test.settings = conformance_settings(base, self.examples)
        reason = self.machine.not_offered(implementation)
        return unittest.skip(reason)(test) if reason else test


def conformance_test(machine: type[LockstepMachine], examples: float = 1.0) -> ConformanceTest:
    return ConformanceTest(machine, examples)


@attrs.frozen
class Finding:
    """One finding: the rule that broke (None: kvspec's own machine failed), on which call, and how."""

    invariant: Invariant | None
    detail: str
    operation: str
    steps: tuple[str, ...]
    consequences: tuple[tuple[Invariant, str], ...] = ()
    variant: str = ""  # a contract finding's kind of call
    after_steps: int | None = None  # under a probe: calls between the accepted out-of-contract call and this
    blob: str = ""  # "hypothesis version:choices" of the shrunk example, for ``replay``

    @property
    def tier(self) -> str:
        return self.invariant.tier if self.invariant else "harness"


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
        return min(self.findings, key=lambda f: (TIERS + ("harness",)).index(f.tier), default=None)


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


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for error in group.exceptions:
        found += leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return found


def finding_of(error: BaseException) -> Finding:
    """A finding from what ended a failing example: a violation, a crash of the implementation, or of kvspec."""
    if isinstance(error, InvariantViolation):
        return Finding(
            error.invariant,
            error.detail,
            error.operation,
            error.steps,
            error.consequences,
            error.variant,
            error.after_steps,
        )
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    innermost = frames[-1].filename if frames else ""
    steps = getattr(error, STEPS_OF_A_CRASH, ())
    # Hypothesis's own (flaky data generation when an engine's timing steers the draws) is never the engine's
    engine_frame = innermost and not str(Path(innermost).resolve()).startswith(KVSPEC_SOURCES)
    if engine_frame and not isinstance(error, HypothesisException):
        return Finding(invariant_no_untyped_error, crash_report(error), "", steps)  # the implementation crashed
    return Finding(None, crash_report(error), "", steps)
