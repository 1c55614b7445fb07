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
import hypothesis
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
HYPOTHESIS_SOURCES = str(Path(hypothesis.__file__).resolve().parent)  # an error raised there is never the engine's

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


NONDETERMINISTIC, HARNESS = "nondeterministic", "harness"  # the kinds of a finding that no rule names
FINDING_KINDS: tuple[str, ...] = (*TIERS, NONDETERMINISTIC, HARNESS)  # in the order a verdict files them
ADDRESS = re.compile(r"0x[0-9a-fA-F]+")  # an object's address in its repr: never part of what it answered


class AnsweredDifferently(AssertionError):
    """The implementation answered the same calls differently in two examples of one run: its answers depend on
    something other than the calls (time, a thread, a global), so no finding on it can be replayed."""

    def __init__(self, call: str, first: str, second: str, steps: tuple[str, ...]) -> None:
        once, again = around_the_difference(first, second)
        super().__init__(f"{call} answered {once} after these calls once, and {again} after the same calls again")
        self.call, self.first, self.second, self.steps = call, first, second, steps


def around_the_difference(first: str, second: str, context: int = 60) -> tuple[str, str]:
    """Two long answers shown where they start to differ."""
    differing = (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    start = next(differing, min(len(first), len(second)))
    cut = max(0, start - context // 2)

    def shown(text: str) -> str:
        head, tail = ("..." if cut else ""), ("..." if len(text) > cut + context else "")
        return head + text[cut : cut + context] + tail

    return shown(first), shown(second)


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
Refinement = tuple[Invariant, Callable[[Any], Any]]  # a layer's refinement rule, and the model's abstraction


class Subject:
    """An implementation object driven in lockstep with the spec module that models it.

    ``spec`` may be several modules: a layer and those that add operations to
    its component (the block manager and ``spec.tiered_swap``); an operation's
    transition is the first module's that has it.  ``model`` is the model's
    current state (None: no model, the implementation runs alone and every
    call is only recorded); ``snapshot`` reads the implementation's abstract
    state (default: its ``snapshot()``); ``refusal_view`` is what of that state a refused call must leave as
    it was, under the implementation's declared conventions (default: all of it -- a convention may let a
    refusal release what no later call reads, as vLLM's slid-out blocks, or adapt a policy's preference);
    ``refinement`` is the layer's refinement rule and the abstraction of the model it compares a snapshot
    with: a call the model refuses as out of contract is judged so only while the model still refines.
    """

    def __init__(
        self,
        machine: LockstepMachine,
        name: str,
        spec: Specs | None,
        model: Any,
        impl: Any,
        *,
        snapshot: Callable[[], Any] | None = None,
        refusal_view: Callable[[Any], Any] | None = None,
        refinement: Refinement | None = None,
    ) -> None:
        self.machine, self.name, self.spec, self.model, self.impl = machine, name, spec, model, impl
        self.snapshot: Callable[[], Any] = snapshot or (lambda: impl.snapshot())  # the state's type is the layer's
        self.refusal_view: Callable[[Any], Any] = refusal_view or (lambda state: state)
        self.refinement = refinement
        self._transitions: dict[str, Callable[..., Any]] = {}  # by operation: looked up once, called every step

    def parted(self, seen: Any) -> bool:
        """Whether the model had already parted from the implementation's state ``seen`` (as ``refusal_view``
        shows it), judged by the subject's refinement rule where it names one."""
        if self.refinement is None or self.model is None:
            return False
        rule, abstract = self.refinement
        return rule(seen, self.refusal_view(abstract(self.model))) is not None

    def __repr__(self) -> str:
        return self.name

    def transition(self, operation: str) -> Callable[..., Any]:
        """The spec's function for ``operation``."""
        known = self._transitions.get(operation)
        if known is not None:
            return known
        modules = (self.spec,) if isinstance(self.spec, ModuleType) else self.spec or ()
        for module in modules:
            if hasattr(module, operation):
                transition: Callable[..., Any] = getattr(module, operation)
                self._transitions[operation] = transition
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
    _transcript: ClassVar[dict[int, str]] = {}  # the answer given after each history of calls (``record``)
    _unoffered: ClassVar[frozenset[Invariant]] = frozenset()  # rules whose every needed operation is left out
    # What a bound machine asks at every step and whose answer its binding fixes, answered once per binding:
    _offered: ClassVar[dict[tuple[str, str], bool]] = {}  # (kind, operation) -> offered (``offers``)
    _counted: ClassVar[dict[int, tuple[Invariant, bool]]] = {}  # id of a rule -> the rule, and whether it counts

    def __init__(self) -> None:
        super().__init__()
        self._steps: list[str] = []  # the calls recorded, as a failure prints them
        self._buffers: list[list[Any]] = []  # lists handed over and overwritten, to carry the next call's
        self._answers: list[tuple[list[Any], list[Any], str, int]] = []  # answered list, caller's copy, call, step
        self._failures: list[Failure] = []
        self._steps_at_release: int | None = None  # calls recorded when the last step ended
        # The model has parted from the implementation in this example -- a known finding, a call the model refused
        # that the implementation carried out, answers that differ: from here only safety is checked, and safety
        # reads only the implementation's own state and answers and the caller's ledger of what it holds.
        self._parted = False
        self._accepted_at: int | None = None  # calls made when the probed out-of-contract call was accepted
        self._called: set[str] = set()
        self._subjects: list[Subject] = []
        self._history = 0  # the calls made and answered so far in this example, hashed
        self._recycling_noted = False  # the event of a recycled buffer is recorded once an example
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
            "_transcript": {},
            "_unoffered": unoffered(implementation),
            "_offered": {},
            "_counted": {},
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
        offered = self._offered.get((kind, operation))
        if offered is None:  # the rules' preconditions ask it at every step; the binding fixes the answer
            offered = self._offered[kind, operation] = self.implementation.offers_operation(kind, operation)
        return offered

    def subject(self, name: str, spec: Specs | None, model: Any, impl: Any, **options: Any) -> Subject:
        """A subject of this machine (``Subject``: ``snapshot``, ``refusal_view`` and ``refinement`` by name)."""
        subject = Subject(self, name, spec, model, impl, **options)
        self._subjects.append(subject)
        return subject

    def record(self, text: str) -> None:
        self._steps.append(text)
        self._history = hash((self._history, text))
        type(self).statistics.steps += 1

    def _answered(self, call: str, answer: object, error: BaseException | None) -> None:
        """Note what ``call`` answered after the calls before it; the same calls answered differently in another
        example of this run is the implementation's finding (``AnsweredDifferently``), never Hypothesis's."""
        told = f"raised {type(error).__name__}" if error is not None else repr(answer)
        if "0x" in told:  # an address, maybe: the regular expression only where it can match
            told = ADDRESS.sub("0x?", told)
        first = type(self)._transcript.setdefault(self._history, told)
        if first != told:
            raise AnsweredDifferently(call, first, told, tuple(self._steps))
        self._history = hash((self._history, told))

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
        problem = rule(*args)
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
        impl_args = [arg.impl if isinstance(arg, Subject) else self._lend(arg, lent) for arg in args]
        if subject.spec is None:
            self.record(label)
            try:
                alone = getattr(subject.impl, operation)(*impl_args)
            finally:
                self._overwrite(lent)
            self._answered(label, alone, None)
            return Answer(None, self._take_back(alone, label))
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
        views = refusal_views(subjects)
        before = compared(views)
        try:
            actual, impl_error = getattr(subject.impl, operation)(*impl_args), None
        except HypothesisException:  # Hypothesis's own (a frozen example past its deadline): never the engine's
            raise
        except Exception as error:  # an untyped error is a verdict too: a crash
            actual, impl_error = None, error
        self._overwrite(lent)
        self._answered(label, actual, impl_error)
        actual = self._take_back(actual, label)
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

    # -- buffer ownership ---------------------------------------------------------------

    def _lend(self, value: Any, lent: list[list[Any]]) -> Any:
        """``value`` as the implementation gets it: each list (in lists and tuples too) in a reused buffer."""
        if not self.recycles_buffers or not isinstance(value, list | tuple):
            return value
        items: list[Any] | tuple[Any, ...] = value
        if any(issubclass(kind, list | tuple) for kind in set(map(type, value))):
            items = [self._lend(item, lent) for item in value]
        if isinstance(value, tuple):
            return tuple(items)
        if self._buffers and not self._recycling_noted:  # an event is a fact of the example: once is enough
            self._recycling_noted = True
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
    where = f" at {portable(frame.filename)}:{frame.lineno} in {frame.name}" if frame else ""
    return f"{type(error).__name__}: {error}{where}"


def portable(filename: str) -> str:
    """A source file named as on any machine: from its package down (``vllm/v1/core/...``), never the path of
    the virtualenv or the checkout it ran from."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) :])
    resolved = Path(filename).resolve()
    for root in (Path(source) for source in KVSPEC_SOURCES):
        if resolved.is_relative_to(root.parent):
            return "kvspec/" + resolved.relative_to(root.parent).as_posix()
    return Path(filename).name


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


def refusal_views(subjects: list[Subject]) -> tuple[object, ...]:
    """What a refusal must leave as it was, of every subject of a call."""
    return tuple(subject.refusal_view(subject.snapshot()) for subject in subjects)


def compared(views: tuple[object, ...]) -> object:
    return views[0] if len(views) == 1 else views


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
    kind: str = HARNESS  # without a rule: NONDETERMINISTIC (the implementation's) or HARNESS (kvspec's own)

    @property
    def tier(self) -> str:
        """The rule's tier; a finding without a rule is filed under its kind."""
        return self.invariant.tier if self.invariant else self.kind


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


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for error in group.exceptions:
        found += leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return found


def finding_of(error: BaseException) -> Finding:
    """A finding from what ended a failing example: a violation, a crash of the implementation, or of kvspec."""
    cause = error.__context__
    if isinstance(error, Flaky) and isinstance(cause, AnsweredDifferently):  # Hypothesis saw the same, later
        error = cause
    if isinstance(error, AnsweredDifferently):
        return Finding(None, str(error), "", error.steps, kind=NONDETERMINISTIC)
    if isinstance(error, Flaky):  # the same choices drew differently: answers the machine steers by changed
        detail = f"the same example ran differently when run again ({type(error).__name__}): the implementation"
        detail += " answered the same calls differently, in something the machine steers by"
        return Finding(None, detail, "", getattr(error, STEPS_OF_A_CRASH, ()), kind=NONDETERMINISTIC)
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
    engine_frame = innermost and not str(Path(innermost).resolve()).startswith((*KVSPEC_SOURCES, HYPOTHESIS_SOURCES))
    if engine_frame and not isinstance(error, HypothesisException):
        return Finding(invariant_no_untyped_error, crash_report(error), "", steps)  # the implementation crashed
    return Finding(None, crash_report(error), "", steps)
