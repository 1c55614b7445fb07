"""Components: what a layer asks of an implementation, and how an implementation offers it.

Rules:

* Each layer declares the *kind* of component it drives, once, beside its
  protocol: ``component_kind(name, Protocol, builds=..., optional=...)``.
  The protocol says what every such component has (its methods and
  properties, its bases' included); ``optional`` are operations (or modes) an
  engine may leave out, each with the methods it needs -- written in a
  protocol of the chapter that introduces it -- which no component is then
  required to have.  A layer of a third party declares its kind the same way,
  in its own module.
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
  operation named must exist.  What a function builds is checked when it is
  built (``Offer.__call__``).  Each refusal is one ``DeclarationError`` line.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import attrs

from kvspec.spec.errors import KVSpecError

P = ParamSpec("P")
R = TypeVar("R")


class DeclarationError(Exception):
    """An implementation's declaration is unusable: a one-line reason, naming the component."""


@attrs.frozen
class ComponentKind:
    """A layer's component: how it is built, what it always has, and what it may leave out."""

    name: str
    protocol: type | None  # what every such component is (None: a bare function)
    builds: str  # the factory's call, for messages and the guide: "block_pool(capacity, policy)"
    methods: tuple[str, ...]
    optional: Mapping[str, tuple[str, ...]]  # optional operation -> the methods it needs (none: a mode)
    layer: str  # the spec module that declares it


KINDS: dict[str, ComponentKind] = {}


def component_kind(
    name: str, protocol: type | None, *, builds: str, optional: Mapping[str, Iterable[str]] | None = None
) -> ComponentKind:
    """Declare (once) the component a layer drives, by its ``protocol`` (None: a bare function, a kernel);
    the layer is the module that defines the protocol, else the calling module."""
    if name in KINDS:
        raise ValueError(f"component kind {name!r} is declared twice")
    operations = {operation: tuple(needs) for operation, needs in (optional or {}).items()}
    members = methods_of(protocol) if protocol is not None else ()
    only_optional = {method for needs in operations.values() for method in needs}
    module = protocol.__module__ if protocol is not None else inspect.stack()[1].frame.f_globals.get("__name__", "?")
    KINDS[name] = ComponentKind(
        name=name,
        protocol=protocol,
        builds=builds,
        methods=tuple(method for method in members if method not in only_optional),
        optional=operations,
        layer=module.rsplit(".", 1)[-1],
    )
    return KINDS[name]


def methods_of(protocol: type) -> tuple[str, ...]:
    """A protocol's public methods and properties, its bases' first, in the order they are written."""
    protocols = [klass for klass in reversed(protocol.__mro__) if getattr(klass, "_is_protocol", False)]
    names = (name for klass in protocols if klass is not Protocol for name in vars(klass) if not name.startswith("_"))
    return tuple(dict.fromkeys(names))


def check_operation(kind: str, operation: str) -> None:
    """Refuse an optional operation ``kind`` does not declare: a misspelt name must never read "not offered"."""
    declared = KINDS.get(kind)
    if declared is None:
        raise ValueError(f"no layer declares a component {kind!r}; known: {', '.join(sorted(KINDS))}")
    if operation not in declared.optional:
        known = ", ".join(sorted(declared.optional)) or "none"
        raise ValueError(f"{kind} declares no optional operation {operation!r} (its optional ones: {known})")


def every_operation(kind: str) -> frozenset[str]:
    """Every optional operation of ``kind``: what the reference offers."""
    return frozenset(KINDS[kind].optional)


def names(values: Iterable[str]) -> frozenset[str]:
    return frozenset(values)


@attrs.frozen
class Offer(Generic[P, R]):
    """One component an implementation brings: its factory, its optional operations, what its adapter emulates.

    Calling an offer builds the component (``offer(capacity, policy)``) and checks that what was built has
    the methods of its kind and of every operation offered.
    """

    factory: Callable[P, R]
    operations: frozenset[str] = attrs.field(default=frozenset(), converter=names)
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

    def offers(self, operation: str) -> bool:
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


def missing_methods(kind: str, component: object, operations: Iterable[str]) -> list[str]:
    """The methods ``component`` (a class or a built object) lacks for ``kind`` and ``operations``."""
    declared = KINDS[kind]
    needed = [*declared.methods, *(m for operation in operations for m in declared.optional.get(operation, ()))]
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
    unknown = sorted(offer.operations - set(KINDS[kind].optional))
    if unknown:
        known = ", ".join(sorted(KINDS[kind].optional)) or "none"
        raise DeclarationError(f"{kind} offers unknown operations {', '.join(unknown)} (optional ones: {known})")
    operations = {*KINDS[kind].methods, *KINDS[kind].optional}
    strange = sorted(offer.emulated - operations)
    if strange:
        raise DeclarationError(f"{kind} emulates {', '.join(strange)}, which are not operations of a {kind}")
    if isinstance(factory, type):
        missing = missing_methods(kind, factory, offer.operations)
        if missing:
            raise DeclarationError(f"{kind} {factory.__qualname__} has no {', '.join(missing)}")
