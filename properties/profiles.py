"""Hypothesis profiles shared by pytest (``conftest.py``), the plugin's ``--kv-profile`` and ``kvspec check``.

* ``dev`` -- quick and random, with the example database: for working.
* ``ci`` -- derandomized, no database, failing examples printed as blobs.
* ``thorough`` -- ten times the examples and twice the steps: before a release.

The example database of ``dev`` and ``thorough`` lives in the user's cache
(``$XDG_CACHE_HOME/kvspec/examples``, by default ``~/.cache/kvspec/examples``),
never in the working directory.  ``$KVSPEC_EXAMPLE_DB=DIR`` puts it in
``DIR`` instead: processes (``pytest -n``) and machines (HypoFuzz workers on a
shared file system) that point at one directory replay each other's failures
and share what the fuzzer learned.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

SHARED_DATABASE = "KVSPEC_EXAMPLE_DB"


def cache_directory() -> Path:
    """kvspec's directory in the user's cache: Hypothesis's files go there, not into the working directory."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvspec"


UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EXPLORING = settings(
    UNTIMED,
    database=DirectoryBasedExampleDatabase(os.environ.get(SHARED_DATABASE) or cache_directory() / "examples"),
)
settings.register_profile("dev", EXPLORING, max_examples=60, stateful_step_count=40)
settings.register_profile(
    "ci", UNTIMED, max_examples=60, stateful_step_count=40, derandomize=True, database=None, print_blob=True
)
settings.register_profile("thorough", EXPLORING, max_examples=600, stateful_step_count=80)
PROFILES = ("dev", "ci", "thorough")


def default_profile() -> str:
    """``$HYPOTHESIS_PROFILE``, else ``ci`` under CI, else ``dev``."""
    return os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
