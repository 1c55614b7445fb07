"""A campaign's example database shared through Redis: what one process finds, another replays first.

Against a real ``redis-server`` started here on a loopback port (Debian's package; ``.ci/run`` installs it):
a first process runs a broken member's machine under ``dev`` with ``KVSPEC_EXAMPLE_DB=redis://...`` and
finds its bug; a second process, which only replays the database (no example of its own), finds it too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

REDIS_SERVER = shutil.which("redis-server")
MEMBER = "kvspec.impl.broken.block_pool:leaks_on_free"
RUN = """
import sys
from hypothesis import Phase, settings
from kvspec.properties import harness, running
from kvspec.properties.loading import load_implementation
from kvspec.properties.profiles import check_example_database
from kvspec.properties.test_block_pool import BlockPoolMachine
from kvspec.spec.block_pool import invariant_no_leak

check_example_database("dev")
phases = [Phase.reuse] if sys.argv[1] == "replay" else [Phase.reuse, Phase.generate]
found = running.run_machine(
    BlockPoolMachine, load_implementation(sys.argv[2]), settings(settings.get_profile("dev"), phases=phases),
    only=frozenset({invariant_no_leak}),
)
print(found.statistics.examples, found.finding.invariant.name if found.finding else "nothing")
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def redis_url() -> Iterator[str]:
    pytest.importorskip("redis", reason="the redis extra is not installed: pip install -e '.[dev]'")
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; .ci/run installs it)")
    port = free_port()
    server = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)


def run(mode: str, url: str) -> str:
    environment = {"KVSPEC_EXAMPLE_DB": url, "HYPOTHESIS_PROFILE": "dev", "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", RUN, mode, MEMBER], capture_output=True, text=True, env=environment, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1]


def test_a_failure_one_process_found_is_replayed_first_by_another(redis_url: str) -> None:
    assert run("replay", redis_url) == "nothing"  # an empty database: replaying it finds nothing
    assert run("find", redis_url) == "invariant_no_leak"
    assert run("replay", redis_url) == "invariant_no_leak"  # never generated an example: read from Redis


def test_an_unreachable_redis_is_one_line_before_anything_runs() -> None:
    pytest.importorskip("redis", reason="the redis extra is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "kvspec", "check", "--profile", "dev", "--machine", "block pool"],
        capture_output=True,
        text=True,
        env={"KVSPEC_EXAMPLE_DB": f"redis://127.0.0.1:{free_port()}/0", "PATH": ""},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach it" in lines[0], done.stderr
