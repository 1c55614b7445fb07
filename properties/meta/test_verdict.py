"""The verdict never misleads: each false green and mislabel found in review is a test here.

Nothing checked is never CONFORMS; an unusable adapter is exit 2 in one line, not a violation; optional
operations left out are "not offered", not violations; a caller-contract finding shows what it leads to,
measured; a finding on an emulated operation is the adapter's; a crash is its own finding, with its frame;
Ctrl-C keeps the verdict of what ran and is never CONFORMS; every finding's ``replay`` token runs its example
again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import settings as Settings

from kvspec import conformance, rounds
from kvspec.impl.block_manager import BlockManager
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.broken import block_pool as broken_pools
from kvspec.properties import suite
from kvspec.properties.loading import AdapterError, UsageError, load_implementation
from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import diff_states
from kvspec.spec.kv_transfer import KV_TRANSFER

QUICK = Settings(max_examples=25, stateful_step_count=25, derandomize=True, database=None)


def verdict_of(implementation: Implementation, *titles: str, path: str = "test") -> conformance.Verdict:
    """The verdict of these machines, on a small budget (kvspec.conformance's own rounds and probes)."""
    run = rounds.Run(implementation.complete_with(load_implementation("kvspec.impl:reference")), path)
    for title in titles:
        run.selected.update(suite.machine_titled(title).judges)
        run.machines.append(rounds.run_one(run, suite.declaration_titled(title), QUICK))
    rounds.measure_consequences(run, QUICK, None)
    return conformance.verdict_of(run, "quick")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "HYPOTHESIS_PROFILE": "ci", "XDG_CACHE_HOME": str(cwd / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "kvspec.cli", *args], capture_output=True, text=True, cwd=cwd, env=environment
    )


@pytest.mark.parametrize("titled", [["blok pool"], []])
def test_a_word_that_names_no_machine_is_a_usage_error(titled: list[str]) -> None:
    with pytest.raises(UsageError):
        conformance.run_conformance("kvspec.impl:reference", titled=titled)


def test_an_unknown_profile_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        conformance.run_conformance("kvspec.impl:reference", profile="cii")


@pytest.mark.parametrize(
    "declared",
    [
        {},  # no component at all
        {"block_pool": 42},
        {"block_pool": BlockPool(4, "lru")},  # a built pool, not a factory
        {"block_pool": object},  # a class without the protocol's methods
        {"block_manager": Offer(BlockManager, operations={KV_TRANSFER})},  # a scheduler's
    ],
    ids=["nothing", "42", "an instance", "a class without methods", "another kind's operation"],
)
def test_an_unusable_declaration_is_an_adapter_error(declared: dict[str, object]) -> None:
    with pytest.raises(AdapterError):
        conformance.run_conformance(lambda: Implementation(name="user's", **declared), titled=["block pool"])  # type: ignore[arg-type]


ADAPTER_ERRORS = {
    "raises": "def factory():\n    raise RuntimeError('no GPU')\n",
    "needs_arguments": "def factory(pool_size):\n    pass\n",
    "returns_a_pool": "from kvspec.impl.block_pool import BlockPool\ndef factory():\n    return BlockPool\n",
    "field_typo": (
        "from kvspec.spec.implementation import Implementation\nfrom kvspec.impl.block_pool import BlockPool\n"
        "def factory():\n    return Implementation(name='mine', blockpool=BlockPool)\n"
    ),
    "syntax_error": "def factory(:\n",
    "import_error": "import no_such_engine\ndef factory():\n    pass\n",
}


