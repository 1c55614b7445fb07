"""Invariants: the rules of the spec, each an object with its tier and the sentence of why.

Rules:

* An invariant is a plain predicate over abstract states (and, for a
  transition, over the state before, the state after and the result).  It
  returns ``None`` when it holds and a one-line explanation when it does not.
* Each invariant is declared exactly once, with ``@invariant(why, tier)``, in
  the ``spec`` module of the layer it belongs to.  The decorator returns the
  ``Invariant`` object itself: machines, the conformance verdict and the zoo
  of broken implementations refer to it by reference
  (``block_pool.invariant_no_leak``), never by a string.
* Every rule says what kind of rule it is (its *tier*):

  - ``safety`` -- holds for every correct engine whatever it declares: no
    leak, counts equal holders, nothing handed out twice, what is in use or
    locked is never reclaimed, what is read back is what was written.
  - ``caller contract`` -- how a call outside the contract is answered: a
    typed error and no change.  An engine that declares ``trusts_caller``
    (``spec.conventions``) has these findings reported as its declared
    choice, and is not sent such calls while its safety rules are checked.
  - ``convention`` -- exact refinement of the model *of the engine's declared
    conventions*: its answers, its verdicts and its state are the model's.

* Invariants are *grouped by what they check* (``Group``): a group's members
  are evaluated on the same arguments, each on as many leading arguments as
  its predicate takes, and a group may include another layer's group seen
  through a projection (a manager's state includes its pool's, with the
  tables as the holders).  A machine checks a layer's group, so an invariant
  declared once in a group is checked by every machine that checks the group.
* Teeth: each invariant is proven able to fail by a broken implementation of
  ``impl/broken/`` that names it, unless it declares ``fails_only_with``: why
  it cannot fail without another named invariant failing too.
* Six invariants hold for every layer and live here; the lockstep harness
  checks them on every call: out-of-contract calls are rejected cleanly
  (caller contract), in-contract calls get the model's verdict (convention)
  and its answer (convention), a call rejected for want of room changes
  nothing (safety: all or nothing), no call raises anything but a typed error
  (safety), and a list an operation answers is not changed by the
  implementation afterwards (safety: it is the caller's).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import attrs

if TYPE_CHECKING:
    from kvspec.spec.components import Operation

Tier = Literal["safety", "caller contract", "convention"]
TIERS: tuple[Tier, ...] = ("safety", "caller contract", "convention")


@attrs.frozen(cache_hash=True)  # a rule keys the counts of every check a verdict makes
class Invariant:
    """A rule of the spec: its name, layer, tier and why it exists; call it to evaluate it."""

    name: str
    layer: str
    tier: Tier
    why: str
    fails_only_with: str  # empty, or why it cannot fail unless another named invariant fails too
    needs: tuple[Operation, ...]  # the optional operations without which no machine reaches it
    check: Callable[..., str | None] = attrs.field(eq=False, repr=False)
    arity: int = attrs.field(eq=False, repr=False)

    def __call__(self, *args: Any) -> str | None:
        return self.check(*args)


REGISTRY: dict[str, Invariant] = {}


def invariant(
    why: str, tier: Tier, *, fails_only_with: str = "", needs: tuple[Operation, ...] = ()
) -> Callable[[Callable[..., str | None]], Invariant]:
    """Declare the predicate as an invariant of its module's layer; the name is the function's.

    ``needs`` names the optional operations (``swap.SWAP``) without which no machine reaches
    the rule: against an implementation that offers none of them, on any kind that may, it is "not offered".
    """
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose from {TIERS}")

    def declare(predicate: Callable[..., str | None]) -> Invariant:
        name = predicate.__name__
        if not name.startswith("invariant_"):
            raise ValueError(f"invariant {name!r} must be named invariant_...")
        if name in REGISTRY:
            raise ValueError(f"invariant {name!r} is declared twice")
        REGISTRY[name] = Invariant(
            name=name,
            layer=predicate.__module__.rsplit(".", 1)[-1],
            tier=tier,
            why=why,
            fails_only_with=fails_only_with,
            needs=needs,
            check=predicate,
            arity=len(inspect.signature(predicate).parameters),
        )
        return REGISTRY[name]

    return declare


@attrs.frozen
class Group:
    """Invariants checked together, on one list of arguments; each takes as many as it names.

    ``parts`` include other groups: each with the function that turns this
    group's arguments into that group's.
    """

    members: tuple[Invariant, ...]
    parts: tuple[tuple[Group, Callable[..., tuple[Any, ...]]], ...] = ()

    def including(self, group: Group, view: Callable[..., tuple[Any, ...]]) -> Group:
        return attrs.evolve(self, parts=(*self.parts, (group, view)))

    @property
    def invariants(self) -> tuple[Invariant, ...]:
        return self.members + tuple(rule for group, _ in self.parts for rule in group.invariants)

    def evaluations(self, *args: Any) -> Iterator[tuple[Invariant, tuple[Any, ...]]]:
        """Each member with the arguments it is evaluated on, included groups last."""
        for rule in self.members:
            yield rule, args[: rule.arity]
        for group, view in self.parts:
            yield from group.evaluations(*view(*args))


class InvariantViolation(AssertionError):
    """Raised by a property suite when an invariant does not hold.

    ``operation`` names the call that broke a caller-contract rule, and
    ``variant`` the kind of out-of-contract call it was (the spec's reason, its
    values blurred), so that a verdict can tell "accepts a double free" from
    "releases a block of another pool".  ``consequences`` are the rules of lower
    tiers that failed at the same step (the finding is filed under the highest
    tier that failed); ``steps`` is the operation sequence that led to it, and
    ``after_steps`` how many of its calls came after an accepted out-of-contract
    call whose consequence this is.
    """

    def __init__(
        self,
        rule: Invariant,
        detail: str,
        operation: str = "",
        consequences: tuple[tuple[Invariant, str], ...] = (),
        steps: tuple[str, ...] = (),
        variant: str = "",
        after_steps: int | None = None,
    ) -> None:
        super().__init__(f"{rule.name} violated ({rule.tier}): {detail} (why it matters: {rule.why})")
        self.invariant = rule
        self.detail = detail
        self.operation = operation
        self.consequences = consequences
        self.steps = steps
        self.variant = variant
        self.after_steps = after_steps


def require(rule: Invariant, *args: Any) -> None:
    """Evaluate ``rule`` and raise if it does not hold."""
    problem = rule(*args)
    if problem is not None:
        raise InvariantViolation(rule, problem)


REFINEMENT = "the implementation must be in exactly the state the model of its declared conventions predicts"


def refinement(name: str, view: Callable[[Any], Any] | None = None) -> Invariant:
    """Declare the calling layer's refinement rule [convention], called as ``(actual, expected)``: the
    implementation's abstract state is the model's -- both seen through ``view``, if given.  The one rule every
    layer shares but its name and what it compares, so each layer names it in one line."""

    def refines(actual: object, expected: object) -> str | None:
        seen, predicted = (actual, expected) if view is None else (view(actual), view(expected))
        return None if seen == predicted else diff_states(seen, predicted)

    refines.__name__ = refines.__qualname__ = name
    refines.__module__ = sys._getframe(1).f_globals["__name__"]  # the layer is the declaring module
    return invariant(REFINEMENT, "convention")(refines)


@invariant(
    "a caller told never (invalid) gives up, one told retry-later waits: out-of-contract calls must be refused, "
    "with the spec's error class and no trace",
    "caller contract",
)
def invariant_out_of_contract_call_rejected(expected: str, actual: str, before: object, after: object) -> str | None:
    """``expected`` is the spec's error class name, ``actual`` the implementation's verdict ('ok' or a class name)."""
    changed = "" if before == after else f"; it changed {changes(before, after)}"
    if actual != expected:
        return f"the spec rejects the call with {expected}, the implementation answers {actual}{changed}"
    if changed:
        return f"the call was rejected, but{changed}"
    return None


@invariant(
    "a caller must be able to tell success from retry-later (out of blocks) exactly as the model of the declared "
    "conventions does",
    "convention",
)
def invariant_verdict_matches_spec(expected: str, actual: str) -> str | None:
    """``expected`` and ``actual`` are verdicts: 'ok' or the typed error's class name."""
    if expected != actual:
        return f"the spec's verdict is {expected}, the implementation's is {actual}"
    return None


