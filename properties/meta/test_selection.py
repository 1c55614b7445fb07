"""Choosing the implementation under test: a bad choice fails fast, a broken one fails loudly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "HYPOTHESIS_PROFILE": "ci"}  # derandomized: the same verdict every time
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False, env=environment, cwd=cwd
    )


def test_bad_kv_impl_fails_at_start_up_with_one_line(tmp_path: Path) -> None:
    result = run(
        "-m", "pytest", "-q", "--kv-impl=no_such_module:factory", "--pyargs", "kvspec.properties", cwd=tmp_path
    )
    assert result.returncode == 4  # pytest's usage error: nothing ran
    reason = [line for line in result.stderr.splitlines() if "--kv-impl" in line]
    assert len(reason) == 1 and "no_such_module" in reason[0], result.stderr


def test_pytest_plugin_from_another_project_names_the_invariant(tmp_path: Path) -> None:
    """The installed plugin: ``--kv-impl`` and ``--pyargs kvspec.properties`` from outside this checkout."""
    result = run(
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--kv-impl=kvspec.impl.broken.block_pool:leaks_on_free",
        "--kv-profile=ci",
        "--pyargs",
        "kvspec.properties.test_block_pool",
        "-k",
        "TestBlockPool and not Realistic",
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert "invariant_no_leak violated" in result.stdout
    # Hypothesis prints the shrunk sequence of rules (which rules depends on its shrinker's version)
    assert re.search(r"state\.start\(.*state\.(?!start)\w+\(", result.stdout, re.DOTALL), result.stdout


def test_kvspec_check_reports_the_violation_with_its_steps() -> None:
    result = run(
        "-m",
        "kvspec.cli",
        "check",
        "--impl",
        "kvspec.impl.broken.block_pool:leaks_on_free",
        "--machine",
        "block pool",
        "--json",
        "--jobs",
        "1",  # one process: kvspec.workers has its own test, and this one runs beside the suite's
    )
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    safety = report["tiers"]["safety"]
    violated = {row["invariant"] for row in safety["invariants"] if row["verdict"] == "VIOLATED"}
    assert "invariant_no_leak" in violated
    shown = [v["invariant"] for v in safety["violations"]]
    shown += [k["invariant"] for v in safety["violations"] for k in v["knock_ons"] if k["tier"] == "safety"]
    assert sorted(shown) == sorted(violated)  # every distinct finding once, as a root cause or under one
    for violation in safety["violations"]:
        assert violation["steps"][0].startswith("pool = block_pool(")
        assert violation["steps"][-1].startswith("pool.release")
    reached = [row for tier in report["tiers"].values() for row in tier["invariants"] if row["checks"]]
    assert all(row["verdict"] != "not reached" for row in reached)


def test_kvspec_check_passes_the_reference() -> None:
    result = run("-m", "kvspec.cli", "check", "--machine", "block pool", "--jobs", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CONFORMS" in result.stdout and "VIOLATED" not in result.stdout
