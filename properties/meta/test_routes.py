"""One route to a verdict: pytest and ``run_conformance`` run the same machines under the same settings.

pytest collects every ``ConformanceTest`` a test module declares (``kvspec.pytest_plugin``);
``run_conformance`` walks ``suite.declarations()``.  Both bind a declaration through its own
``settings``; these tests hold the lists and the settings to each other.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import attrs
import pytest
from hypothesis import settings as Settings

from kvspec import rounds
from kvspec.properties import running, suite
from kvspec.properties.harness import LockstepMachine, Statistics
from kvspec.properties.loading import REFERENCE, load_implementation
from kvspec.properties.running import ConformanceTest

PROPERTIES = Path(__file__).resolve().parents[1]


def declared_in_test_modules() -> list[ConformanceTest]:
    """What pytest collects from kvspec's own test modules (the guide's example layer, in meta/, aside)."""
    found = []
    for path in sorted(PROPERTIES.glob("test_*.py")):
        module = importlib.import_module(f"kvspec.properties.{path.stem}")
        found += [d for value in vars(module).values() if (d := running.declaration_of(value)) is not None]
    return found


def test_pytest_collects_exactly_the_suite_run_conformance_walks() -> None:
    collected = declared_in_test_modules()
    assert set(map(id, collected)) == set(map(id, suite.declarations()))
    titles = [declaration.title for declaration in suite.declarations()]
    assert len(titles) == len(set(titles)), "two machines share a title: --machine and replay tokens could not tell"


@pytest.mark.parametrize("declaration", suite.declarations(), ids=lambda d: d.title)
def test_both_routes_bind_a_machine_under_the_same_settings(
    declaration: ConformanceTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings pytest's binding carries, and those ``kvspec check`` runs the machine under."""
    reference = load_implementation(REFERENCE)
    base = Settings.get_profile("ci")
    collected = declaration.bind(reference, base).settings
    ran: list[tuple[type[LockstepMachine], Settings]] = []

    def record(machine: type[LockstepMachine], implementation: object, settings: Settings, **_: object) -> object:
        ran.append((machine, settings))
        return running.Outcome(machine.__name__, (), Statistics())

    monkeypatch.setattr(running, "run_machine", record)
    run = rounds.Run(attrs.evolve(reference, borrowed=frozenset()), REFERENCE)
    rounds.run_one(run, declaration, base)
    if declaration.machine.not_offered(reference):
        assert not ran
        return
    assert [machine for machine, _ in ran] == [declaration.machine]
    checked = ("max_examples", "stateful_step_count", "derandomize", "deadline", "database")
    assert {name: getattr(ran[0][1], name) for name in checked} == {name: getattr(collected, name) for name in checked}