@invariant(
    "callers act on what an operation answers (a lookup's block, a read's tokens): it must be the spec's answer",
    "convention",
)
def invariant_result_matches_spec(expected: object, actual: object) -> str | None:
    if expected != actual:
        return f"the spec answers {expected!r}, the implementation {actual!r}"
    return None


@invariant("all or nothing: a call refused for want of room must leave no trace, so the caller can retry", "safety")
def invariant_failed_operation_changes_nothing(before: object, after: object) -> str | None:
    if before != after:
        return f"the call was refused, but it changed {changes(before, after)}"
    return None


SHOWN_ENTRIES = 6  # a difference names at most this many entries of a large field, then counts the rest


def changes(before: object, after: object) -> str:
    """What differs between two states: only the entries that changed, old and new (states in a tuple, each)."""
    if isinstance(before, tuple) and isinstance(after, tuple) and len(before) == len(after):
        return "; ".join(changes(b, a) for b, a in zip(before, after, strict=True) if b != a)
    if not attrs.has(type(before)) or type(before) is not type(after):
        return f"{before!r} into {after!r}"
    return "; ".join(
        f"{f.name}: {entries(getattr(before, f.name), getattr(after, f.name), 'from', 'to')}"
        for f in attrs.fields(cast(Any, type(before)))
        if getattr(before, f.name) != getattr(after, f.name)
    )


