"""Safety is judged on the implementation: no machine hands a safety rule a value derived from the model.

``provenance`` reads each machine's source; the harness refuses, at run time, a safety rule handed the
model itself or judged ``against_model``.  Both have teeth, shown here on machines written to break them.
"""

from __future__ import annotations

import pkgutil

import pytest
from hypothesis import settings as Settings
from hypothesis.stateful import rule

from kvspec import properties
from kvspec.properties.loading import load_implementation
from kvspec.properties.meta.provenance import safety_checks_reading_the_model
from kvspec.properties.meta.teeth import DETECTION
from kvspec.properties.running import run_machine
from kvspec.properties.test_block_pool import BlockPoolMachine
from kvspec.spec import block_pool

MACHINE_MODULES = sorted(
    f"{properties.__name__}.{module.name}"
    for module in pkgutil.iter_modules(properties.__path__)
    if module.name.startswith("test_")
)


@pytest.mark.parametrize("module", MACHINE_MODULES)
def test_no_safety_rule_reads_the_model(module: str) -> None:
    found = [f"{f.where} (line {f.line}): {f.rule} <- {f.argument}" for f in safety_checks_reading_the_model(module)]
    assert not found, "safety rules given values derived from the model:\n" + "\n".join(found)


class CountsTheModel(BlockPoolMachine):
    """Its safety check compares the pool with the model's own counts: what ``provenance`` must flag."""

    @rule()
    def counts_against_the_model(self) -> None:
        holders = dict(enumerate(self.pool.model.refcounts))
        self.check(block_pool.invariant_refcount_matches_holders, self.pool.snapshot(), holders)


class HandsOverTheModel(BlockPoolMachine):
    """Its safety check is handed the model object itself: what the harness refuses at run time."""

    @rule()
    def checks_the_model(self) -> None:
        self.check(block_pool.invariant_free_queue_exact, self.pool.model)


def test_provenance_flags_a_safety_rule_fed_from_the_model() -> None:
    flagged = {finding.where for finding in safety_checks_reading_the_model(__name__)}
    assert flagged == {
        f"{__name__}:CountsTheModel.counts_against_the_model",
        f"{__name__}:HandsOverTheModel.checks_the_model",
    }


def test_the_harness_refuses_a_safety_rule_handed_the_model() -> None:
    settings = Settings(Settings(), derandomize=True, database=None, phases=DETECTION, max_examples=10)
    outcome = run_machine(HandsOverTheModel, load_implementation("kvspec.impl:reference"), settings)
    assert outcome.finding is not None and outcome.finding.invariant is None
    assert "checks the safety rule invariant_free_queue_exact against the model" in outcome.finding.detail
