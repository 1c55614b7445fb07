"""What a failing example is filed as: a finding, under its tier, with its kind of call and its steps.

A rule that did not hold during a step is a ``Failure``; at the step's end the
machine raises the failure of the highest tier as a violation whose class names
the finding (``violation_class``: Hypothesis tells failures apart by class, so
each distinct finding is shrunk on its own).  What ended a failing example --
a violation, the implementation's crash, answers that differ between two runs
of the same calls, kvspec's own machine failing -- becomes a ``Finding``
(``finding_of``).  An out-of-contract call is told apart from another by its
kind (``variant_of``): the spec's reason with its values blurred.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Mapping
from pathlib import Path

import attrs
import hypothesis
from hypothesis.errors import Flaky, HypothesisException

from kvspec.properties.transcript import AnsweredDifferently
from kvspec.spec.errors import KVSpecError
from kvspec.spec.invariants import TIERS, Invariant, InvariantViolation, invariant_no_untyped_error

KVSPEC_SOURCES = (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "spec"))
HYPOTHESIS_SOURCES = str(Path(hypothesis.__file__).resolve().parent)  # an error raised there is never the engine's


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


@attrs.frozen
class Failure:
    """One rule that did not hold during a step, before the step's finding is filed."""

    invariant: Invariant
    detail: str
    operation: str
    variant: str = ""


def tier_rank(failure: Failure) -> int:
    return TIERS.index(failure.invariant.tier)


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
