"""This repository's own test run: its Hypothesis profile and the report header.

* ``HYPOTHESIS_PROFILE=dev|ci|thorough`` picks the profile (``kvspec.properties.profiles``);
  under ``CI`` the default is ``ci`` (derandomized, no example database).
* The implementation under test is chosen by kvspec's pytest plugin
  (``kvspec.pytest_plugin``): ``--kv-impl=module:factory`` or ``KVSPEC_IMPL``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from kvspec.properties.loading import import_every_module
from kvspec.properties.profiles import default_profile
from kvspec.pytest_plugin import SELECTION

PROFILE = default_profile()
settings.load_profile(PROFILE)

import_every_module()  # the derandomized examples: a fact of the source alone (see its docstring)


def pytest_report_header(config: pytest.Config) -> str:
    path, implementation = config.stash[SELECTION]
    return f"kvspec: implementation under test: {implementation.name} ({path}); hypothesis profile: {PROFILE}"