@pytest.mark.parametrize("module", sorted(ADAPTER_ERRORS))
def test_a_broken_adapter_is_exit_2_in_one_line(module: str, tmp_path: Path) -> None:
    """The module lives in the current directory: ``--impl`` finds it there, as ``python -m`` would."""
    (tmp_path / f"{module}.py").write_text(ADAPTER_ERRORS[module])
    result = cli("check", "--impl", f"{module}:factory", "--machine", "block pool", "--jobs", "1", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "adapter error" in result.stderr and module in result.stderr
    assert "Traceback" not in result.stderr


def test_an_empty_impl_is_a_usage_error_and_nothing_is_left_in_the_directory(tmp_path: Path) -> None:
    result = cli("check", "--impl", "", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "usage" in result.stderr
    result = cli("check", "--machine", "sliding-window", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cache"], "Hypothesis's files go to the cache"


def test_nothing_checked_is_its_own_verdict(tmp_path: Path) -> None:
    """An allocator judged only by machines that never build one: no machine judged it."""
    (tmp_path / "arena_only.py").write_text(
        "from kvspec.impl.contiguous import ContiguousAllocator\n"
        "from kvspec.spec.implementation import Implementation\n"
        "def factory():\n    return Implementation(name='arena', contiguous_allocator=ContiguousAllocator)\n"
    )
    result = cli("check", "--impl", "arena_only:factory", "--machine", "block pool", cwd=tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "NOTHING CHECKED" in result.stdout and "CONFORMS" not in result.stdout


def test_operations_left_out_are_not_offered_never_violated() -> None:
    """A block manager with neither fork nor swap: its machine runs, and the rules only those reach are
    "not offered"."""
    found = verdict_of(Implementation(name="no fork, no swap", block_manager=BlockManager), "block manager")
    rows = {rule.invariant: rule.verdict for rule in found.rules}
    assert found.conforms, str(found)
    assert rows["invariant_fork_allocates_nothing"] == conformance.NOT_OFFERED
    assert rows["invariant_read_back_exact"] == conformance.HELD


class AcceptsDoubleFree(broken_pools.AcceptsDoubleFree):
    """Trusts its caller as vLLM does: a double free drives the count below zero."""

    def evict(self, n: int) -> list[int]:
        return [] if n < 0 else super().evict(n)


def test_a_trusted_caller_contract_finding_shows_what_it_leads_to() -> None:
    pool = Offer(AcceptsDoubleFree, emulated={"evict"})
    trusting = Implementation(name="trusting", block_pool=pool, conventions=Conventions(trusts_caller=True))
    found = verdict_of(trusting, "block pool")
    assert found.conforms, "a declared trust is not a failure"
    release = [v for v in found.violations if v.operation == "release"]
    assert release and all("breaks" in v.leads_to and v.leads_to_steps for v in release), str(found)
    assert all(v.tier == "caller contract" for v in found.violations), "its safety held where the contract was kept"
    evict = [v for v in found.violations if v.operation == "evict"]
    assert evict and all(v.emulated for v in evict), "a finding on an emulated operation is the adapter's"


class ShareCrashes(BlockPool):
    def share(self, blocks: Sequence[int]) -> None:
        if len(blocks) > 2:
            raise ValueError("expected one or two blocks")
        super().share(blocks)


def test_a_crash_inside_the_implementation_is_its_own_finding_with_its_frame() -> None:
    found = verdict_of(Implementation(name="crashes", block_pool=ShareCrashes), "block pool")
    crash = [v for v in found.violations if v.invariant == "invariant_no_untyped_error"]
    assert crash and crash[0].tier == "safety", str(found)
    assert "ValueError: expected one or two blocks" in crash[0].detail and "in share" in crash[0].detail


def test_ctrl_c_keeps_the_verdict_of_what_ran() -> None:
    def interrupt_at_the_second(line: str) -> None:
        if line.startswith("[2/"):
            raise KeyboardInterrupt

    found = conformance.run_conformance(
        "kvspec.impl.broken.block_pool:leaks_on_free", titled=["block pool"], progress=interrupt_at_the_second
    )
    assert found.interrupted and found.status == conformance.VIOLATED
    assert [m.ended for m in found.machines][-1] == "interrupted"


def test_ctrl_c_before_any_finding_is_interrupted_never_conforms(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ran is kept (the first machine's checks, the machines not started), and no verdict is given."""
    monkeypatch.setattr(rounds, "profile_settings", lambda profile: QUICK)

    def interrupt_at_the_second(line: str) -> None:
        if line.startswith("[2/"):
            raise KeyboardInterrupt

    found = conformance.run_conformance(
        "kvspec.impl:reference", titled=["block pool (1,024", "sliding-window"], progress=interrupt_at_the_second
    )
    assert (found.status, found.conforms, found.exit_status) == (conformance.INTERRUPTED, None, 130)
    assert [m.ended for m in found.machines] == ["nothing new", "interrupted"] and found.counted == 1
    assert any(rule.verdict == conformance.HELD for rule in found.rules)
    assert found.to_json()["conforms"] is None and found.summary().startswith("INTERRUPTED: no verdict -- 1 of 2")

    def interrupt_at_once(line: str) -> None:
        raise KeyboardInterrupt

    nothing = conformance.run_conformance("kvspec.impl:reference", titled=["block pool"], progress=interrupt_at_once)
    assert nothing.status == conformance.INTERRUPTED and nothing.not_started == ("block pool (1,024 blocks)",)


def test_every_finding_replays_as_printed() -> None:
    path = "kvspec.impl.broken.block_pool:evicts_in_use_blocks"
    found = verdict_of(load_implementation(path), "block pool", path=path)
    for violation in (*found.violations, *(k for v in found.violations for k in v.knock_ons)):
        _, replayed = conformance.replay(violation.replay)
        assert replayed is not None and replayed.invariant is not None, violation.heading
        assert (replayed.invariant.name, replayed.steps) == (violation.invariant, violation.steps)


def test_a_refinement_diff_shows_only_the_entries_that_differ() -> None:
    reference = BlockPool(1024, "lru")
    changed = BlockPool(1024, "lru")
    changed.allocate(1)
    shown = diff_states(changed.snapshot(), reference.snapshot())
    assert len(shown) < 400 and "refcounts: [0] implementation 1, spec 0" in shown
