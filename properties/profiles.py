"""Hypothesis profiles shared by pytest (``conftest.py``), the plugin's ``--kv-profile`` and ``kvspec check``.

* ``dev`` -- quick and random, with the example database: for working.
* ``ci`` -- derandomized, no database, failing examples printed as blobs.
* ``thorough`` -- ten times the examples and twice the steps: before a release.

``$KVSPEC_EXAMPLE_DB=DIR`` puts the example database of ``dev`` and
``thorough`` in ``DIR``: processes (``pytest -n``) and machines (HypoFuzz
workers on a shared file system) that point at one directory replay each
other's failures and share what the fuzzer learned.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

SHARED_DATABASE = "KVSPEC_EXAMPLE_DB"


UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EXPLORING = (
    settings(UNTIMED, database=DirectoryBasedExampleDatabase(os.environ[SHARED_DATABASE]))
    if os.environ.get(SHARED_DATABASE)
    else UNTIMED
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