def diff_states(actual: object, expected: object) -> str:
    """The entries in which two attrs records differ: for large fields, only the entries that differ."""
    parts = [
        f"{f.name}: {entries(getattr(actual, f.name), getattr(expected, f.name), 'implementation', 'spec')}"
        for f in attrs.fields(cast(Any, type(expected)))
        if getattr(actual, f.name) != getattr(expected, f.name)
    ]
    return "; ".join(parts) or f"{actual!r} != {expected!r}"


def entries(first: object, second: object, first_name: str, second_name: str) -> str:
    """Two values of one field: whole when short, else only the indices (or keys) at which they differ."""
    whole = f"{first_name} {first!r}, {second_name} {second!r}"
    if len(whole) <= 120:
        return whole
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        keys = [k for k in dict.fromkeys([*first, *second]) if first.get(k, MISSING) != second.get(k, MISSING)]
        pairs = [(f"[{k!r}]", first.get(k, MISSING), second.get(k, MISSING)) for k in keys]
    elif isinstance(first, tuple | list) and isinstance(second, tuple | list) and len(first) == len(second):
        pairs = [(f"[{i}]", a, b) for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b]
    elif isinstance(first, tuple | list) and isinstance(second, tuple | list):
        return sequences_apart(first, second, first_name, second_name)
    else:
        return whole
    shown = ", ".join(f"{at} {first_name} {a!r}, {second_name} {b!r}" for at, a, b in pairs[:SHOWN_ENTRIES])
    more = f" (and {len(pairs) - SHOWN_ENTRIES} more entries)" if len(pairs) > SHOWN_ENTRIES else ""
    return shown + more


def sequences_apart(first: Sequence[Any], second: Sequence[Any], first_name: str, second_name: str) -> str:
    """Two sequences of different lengths: where they part, with a few entries either side."""
    at = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), min(len(first), len(second)))
    low, high = max(0, at - 2), at + SHOWN_ENTRIES

    def window(values: Sequence[Any]) -> str:
        shown = ", ".join(map(repr, values[low:high]))
        return f"{len(values)} entries, [{low}:] {'...' if low else ''}({shown}{', ...' if len(values) > high else ''})"

    return f"part at [{at}]: {first_name} {window(first)}; {second_name} {window(second)}"


class _Missing:
    def __repr__(self) -> str:
        return "absent"


MISSING = _Missing()


@invariant(
    "a caller can handle only the errors the contract names: anything else escaping an operation crashes the "
    "caller (a scheduler step, a server process)",
    "safety",
)
def invariant_no_untyped_error(crash: str) -> str | None:
    """``crash`` describes the untyped error an in-contract call raised (its class, message and raising frame)."""
    return f"the call raised {crash}" if crash else None


@invariant(
    "a list an operation answers belongs to the caller (a block table row, the blocks it evicted): an "
    "implementation that changes it later changes what the caller holds",
    "safety",
)
def invariant_answer_not_changed_later(answered: list[Any], kept: list[Any], call: str, by: str) -> str | None:
    """``kept`` is the caller's copy of the list ``call`` answered; ``answered`` that list after the call ``by``."""
    if answered != kept:
        return f"{call} answered {kept!r}; after {by} the implementation had changed that list to {answered!r}"
    return None
