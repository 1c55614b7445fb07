"""A verdict judged in worker processes is the verdict of one process (``kvspec.workers``)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from kvspec import conformance
from kvspec.impl.radix_cache import RadixCache
from kvspec.properties.loading import AdapterError
from kvspec.spec.implementation import Implementation

TITLES = ["radix = chained hash", "paged attention logits"]  # two short machines: one to each worker


def test_the_verdict_of_two_workers_is_the_verdict_of_one_process() -> None:
    alone = conformance.run_conformance("kvspec.impl:reference", titled=TITLES, jobs=1)
    shared = conformance.run_conformance("kvspec.impl:reference", titled=TITLES, jobs=2)
    assert alone.status == "CONFORMS" and sum(rule.checks for rule in alone.rules) > 1000
    assert shared.to_json() == alone.to_json()  # every check counted alike: the same examples drawn


def test_a_factory_that_cannot_be_sent_to_a_worker_is_the_adapters_error_in_one_line() -> None:
    with pytest.raises(AdapterError, match=r"cannot be sent to worker processes .*\(jobs=1\)$"):
        conformance.run_conformance(
            lambda: Implementation(name="a lambda", radix_cache=RadixCache), titled=TITLES, jobs=2
        )


def test_an_adapter_a_worker_cannot_import_is_the_adapters_error(monkeypatch: pytest.MonkeyPatch) -> None:
    only_here = types.ModuleType("kvspec_only_in_this_process")
    only_here.factory = lambda: Implementation(name="only here", radix_cache=RadixCache)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, only_here.__name__, only_here)
    with pytest.raises(AdapterError, match="cannot import 'kvspec_only_in_this_process'"):
        conformance.run_conformance(f"{only_here.__name__}:factory", titled=TITLES, jobs=2)


class EndsItsWorker(RadixCache):
    """A cache whose construction ends the interpreter it runs in, as a crash in an engine's native code does."""

    def __init__(self) -> None:
        if multiprocessing.parent_process() is not None:  # only in a worker: this process must live on
            os._exit(3)
        super().__init__()


def ends_its_worker() -> Implementation:
    return Implementation(name="ends its worker", radix_cache=EndsItsWorker)


def test_a_worker_the_implementation_kills_is_the_adapters_error_not_a_hang() -> None:
    with pytest.raises(AdapterError, match="a worker process died while judging machine"):
        conformance.run_conformance(f"{__name__}:ends_its_worker", titled=TITLES, jobs=2)


def children_of(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone while listed
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="the parent's death reaches its workers through Linux's prctl")
def test_a_killed_verdict_leaves_no_worker_judging_on(tmp_path: Path) -> None:
    """SIGTERM, not Ctrl-C: the workers die with the parent instead of judging on, orphaned, for minutes."""
    check = subprocess.Popen(
        [sys.executable, "-m", "kvspec", "check", "--jobs", "2"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len(workers := children_of(check.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) >= 2, "the check never started its workers"
    finally:
        check.terminate()
        check.wait(10)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "workers outlived their killed parent"
