"""Components: what a layer asks of an implementation, and how an implementation offers it.

Rules:

* Each layer declares the *kind* of component it drives, once, beside its
  protocol: ``component_kind(name, Protocol, builds=...)``.  The protocol
  says what every such component has (its methods and properties, its
  bases' included), but for the optional operations.
* An *optional operation* is what an engine may leave out: a typed constant
  (``speculative.ROLLBACK``, ``kv_transfer.KV_TRANSFER``) declared once by
  ``optional_operation(name, Protocol, *methods, kinds=...)`` in the chapter
  that introduces it, its methods written in that chapter's protocol.  A
  *mode* -- the engine honours a configuration value and calls no method of
  its own (priority scheduling, swap preemption) -- is an operation whose
  protocol has no methods and says in its docstring what the mode is.  Rules
  (``needs``), machines (``requires``, ``offers``) and offers
  (``operations``) all name the constant, so a misspelt operation is a
  ``NameError`` at import and a mypy error, never a silent "not offered".
  A layer of a third party declares its kind and operations the same way.
* An implementation offers a component with an ``Offer``: the factory (a
  class, or a function that builds one), the optional operations it supports,
  and the operations its adapter *emulates* -- composes from several engine
  calls, or reads off the engine's state -- rather than maps to one engine
  call.  A finding on an emulated operation is the adapter's, not the engine's.
* What is not offered is not checked: a machine that needs an operation an
  implementation leaves out does not run, and the rules only it reaches are
  reported "not offered" -- never violated, never held.
* An offer is validated when the implementation is loaded (``check_offer``):
  a factory must be callable and not a built component; a class must have its
  kind's methods and those of every optional operation it offers; an
  operation must be one of its kind's.  What a function builds is checked
  when it is built (``Offer.__call__``).  Each refusal is one
  ``DeclarationError`` line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import attrs

from kvspec.spec.errors import KVSpecError

P = ParamSpec("P")
R = TypeVar("R")


class DeclarationError(Exception):
    """An implementation's declaration is unusable: a one-line reason, naming the component."""


@attrs.frozen
class Operation:
    """An optional operation of the ``kinds`` that may offer it: the methods it needs, written in ``protocol``."""

    name: str
    protocol: type  # the chapter's protocol that writes its methods (a mode's: one that has none, and says why)
    methods: tuple[str, ...]
    kinds: tuple[str, ...]

    def __str__(self) -> str:
        return self.name


OPERATIONS: dict[str, dict[str, Operation]] = {}  # kind -> its optional operations, by name


def optional_operation(name: str, protocol: type, *methods: str, kinds: tuple[str, ...]) -> Operation:
    """Declare (once) an optional operation that components of ``kinds`` may offer, with ``methods`` of
    ``protocol``; a kind declared later (a chapter that imports this one) may be named by its name."""
    unwritten = [method for method in methods if method not in methods_of(protocol)]
    if unwritten:
        raise ValueError(f"optional operation {name!r}: {protocol.__qualname__} writes no {', '.join(unwritten)}")
    operation = Operation(name=name, protocol=protocol, methods=methods, kinds=kinds)
    for kind in kinds:
        declared = OPERATIONS.setdefault(kind, {})
        if name in declared:
            raise ValueError(f"optional operation {kind}.{name} is declared twice")
        declared[name] = operation
    return operation


@attrs.frozen
class ComponentKind:
    """A layer's component: how it is built, what it always has, and what it may leave out."""

    name: str
    protocol: type | None  # what every such component is (None: a bare function)
    builds: str  # the factory's call, for messages and the guide: "block_pool(capacity, policy)"
    layer: str  # the spec module that declares it

    @property
    def optional(self) -> Mapping[str, Operation]:
        """The optional operations of this kind, by name: every chapter's that names it."""
        return OPERATIONS.get(self.name, {})

    @property
    def methods(self) -> tuple[str, ...]:
        """What every such component has: its protocol's methods but those of an optional operation."""
        only_optional = {method for operation in self.optional.values() for method in operation.methods}
        members = methods_of(self.protocol) if self.protocol is not None else ()
        return tuple(method for method in members if method not in only_optional)


KINDS: dict[str, ComponentKind] = {}


def component_kind(name: str, protocol: type | None, *, builds: str, module: str = "") -> ComponentKind:
    """Declare (once) the component a layer drives, by its ``protocol`` (None: a bare function, a kernel, whose
    ``module`` is then named); the layer is the module that defines the protocol."""
    if name in KINDS:
        raise ValueError(f"component kind {name!r} is declared twice")
    layer = protocol.__module__ if protocol is not None else module
    KINDS[name] = ComponentKind(name=name, protocol=protocol, builds=builds, layer=layer.rsplit(".", 1)[-1])
    return KINDS[name]


