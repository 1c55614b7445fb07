"""This repository's own test run: its Hypothesis profile and the report header.

* ``HYPOTHESIS_PROFILE=dev|ci|thorough`` picks the profile (``kvspec.properties.profiles``);
  under ``CI`` the default is ``ci`` (derandomized, no example database).
* The implementation under test is chosen by kvspec's pytest plugin
  (``kvspec.pytest_plugin``): ``--kv-impl=module:factory`` or ``KVSPEC_IMPL``.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from hypothesis import settings

import kvspec
from kvspec.properties.profiles import default_profile
from kvspec.pytest_plugin import SELECTION

PROFILE = default_profile()
settings.load_profile(PROFILE)

# Hypothesis mixes constants from every loaded module of this project into what it draws, so a
# derandomized test's examples would depend on which tests ran (and imported) before it.  Loading
# every module first makes each test's examples a fact of the source alone.  The adapters are left
# out: they import the engines, which a core install does not have.
for module in pkgutil.walk_packages(kvspec.__path__, "kvspec."):
    if not module.name.startswith("kvspec.adapters."):
        importlib.import_module(module.name)


def pytest_report_header(config: pytest.Config) -> str:
    path, implementation = config.stash[SELECTION]
    return f"kvspec: implementation under test: {implementation.name} ({path}); hypothesis profile: {PROFILE}"
