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

Buffer ownership (``recycles_buffers``): the caller owns every list it hands
over and is handed back, as an engine that recycles its buffers does
(``properties/buffers.py``).

Safety is judged on the implementation, never on the model.  A safety rule
reads only the implementation's own snapshots and answers and the caller's
*ledger*: what the machine holds (blocks, sequences, pages, locks, pins,
leases, transfers) and what it wrote where, kept from the calls it made and
what the implementation answered.  So a call the implementation carries
out is answered to the caller whatever the model said (``Answer(actual,
actual)`` where the model refused it): the ledger follows the
implementation.  Where the two part -- a call the model refused that the
implementation carried out, answers that differ (a rule judged
``against_model``), a known finding -- the model is set aside for the rest
of the example: only safety is checked from there.  A safety rule handed
the model, or ``against_model``, is kvspec's bug (``TypeError``);
``properties/meta/provenance.py`` reads the machines' source for values
derived from the model reaching a safety rule.  What a declared convention
lets a refused call change (``Subject.refusal_view``) is left out of the
comparison of its states before and after.

The line each call records is made from the call itself, so the operation
sequence a failure prints is exactly the calls that ran.  Invariants are
``spec`` objects, checked one by one (``check``) or by group
(``check_group``).  A machine can be bound to check ``only`` some invariants
(the meta-tests prove each able to fail alone) or to discard the examples
that break ``known`` ones (a verdict's reruns look past what it has found).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import attrs
from hypothesis import assume, event
from hypothesis import settings as Settings
from hypothesis.control import current_build_context
from hypothesis.errors import HypothesisException
from hypothesis.stateful import RuleBasedStateMachine

if __name__ != "kvspec.properties.harness":  # a second copy would bind machines and file findings of its own
    raise ImportError(f"import kvspec.properties.harness, not {__name__}: kvspec is installed as one namespace")

from kvspec.properties.buffers import CallerBuffers
from kvspec.properties.findings import (
    STEPS_OF_A_CRASH,
    Failure,
    crash_report,
    tier_rank,
    typed,
    variant_of,
    violation_class,
)
from kvspec.properties.reserved import check_names
from kvspec.properties.subjects import Answer, Specs, Subject, compared, refusal_views, split_result
from kvspec.properties.transcript import AnsweredDifferently, Transcript
from kvspec.spec.components import Operation, check_operation
from kvspec.spec.errors import InvalidOperation, KVSpecError, verdict
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import (
    Group,
    Invariant,
    InvariantViolation,
    invariant_answer_not_changed_later,
    invariant_failed_operation_changes_nothing,
    invariant_no_untyped_error,
    invariant_out_of_contract_call_rejected,
    invariant_verdict_matches_spec,
)

Variant = tuple[str, str]  # an out-of-contract call's operation and its kind (``variant_of``); "" is every kind
EVERY_OPERATION: frozenset[Variant] = frozenset({("*", "")})  # spared: no out-of-contract call is sent

M = TypeVar("M", bound="LockstepMachine")


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


@attrs.frozen
class GroupPlan:
    """How one binding evaluates a group: the rules it counts (with each one's arity and whether it is a safety
    rule), the included groups' plans, and whether any rule of the group, counted or not, is a safety rule (the
    arguments are then searched for a model, as ``check`` searches them)."""

    group: Group
    counted: tuple[tuple[Invariant, int, bool], ...]
    parts: tuple[tuple[GroupPlan, Callable[..., tuple[Any, ...]]], ...]
    safety: bool

    @classmethod
    def of(cls, group: Group, counts: Callable[[Invariant], bool]) -> GroupPlan:
        return cls(
            group,
            tuple((rule, rule.arity, rule.tier == "safety") for rule in group.members if counts(rule)),
            tuple((cls.of(part, counts), view) for part, view in group.parts),
            any(rule.tier == "safety" for rule in group.members),
        )


class LockstepMachine(RuleBasedStateMachine):
    """Base of every conformance machine; see the module docstring.

    A machine says which components it builds (``uses``), which optional
    operations it cannot run without (``requires``) and which layers' rules it
    checks (``judges``); against an implementation that does not offer what it
    requires it does not run.  Its rules reach optional operations through
    ``offers`` (a rule's precondition).

    Its rules, invariants and helpers may take any name but the harness's
    (``reserved.names``: ``subject``, ``check``, ``record``, ... and Hypothesis's),
    which ``bind`` refuses in one line; the harness keeps its own state in
    ``_`` names.
    """

    implementation: ClassVar[Implementation]
    uses: ClassVar[frozenset[str]] = frozenset()  # the component kinds it builds
    requires: ClassVar[Mapping[str, frozenset[Operation]]] = {}  # kind -> the optional operations it cannot run without
    judges: ClassVar[tuple[str, ...]] = ()  # the spec layers whose rules it checks, its own first
    _only: ClassVar[frozenset[Invariant] | None] = None
    _known: ClassVar[frozenset[Invariant]] = frozenset()
    _spared: ClassVar[frozenset[Variant]] = frozenset()  # out-of-contract calls not sent
    _probing: ClassVar[Variant | None] = None  # the one out-of-contract call sent, to see what it leads to
    recycles_buffers: ClassVar[bool] = True  # see "Buffer ownership" in the module docstring
    statistics: ClassVar[Statistics]
    _answers: ClassVar[dict[int, str]] = {}  # the answer given after each history of calls (``Transcript``)
    _unoffered: ClassVar[frozenset[Invariant]] = frozenset()  # rules whose every needed operation is left out
    # What a bound machine asks at every step and whose answer its binding fixes, answered once per binding:
    _offered: ClassVar[dict[tuple[str, Operation], bool]] = {}  # (kind, operation) -> offered (``offers``)
    _counted: ClassVar[dict[int, tuple[Invariant, bool]]] = {}  # id of a rule -> the rule, and whether it counts
    _plans: ClassVar[dict[int, GroupPlan]] = {}  # id of a group -> how this binding evaluates it (``check_group``)

    def __init__(self) -> None:
        super().__init__()
        self._steps: list[str] = []  # the calls recorded, as a failure prints them
        self._caller = CallerBuffers(self.recycles_buffers)  # the lists it hands over and is handed back
        self._failures: list[Failure] = []
        # The model has parted from the implementation in this example -- a known finding, a call the model refused
        # that the implementation carried out, answers that differ: from here only safety is checked, and safety
        # reads only the implementation's own state and answers and the caller's ledger of what it holds.
        self._parted = False
        self._accepted_at: int | None = None  # calls made when the probed out-of-contract call was accepted
        self._called: set[str] = set()
        self._subjects: list[Subject] = []
        self._transcript = Transcript(type(self)._answers)
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
        check_names(cls, LockstepMachine)
        for kind, operations in cls.requires.items():
            for operation in operations:
                check_operation(kind, operation)
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
            "_answers": {},
            "_unoffered": implementation.rules_not_offered(),
            "_offered": {},
            "_counted": {},
            "_plans": {},
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        return type(cls.__name__, (cls,), namespace)

    @classmethod
    def not_offered(cls, implementation: Implementation) -> str:
        """Why this machine cannot run against ``implementation`` ("" when it can)."""
        absent = sorted(kind for kind in cls.uses if kind not in implementation.components)
        if absent:
            return f"not offered: no {', '.join(absent)}"
        missing = [
            f"{kind}.{operation}"
            for kind, operations in cls.requires.items()
            for operation in sorted(operations, key=str)
            if not implementation.offers_operation(kind, operation)
        ]
        return f"not offered: needs {', '.join(missing)}" if missing else ""

    @property
    def conventions(self) -> Any:
        return self.implementation.conventions

    def offers(self, kind: str, operation: Operation) -> bool:
        """Whether the implementation under test offers ``kind``'s optional ``operation``."""
        offered = self._offered.get((kind, operation))
        if offered is None:  # the rules' preconditions ask it at every step; the binding fixes the answer
            check_operation(kind, operation)
            offered = self._offered[kind, operation] = self.implementation.offers_operation(kind, operation)
        return offered

    def subject(self, name: str, spec: Specs | None, model: Any, impl: Any, **options: Any) -> Subject:
        """A subject of this machine (``Subject``: ``snapshot``, ``refusal_view`` and ``refinement`` by name)."""
        subject = Subject(self, name, spec, model, impl, **options)
        self._subjects.append(subject)
        return subject

    @property
    def calls(self) -> int:
        """The calls this example has sent so far (each counted as it is sent): a state read twice at one count,
        with nothing called in between, is read of one state."""
        return len(self._steps)

    def record(self, text: str) -> None:
        self._steps.append(text)
        self._transcript.called(text)
        type(self).statistics.steps += 1

    # -- checking ---------------------------------------------------------------------

    def check(
        self, rule: Invariant, *args: Any, operation: str = "", variant: str = "", against_model: bool = False
    ) -> None:
        """Evaluate ``rule`` on ``args``; a failure is filed at the end of the step, under the highest tier.

        ``against_model``: the arguments include the model's expectation (a convention rule comparing answers):
        its failure parts the model from the implementation, whether or not this run counts the rule.  A safety
        rule is never given the model (``TypeError``): it is judged on what the implementation did.
        """
        safety = rule.tier == "safety"
        if safety:
            self._judge_safety_on_the_implementation(rule, args, against_model)
        parted = self._parted
        if parted and not safety:
            return
        counted = self._counts(rule)
        if not counted and not against_model:
            return
        problem = rule.check(*args)
        if against_model and problem is not None:  # an answer that differs parts the model, counted or not
            self._part("the implementation answered otherwise than the model")
        if not counted:
            return
        statistics = type(self).statistics
        (statistics.checks_after_known if parted else statistics.checks)[rule] += 1
        if problem is not None:
            self._failures.append(Failure(rule, problem, operation, variant))

    def _counts(self, rule: Invariant) -> bool:
        """Whether this binding counts ``rule`` (``only``, and an operation it needs offered); asked once a rule."""
        known = self._counted.get(id(rule))
        if known is not None and known[0] is rule:
            return known[1]
        counted = (self._only is None or rule in self._only) and rule not in self._unoffered
        self._counted[id(rule)] = (rule, counted)  # the rule kept with its id, so that the id names it alone
        return counted

    def _judge_safety_on_the_implementation(self, rule: Invariant, args: tuple[Any, ...], against_model: bool) -> None:
        """A safety rule is judged on the implementation's own state and answers and the caller's ledger, never on
        the model: a model the implementation legitimately parted from would make a finding that is not true."""
        if against_model or self._holds_a_model(args):
            raise TypeError(f"{type(self).__qualname__} checks the safety rule {rule.name} against the model")

    def _holds_a_model(self, args: tuple[Any, ...]) -> bool:
        """Whether one of ``args`` is a subject's model (plain loops: this runs for every safety check)."""
        for subject in self._subjects:
            model = subject.model
            if model is not None:
                for arg in args:
                    if arg is model:
                        return True
        return False

    def _part(self, why: str) -> None:
        """The model and the implementation part here: only safety is checked from now on in this example."""
        if not self._parted:
            self._parted = True
            type(self).statistics.examples_after_known += 1
            event(f"model parted: {why}; checking safety alone from here")

    def check_group(self, group: Group, *args: Any) -> None:
        """Every rule of ``group`` on ``args``, as ``check`` evaluates each; a machine checks a layer's group at
        every step, so what ``check`` asks of each rule is answered once per binding (``GroupPlan``)."""
        plan = self._plans.get(id(group))
        if plan is None or plan.group is not group:
            plan = self._plans[id(group)] = GroupPlan.of(group, self._counts)
        self._evaluate(plan, args)

    def _evaluate(self, plan: GroupPlan, args: tuple[Any, ...]) -> None:
        if plan.safety and self._holds_a_model(args):  # rule by rule: ``check`` names the safety rule handed it
            for rule, arguments in plan.group.evaluations(*args):
                self.check(rule, *arguments)
            return
        parted = self._parted
        statistics = type(self).statistics
        counts = statistics.checks_after_known if parted else statistics.checks
        for rule, arity, safety in plan.counted:
            if parted and not safety:
                continue
            problem = rule.check(*args[:arity])
            counts[rule] += 1
            if problem is not None:
                self._failures.append(Failure(rule, problem, ""))
        for part, view in plan.parts:
            self._evaluate(part, view(*args))

    def check_invariants(self, settings: Settings, output: Callable[[str], object], runtimes: Any) -> None:
        """Hypothesis's end of a step: the machine's invariants, then the step's finding, if any, is filed."""
        super().check_invariants(settings, output, runtimes)
        self._caller.release(len(self._steps))
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
            if failures:
                self._part("broke a known rule")
            return
        trusted = self.implementation.conventions.trusts_caller
        top = min(fresh, key=lambda f: (not (trusted and f.invariant.tier == "caller contract"), tier_rank(f)))
        firsts = {f.invariant: f.detail for f in reversed(failures) if f.invariant is not top.invariant}
        consequences = tuple(
            (rule, firsts[rule]) for rule in dict.fromkeys(f.invariant for f in failures) if rule in firsts
        )
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
        impl_args = [arg.impl if isinstance(arg, Subject) else self._caller.lend(arg, lent) for arg in args]
        if subject.spec is None:
            self.record(label)
            try:
                alone = getattr(subject.impl, operation)(*impl_args)
            finally:
                self._caller.overwrite(lent)
            self._transcript.answered(label, alone, None, self._steps)
            return Answer(None, self._caller.take_back(alone, label, len(self._steps)))
        try:
            model_args = [arg.model if isinstance(arg, Subject) else arg for arg in args]
            result, spec_error = subject.transition(operation)(subject.model, *model_args), None
        except KVSpecError as error:
            result, spec_error = None, error
        out_of_contract = isinstance(spec_error, InvalidOperation)
        variant = variant_of(spec_error) if spec_error is not None and out_of_contract else ""
        if out_of_contract and self._spares(operation, variant):
            self._caller.overwrite(lent)
            return None
        self.record(label)
        views = refusal_views(subjects)
        before = compared(views)
        try:
            actual, impl_error = getattr(subject.impl, operation)(*impl_args), None
        except HypothesisException:  # Hypothesis's own (a frozen example past its deadline): never the engine's
            raise
        except Exception as error:  # an untyped error is a verdict too: a crash
            actual, impl_error = None, error
        self._caller.overwrite(lent)
        self._transcript.answered(label, actual, impl_error, self._steps)
        actual = self._caller.take_back(actual, label, len(self._steps))
        self._watch_answers(label)
        if out_of_contract and any(s.parted(seen) for s, seen in zip(subjects, views, strict=True)):
            self._part("the model had parted from the implementation's state before this call")
        if out_of_contract:
            answered = verdict(impl_error) if typed(impl_error) else crash_report(impl_error)
            rejected = (verdict(spec_error), answered, before, compared(refusal_views(subjects)))
            self.check(invariant_out_of_contract_call_rejected, *rejected, operation=operation, variant=variant)
            event(f"{operation} out of contract, rejected")
            if impl_error is not None:
                return None
            if self._probing == (operation, variant) and self._accepted_at is None:
                self._accepted_at = len(self._steps)
            # What the implementation carried out, its caller now holds: the caller's ledger follows it.
            self._part("the implementation carried out a call the model refused")
            return Answer(actual, actual)
        if not typed(impl_error):
            self.check(invariant_no_untyped_error, crash_report(impl_error), operation=operation)
            return None
        self.check(invariant_verdict_matches_spec, verdict(spec_error), verdict(impl_error))
        if impl_error is not None:
            event(f"{operation} rejected with {verdict(impl_error)}")
            self.check(invariant_failed_operation_changes_nothing, before, compared(refusal_views(subjects)))
            return None
        if spec_error is not None:  # the verdicts differ: the caller's ledger follows the implementation
            self._part("the implementation carried out a call the model refused")
            return Answer(actual, actual)
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

    def _watch_answers(self, by: str) -> None:
        for answered, kept, call, _ in self._caller.answers:
            self.check(invariant_answer_not_changed_later, answered, kept, call, by)

    def teardown(self) -> None:
        statistics = type(self).statistics
        statistics.operations.update(self._called)
        statistics.reached.append(frozenset(map(str, getattr(current_build_context().data, "events", {}))))
        in_flight = sys.exc_info()[1]  # what ended the example, if it did not end well
        if isinstance(in_flight, HypothesisException) or not isinstance(in_flight, Exception | None):
            return  # Hypothesis ends the example itself (out of data, an assumption): nothing of it is filed
        if self._failures and not isinstance(in_flight, InvariantViolation | AnsweredDifferently):
            self._file_findings()  # the rules that failed before the step crashed are its finding
        crashed = isinstance(in_flight, Exception) and not isinstance(
            in_flight, InvariantViolation | AnsweredDifferently
        )
        if crashed and self._parted:
            assume(False)  # past a known finding the machine follows a model that has parted: spare the example
        if crashed:
            try:
                setattr(in_flight, STEPS_OF_A_CRASH, self._steps)
            except AttributeError:  # an exception type without a __dict__: its finding comes without steps
                pass
