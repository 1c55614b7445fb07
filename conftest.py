"""Hypothesis profiles and the choice of the implementation under test.

* ``HYPOTHESIS_PROFILE=dev|ci|thorough`` picks the profile (``properties.profiles``);
  under ``CI`` the default is ``ci`` (derandomized, no example database).
* ``pytest --kv-impl=module:factory`` (or ``KVSPEC_IMPL``) picks the
  implementation; the factory returns a ``spec.implementation.Implementation``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from properties import harness
from properties.profiles import default_profile

PROFILE = default_profile()
settings.load_profile(PROFILE)
IMPLEMENTATION = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kv-impl",
        default=None,
        metavar="MODULE:FACTORY",
        help=f"implementation under test (default: ${harness.ENVIRONMENT_VARIABLE} or {harness.REFERENCE})",
    )


def pytest_configure(config: pytest.Config) -> None:
    try:
        path, implementation = harness.select(config.getoption("--kv-impl"))
    except harness.BadImplementation as error:
        raise pytest.UsageError(f"--kv-impl: {error}") from None
    config.stash[IMPLEMENTATION] = f"{implementation.name} ({path})"


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvspec: implementation under test: {config.stash[IMPLEMENTATION]}; hypothesis profile: {PROFILE}"
