"""A subject: one implementation object driven in lockstep with the spec module that models it."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs

from kvspec.spec.invariants import Invariant, invariant_result_matches_spec

if TYPE_CHECKING:
    from kvspec.properties.harness import LockstepMachine


@attrs.frozen
class Answer:
    """What one call answered: the model's expectation and the implementation's answer."""

    expected: Any
    actual: Any


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
