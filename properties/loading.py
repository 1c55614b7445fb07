"""Choosing and loading the implementation under test: ``module:factory`` to a validated ``Implementation``.

Everything that can go wrong here is the adapter's error, never a finding:
the path is malformed, the module does not import (or has a syntax error),
the factory is missing, needs arguments or raises, it returns something else
than an ``Implementation``, or the declaration is unusable
(``Implementation.validate``).  Each is one ``AdapterError`` line that names
the adapter and the cause; the command line prints it and exits 2.

A module in the current directory is importable, as under ``python -m``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

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
    except Exception as error:
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
        except Exception as error:
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