def methods_of(protocol: type) -> tuple[str, ...]:
    """A protocol's public methods and properties, its bases' first, in the order they are written."""
    protocols = [klass for klass in reversed(protocol.__mro__) if getattr(klass, "_is_protocol", False)]
    names = (name for klass in protocols if klass is not Protocol for name in vars(klass) if not name.startswith("_"))
    return tuple(dict.fromkeys(names))


def check_operation(kind: str, operation: Operation) -> None:
    """Refuse to ask ``kind`` for an operation it cannot offer: that would read "not offered" for ever."""
    if kind not in KINDS:
        raise ValueError(f"no layer declares a component {kind!r}; known: {', '.join(sorted(KINDS))}")
    if kind not in operation.kinds:
        raise ValueError(f"{kind} cannot offer {operation}: an optional operation of {', '.join(operation.kinds)}")


def every_operation(kind: str) -> frozenset[Operation]:
    """Every optional operation of ``kind``: what the reference offers."""
    return frozenset(OPERATIONS.get(kind, {}).values())


def names(values: Iterable[str]) -> frozenset[str]:
    return frozenset(values)


def operations(values: Iterable[Operation]) -> frozenset[Operation]:
    return frozenset(values)


@attrs.frozen
class Offer(Generic[P, R]):
    """One component an implementation brings: its factory, its optional operations, what its adapter emulates.

    Calling an offer builds the component (``offer(capacity, policy)``) and checks that what was built has
    the methods of its kind and of every operation offered.
    """

    factory: Callable[P, R]
    operations: frozenset[Operation] = attrs.field(default=frozenset(), converter=operations)
    emulated: frozenset[str] = attrs.field(default=frozenset(), converter=names)
    kind: str = ""  # set by the implementation that holds the offer

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            built = self.factory(*args, **kwargs)
        except (DeclarationError, KVSpecError):  # a typed refusal (a policy it lacks, say) is an answer
            raise
        except Exception as error:
            # A factory that cannot build what the machine asks for is the adapter's failure, not a finding.
            raise ComponentBuildError(self, error) from error
        if self.kind in KINDS and not isinstance(self.factory, type):
            missing = missing_methods(self.kind, built, self.operations)
            if missing:
                raise DeclarationError(f"{self.kind}: what {name_of(self.factory)} builds has no {', '.join(missing)}")
        return built

    def offers(self, operation: Operation) -> bool:
        return operation in self.operations


class ComponentBuildError(DeclarationError):
    """A component's factory raised while the suite built it: the adapter's error."""

    def __init__(self, offer: Offer[Any, Any], error: BaseException) -> None:
        super().__init__(
            f"{offer.kind or 'a component'}: {name_of(offer.factory)} raised {type(error).__name__}: {error}"
        )
        self.error = error


def name_of(factory: object) -> str:
    return getattr(factory, "__qualname__", None) or type(factory).__name__


def missing_methods(kind: str, component: object, offered: Iterable[Operation]) -> list[str]:
    """The methods ``component`` (a class or a built object) lacks for ``kind`` and the operations ``offered``."""
    needed = [*KINDS[kind].methods, *(method for operation in offered for method in operation.methods)]
    return [method for method in dict.fromkeys(needed) if not hasattr(component, method)]


def as_offer(value: object) -> Offer[..., Any] | None:
    """An implementation's field as an ``Offer``: a bare factory offers none of the optional operations."""
    if value is None or isinstance(value, Offer):
        return value
    return Offer(value)  # type: ignore[arg-type]  # check_offer refuses what is not callable


def check_offer(kind: str, offer: Offer[..., Any]) -> None:
    """Refuse an unusable offer of ``kind`` in one line (see the module docstring)."""
    if kind not in KINDS:
        raise DeclarationError(f"no layer declares a component {kind!r}; known: {', '.join(sorted(KINDS))}")
    factory = offer.factory
    if not callable(factory):
        raise DeclarationError(f"{kind} is {factory!r}, not a factory: give the class, or a function that builds one")
    if KINDS[kind].methods and not isinstance(factory, type) and not missing_methods(kind, factory, ()):
        raise DeclarationError(
            f"{kind} is a built {type(factory).__name__}, not a factory: give the class, or a function that builds one"
        )
    foreign = sorted(str(operation) for operation in offer.operations if kind not in operation.kinds)
    if foreign:
        known = ", ".join(sorted(KINDS[kind].optional)) or "none"
        raise DeclarationError(
            f"{kind} offers {', '.join(foreign)}, not operations of a {kind} (its optional: {known})"
        )
    operations = {*KINDS[kind].methods, *KINDS[kind].optional}
    strange = sorted(offer.emulated - operations)
    if strange:
        raise DeclarationError(f"{kind} emulates {', '.join(strange)}, which are not operations of a {kind}")
    if isinstance(factory, type):
        missing = missing_methods(kind, factory, offer.operations)
        if missing:
            raise DeclarationError(f"{kind} {factory.__qualname__} has no {', '.join(missing)}")
