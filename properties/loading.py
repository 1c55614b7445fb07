"""Choosing and loading the implementation under test: ``module:factory`` to a validated ``Implementation``.

Everything that can go wrong here is the adapter's error, never a finding:
the path is malformed, the module does not import (or has a syntax error, or
calls ``sys.exit``), the factory is missing, needs arguments, raises or exits,
it returns something else than an ``Implementation``, or the declaration is
unusable (``Implementation.validate``).  Each is one ``AdapterError`` line
that names the adapter and the cause; the command line prints it and exits 2.

A module in the current directory is importable, as under ``python -m``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pkgutil
import sys
from collections.abc import Callable, Iterator

from kvspec.spec.components import DeclarationError
from kvspec.spec.implementation import Implementation

REFERENCE = "kvspec.impl:reference"
ENVIRONMENT_VARIABLE = "KVSPEC_IMPL"


class AdapterError(Exception):
    """The implementation under test could not be loaded or built: the adapter's error, not a violation."""


class UsageError(ValueError):
    """A request that names nothing (an empty implementation, a layer word or profile no machine has):
    checking nothing must not pass for a verdict."""


def load_implementation(path: str) -> Implementation:
    """Import ``module:factory``, call it, validate the record and fill missing components from the reference."""
    implementation = build(path, factory_of(path))
    if path != REFERENCE:
        implementation = implementation.complete_with(load_implementation(REFERENCE))
    return implementation


def factory_of(path: str) -> object:
    module_name, colon, attribute = path.partition(":")
    if not module_name or not colon or not attribute:
        raise AdapterError(f"{path!r}: expected module:factory")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, "")  # as python -m does: modules in the current directory import
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as error:
        raise AdapterError(f"{path}: {error.filename}:{error.lineno}: syntax error: {error.msg}") from None
    except ImportError as error:
        raise AdapterError(f"{path}: cannot import {module_name!r}: {error}") from None
    except (Exception, SystemExit) as error:  # a module that exits would end the verdict with its own status
        raise AdapterError(f"{path}: importing {module_name!r} raised {type(error).__name__}: {error}") from None
    if not hasattr(module, attribute):
        raise AdapterError(f"{path}: module {module_name!r} has no {attribute!r}")
    return getattr(module, attribute)


def build(path: str, factory: object) -> Implementation:
    """Call ``factory`` (no arguments) and validate what it returns."""
    if isinstance(factory, Implementation):
        implementation = factory
    else:
        if not callable(factory):
            raise AdapterError(f"{path}: {factory!r} is not callable")
        try:
            inspect.signature(factory).bind()
        except TypeError as error:
            raise AdapterError(f"{path}: the factory must take no arguments ({error})") from None
        except ValueError:
            pass  # no signature to read (a builtin): calling it will tell
        try:
            implementation = factory()
        except (Exception, SystemExit) as error:
            raise AdapterError(f"{path}: the factory raised {type(error).__name__}: {error}") from None
    if not isinstance(implementation, Implementation):
        got = type(implementation).__name__
        raise AdapterError(f"{path}: the factory returned {got}, not kvspec.spec.implementation.Implementation")
    try:
        return implementation.validate()
    except DeclarationError as error:
        raise AdapterError(f"{path}: {error}") from None


def select(path: str | None) -> tuple[str, Implementation]:
    """The implementation under test: ``path``, else ``$KVSPEC_IMPL``, else the reference.

    An empty ``path`` is an error, not the reference: an unset variable in a CI script must not pass.
    """
    if path is None:
        path = os.environ.get(ENVIRONMENT_VARIABLE)
        if path == "":
            raise UsageError(f"${ENVIRONMENT_VARIABLE} is set but empty")
        path = path or REFERENCE
    if not path.strip():
        raise UsageError("the implementation named is empty; give module:factory")
    return path, load_implementation(path)


@contextlib.contextmanager
def exits_are_the_adapters(path: str, during: str) -> Iterator[None]:
    """An implementation that calls ``sys.exit`` would end the verdict with the status it chose (0 passes):
    it is an ``AdapterError`` instead."""
    try:
        yield
    except SystemExit as exit:
        raise AdapterError(
            f"{path}: the implementation called sys.exit({exit.code!r}) {during}: a verdict needs every call to "
            "return or raise"
        ) from None


def import_every_module() -> None:
    """Import every module of kvspec but the engines' adapters.

    Hypothesis mixes constants from every loaded module of the project into what it draws, so a derandomized
    run's examples depend on which modules are loaded: with all of them loaded first, they are a fact of the
    source alone -- the same in pytest, in ``kvspec check`` and in each of its worker processes.  The adapters
    are left out: they import the engines, which a core install does not have.
    """
    import kvspec

    for module in pkgutil.walk_packages(kvspec.__path__, "kvspec."):
        if not module.name.startswith("kvspec.adapters."):
            importlib.import_module(module.name)


def resolve(factory: str | Callable[[], Implementation] | Implementation) -> tuple[str, Implementation]:
    """The implementation ``factory`` names (``module:factory``, the factory, or an ``Implementation``),
    validated and completed from the reference, and how to name it."""
    if isinstance(factory, str):
        return factory, load_implementation(factory)
    path = getattr(factory, "__module__", "?") + ":" + getattr(factory, "__qualname__", type(factory).__name__)
    return path, build(path, factory).complete_with(load_implementation(REFERENCE))
