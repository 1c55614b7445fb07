"""The example of ``docs/new-layer.md``: a layer added from outside kvspec, its machine, and its verdicts.

The guide shows these files; ``test_the_guide_shows_the_example`` keeps it showing them as they are.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

import kvspec
from kvspec.properties.harness import LockstepMachine
from kvspec.properties.meta import request_slots, slot_pool
from kvspec.properties.running import conformance_test


class SlotMachine(LockstepMachine):
    uses = frozenset({"slot_pool"})
    judges = ("request_slots", "invariants")

    @initialize(size=st.integers(1, 4))
    def start(self, size: int) -> None:
        self.record(f"slots = slot_pool({size})")
        pool = self.implementation.component("slot_pool")(size)
        self.slots = self.subject("slots", request_slots, request_slots.new_slots(size), pool)
        self.held: list[int] = []

    @rule()
    def acquire(self) -> None:
        answer = self.slots("acquire")
        if answer is not None:
            self.held.append(answer.actual)
            self.check(request_slots.invariant_slot_held_once, self.held)

    @rule(index=st.integers(0, 3), held=st.booleans())
    def release(self, index: int, held: bool) -> None:
        """A slot the caller holds, or (out of contract) any slot."""
        slot = self.held[index % len(self.held)] if held and self.held else index
        if self.slots("release", slot) is not None:
            self.held.remove(slot)

    @invariant()
    def matches_spec(self) -> None:
        self.check(request_slots.invariant_slots_refine_spec, self.slots.snapshot(), self.slots.model)


# one declaration for both routes: pytest collects it; run_conformance(machines=[TestSlots]) runs it (kvspec's own run:
# not offered, the reference has no slot_pool)
TestSlots = conformance_test(SlotMachine, "request slots")


def test_the_example_conforms() -> None:
    verdict = kvspec.run_conformance(slot_pool.factory, titled=["request slots"], machines=[TestSlots])
    assert verdict.conforms, str(verdict)
    rows = {rule.invariant: rule.verdict for rule in verdict.rules if rule.layer == "request_slots"}
    assert rows == {"invariant_slot_held_once": "held", "invariant_slots_refine_spec": "held"}, rows


def test_the_broken_member_is_caught_by_safety() -> None:
    verdict = kvspec.run_conformance(slot_pool.broken_factory, titled=["request slots"], machines=[TestSlots])
    assert not verdict.conforms
    assert "invariant_slot_held_once" in {v.invariant for v in verdict.violations if v.tier == "safety"}, str(verdict)


def test_the_guide_shows_the_example() -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "new-layer.md").read_text()
    shown = dict(re.findall(r"`properties/meta/(\w+\.py)`:\n\n```python\n(.*?)```", guide, re.S))
    here = Path(__file__).parent
    assert set(shown) == {"request_slots.py", "slot_pool.py", "test_new_layer.py"}
    for name, code in shown.items():
        assert code in (here / name).read_text(), f"docs/new-layer.md shows {name} otherwise than it is"
