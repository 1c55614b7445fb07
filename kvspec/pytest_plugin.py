"""kvspec's pytest plugin, registered under the ``pytest11`` entry point.

With kvspec installed, any project can run the conformance machines against
its own implementation::

    pytest --pyargs kvspec.properties --kv-impl=my_engine.adapter:factory

* ``--kv-impl MODULE:FACTORY`` (or ``$KVSPEC_IMPL``) names the implementation;
  the default is the reference.  A bad value is a usage error, in one line.
* ``--kv-profile dev|ci|thorough`` runs the machines under one of kvspec's
  Hypothesis profiles; without it they run under whatever profile is loaded.
* A module declares its machines with ``running.conformance_test``; the
  plugin binds each to the implementation at collection (nothing is bound at
  import time), so they run as ordinary Hypothesis state-machine tests.  Plain
  tests get the implementation from the ``kv_implementation`` fixture.
* In a session that collected kvspec's machines, Hypothesis writes its files
  into kvspec's cache (``profiles.hypothesis_files_in_cache``) while it
  collects and while a machine runs, never a ``.hypothesis/`` into the
  directory pytest runs in; the project's own tests keep Hypothesis's usual
  place for their example database.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from hypothesis import settings as Settings

from kvspec.properties import loading, profiles, running
from kvspec.spec.implementation import Implementation

SELECTION = pytest.StashKey[tuple[str, Implementation]]()
MACHINES = pytest.StashKey[set[type]]()  # the test classes bound to kvspec's machines


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvspec", "kvspec conformance")
    group.addoption(
        "--kv-impl",
        default=None,
        metavar="MODULE:FACTORY",
        help=f"implementation under test (default: ${loading.ENVIRONMENT_VARIABLE} or {loading.REFERENCE})",
    )
    group.addoption(
        "--kv-profile",
        default=None,
        choices=profiles.PROFILES,
        help="run kvspec's machines under this Hypothesis profile (default: the profile loaded)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[MACHINES] = set()
    try:
        config.stash[SELECTION] = loading.select(config.getoption("--kv-impl"))
    except (loading.AdapterError, loading.UsageError) as error:
        raise pytest.UsageError(f"--kv-impl: {error}") from None


def pytest_report_header(config: pytest.Config) -> str | None:
    if not (config.getoption("--kv-impl") or os.environ.get(loading.ENVIRONMENT_VARIABLE)):
        return None
    path, implementation = config.stash[SELECTION]
    return f"kvspec: implementation under test: {implementation.name} ({path})"


def pytest_pycollect_makeitem(collector: pytest.Module | pytest.Class, name: str, obj: object) -> object:
    """Bind each declared machine to the selected implementation, then collect it as pytest would."""
    if not isinstance(obj, running.ConformanceTest):
        return None
    implementation = collector.config.stash[SELECTION][1]
    bound = obj.bind(implementation, profile_settings(collector.config))
    bound.__name__ = bound.__qualname__ = name
    setattr(collector.obj, name, bound)  # pytest's collectors look the class up by name
    collector.config.stash[MACHINES].add(bound)
    return collector.ihook.pytest_pycollect_makeitem(collector=collector, name=name, obj=bound)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config) -> Iterator[None]:
    """Hypothesis's plugin writes its cache of constants here, at the end of collection."""
    with profiles.hypothesis_files_in_cache() if config.stash[MACHINES] else contextlib.nullcontext():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    machine = getattr(item, "cls", None) in item.config.stash[MACHINES]
    with profiles.hypothesis_files_in_cache() if machine else contextlib.nullcontext():
        return (yield)


def profile_settings(config: pytest.Config) -> Settings | None:
    """The Hypothesis settings of ``--kv-profile``; None means the profile already loaded."""
    name = config.getoption("--kv-profile")
    return Settings.get_profile(name) if name else None


@pytest.fixture(scope="session")
def kv_implementation(pytestconfig: pytest.Config) -> Implementation:
    """The implementation that ``--kv-impl`` names, completed from the reference (for plain tests)."""
    return pytestconfig.stash[SELECTION][1]
