"""Whose finding it is: the implementation's, never kvspec's machine, when the implementation misbehaves.

* An implementation that answers the same calls differently (a background thread, the clock) has a
  finding of its own kind, ``nondeterministic``, that shows both answers -- never Hypothesis's
  ``FlakyStrategyDefinition`` filed as kvspec's ``harness`` failure.
* An example Hypothesis ends itself (it ran out of data) files nothing: no ``Frozen`` error of kvspec's
  beside the implementation's true finding (an allocator that changes a list it answered).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvspec import conformance
from kvspec.impl.block_pool import BlockPool
from kvspec.spec.implementation import Implementation


class Racy(BlockPool):
    """Hands out a call's blocks in an order a count kept across pools decides, as a pool fed by a background
    thread may order them by its timing (a count, not the clock: the test itself stays deterministic)."""

    calls = itertools.count()

    def allocate(self, n: int) -> list[int]:
        blocks = super().allocate(n)
        return blocks[::-1] if next(Racy.calls) % 3 == 0 else blocks


class ChangesItsAnswer(BlockPool):
    """Keeps the list ``allocate`` answered, and appends to it on the next release."""

    answered: list[int] | None = None

    def allocate(self, n: int) -> list[int]:
        self.answered = super().allocate(n)
        return self.answered

    def release(self, blocks: Sequence[int]) -> None:
        super().release(blocks)
        if self.answered:
            self.answered.append(0)


def racy() -> Implementation:
    return Implementation(name="racy", block_pool=Racy)


def changes_its_answer() -> Implementation:
    return Implementation(name="changes its answer", block_pool=ChangesItsAnswer)


def test_an_implementation_answering_the_same_calls_differently_is_its_own_finding() -> None:
    verdict = conformance.run_conformance(f"{__name__}:racy", titled=["block pool"])
    tiers = [v.tier for v in verdict.violations]  # its answers differ from the model's too, now and then
    assert "nondeterministic" in tiers and "harness" not in tiers, str(verdict)
    finding = next(v for v in verdict.violations if v.tier == "nondeterministic")
    assert "after these calls once, and" in finding.detail and finding.steps, finding


def test_an_example_hypothesis_ends_itself_files_nothing_of_kvspecs() -> None:
    verdict = conformance.run_conformance(f"{__name__}:changes_its_answer", titled=["block pool"])
    assert {v.invariant for v in verdict.violations} == {"invariant_answer_not_changed_later"}, str(verdict)
