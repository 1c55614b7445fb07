"""Hypothesis profiles shared by pytest (``conftest.py``), the plugin's ``--kv-profile`` and ``kvspec check``.

* ``dev`` -- quick and random, with the example database: for working.
* ``ci`` -- derandomized, no database, failing examples printed as blobs.
* ``thorough`` -- ten times the examples and twice the steps: before a release.

The example database of ``dev`` and ``thorough`` lives in the user's cache
(``$XDG_CACHE_HOME/kvspec/examples``, by default ``~/.cache/kvspec/examples``),
never in the working directory.  ``$KVSPEC_EXAMPLE_DB`` (read when kvspec
is first imported) puts it elsewhere, for a campaign of many processes
(``pytest -n``, HypoFuzz workers) that replay each other's failures and
share what the fuzzer learned: ``DIR``, a directory (processes of one host,
or hosts of one shared file system), or ``redis://HOST:PORT[/DB]``, a Redis
server that workers on any number of hosts reach (Hypothesis's
``RedisExampleDatabase``; the optional extra ``kvspec[redis]``).
Hypothesis's other files (its cache of constants) go to kvspec's cache too,
while kvspec runs (``hypothesis_files_in_cache``), unless
``$HYPOTHESIS_STORAGE_DIRECTORY`` names a place for them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir, storage_directory
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from kvspec.properties.loading import UsageError

SHARED_DATABASE = "KVSPEC_EXAMPLE_DB"
HYPOTHESIS_STORAGE = "HYPOTHESIS_STORAGE_DIRECTORY"  # Hypothesis's own variable: where the user wants its files


def cache_directory() -> Path:
    """kvspec's directory in the user's cache: Hypothesis's files go there, not into the working directory."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvspec"


class UnusableDatabase(ExampleDatabase):
    """A ``$KVSPEC_EXAMPLE_DB`` that cannot be used: saying why, in one line, when first used
    (``check_example_database`` says it before a verdict starts)."""

    def __init__(self, why: str) -> None:
        super().__init__()
        self.why = why

    def save(self, key: bytes, value: bytes) -> None:
        raise UsageError(self.why)

    def fetch(self, key: bytes) -> Iterator[bytes]:
        raise UsageError(self.why)

    def delete(self, key: bytes, value: bytes) -> None:
        raise UsageError(self.why)


def example_database() -> ExampleDatabase:
    """Where ``dev`` and ``thorough`` keep their examples: ``$KVSPEC_EXAMPLE_DB`` (a directory or a Redis URL),
    else kvspec's cache."""
    shared = os.environ.get(SHARED_DATABASE) or ""
    if not shared.startswith(REDIS):
        return DirectoryBasedExampleDatabase(shared or cache_directory() / "examples")
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError:
        return UnusableDatabase(f"${SHARED_DATABASE}={shared}: a Redis database needs pip install 'kvspec[redis]'")
    try:
        client = redis.Redis.from_url(shared, socket_connect_timeout=5)
    except ValueError as error:
        return UnusableDatabase(f"${SHARED_DATABASE}={shared}: not a Redis URL ({error})")
    return RedisExampleDatabase(client, key_prefix=b"kvspec-example:")


REDIS = "redis://"
try:
    from hypothesis.extra.redis import RedisExampleDatabase as RedisDatabase
except ImportError:  # without the redis extra no Redis database is ever made

    class RedisDatabase:  # type: ignore[no-redef]
        redis: Any


UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EXPLORING = settings(UNTIMED, database=example_database())
settings.register_profile("dev", EXPLORING, max_examples=60, stateful_step_count=40)
settings.register_profile(
    "ci", UNTIMED, max_examples=60, stateful_step_count=40, derandomize=True, database=None, print_blob=True
)
settings.register_profile("thorough", EXPLORING, max_examples=600, stateful_step_count=80)
PROFILES = ("dev", "ci", "thorough")


def default_profile() -> str:
    """``$HYPOTHESIS_PROFILE``, else ``ci`` under CI, else ``dev``."""
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    if name not in PROFILES:
        raise UsageError(f"$HYPOTHESIS_PROFILE={name!r} is not a kvspec profile; choose from {', '.join(PROFILES)}")
    return name


@contextmanager
def hypothesis_files_in_cache() -> Iterator[None]:
    """While kvspec runs, Hypothesis writes its files into kvspec's cache, never a ``.hypothesis/`` into the
    user's working directory; the place in force before is restored after, for the caller's own tests."""
    if os.environ.get(HYPOTHESIS_STORAGE):
        yield
        return
    before = storage_directory(intent_to_write=False).home_directory
    set_hypothesis_home_dir(cache_directory() / "hypothesis")
    try:
        yield
    finally:
        set_hypothesis_home_dir(before)


def check_example_database(profile: str) -> None:
    """Raise ``UsageError`` when ``profile`` keeps an example database that cannot be used -- a directory that
    cannot be written, a Redis server that does not answer: Hypothesis would fail only on saving the first
    failing example, in the middle of a verdict."""
    database = settings.get_profile(profile).database
    if isinstance(database, UnusableDatabase):
        raise UsageError(database.why)
    if isinstance(database, RedisDatabase):
        try:
            database.redis.ping()
        except Exception as error:  # noqa: BLE001 -- redis's own connection errors, said in one line
            url = os.environ.get(SHARED_DATABASE)
            raise UsageError(f"example database ${SHARED_DATABASE}={url}: cannot reach it ({error})") from None
        return
    if not isinstance(database, DirectoryBasedExampleDatabase):
        return
    named = f"${SHARED_DATABASE}={database.path}" if os.environ.get(SHARED_DATABASE) else str(database.path)
    existing = next(path for path in (database.path, *database.path.parents) if path.exists())
    if not existing.is_dir():
        raise UsageError(f"example database {named} (profile {profile}): {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"example database {named} (profile {profile}): {existing} is not writable")
