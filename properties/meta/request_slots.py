"""A third party's layer -- request slots: the fixed table of per-request rows an engine hands out.

(The example of ``docs/new-layer.md``: a layer kvspec does not ship, declared
and checked without editing kvspec.)

Rules:

* ``acquire()`` hands out the lowest free slot; with none free it raises
  ``OutOfBlocks`` and changes nothing.
* ``release(slot)`` takes a held slot back; a slot that is not held is an
  ``InvalidOperation``.

Invariants (tier in brackets):

* ``invariant_slot_held_once`` [safety] -- no slot is handed to two holders.
* ``invariant_slots_refine_spec`` [convention] -- the implementation is in the
  model's state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec.components import component_kind
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.invariants import invariant, refinement


@attrs.frozen
class SlotState:
    """The abstract state: how many slots there are, and which are held."""

    size: int
    held: frozenset[int]


@runtime_checkable
class SlotPool(Protocol):
    def acquire(self) -> int: ...
    def release(self, slot: int) -> None: ...
    def snapshot(self) -> SlotState: ...


SLOT_POOL = component_kind("slot_pool", SlotPool, builds="slot_pool(size)")


def new_slots(size: int) -> SlotState:
    return SlotState(size, frozenset())


def acquire(state: SlotState) -> tuple[SlotState, int]:
    free = [slot for slot in range(state.size) if slot not in state.held]
    if not free:
        raise OutOfBlocks(1, 0, "slots")
    return attrs.evolve(state, held=state.held | {free[0]}), free[0]


def release(state: SlotState, slot: int) -> SlotState:
    if slot not in state.held:
        raise InvalidOperation(f"slot {slot!r} is not held")
    return attrs.evolve(state, held=state.held - {slot})


@invariant("two requests writing one slot read each other's tokens", "safety")
def invariant_slot_held_once(handed_out: Sequence[int]) -> str | None:
    """``handed_out``: every slot the callers hold, as the implementation answered them."""
    twice = sorted(slot for slot, holders in Counter(handed_out).items() if holders > 1)
    return f"slots {twice} are held twice" if twice else None


invariant_slots_refine_spec = refinement("invariant_slots_refine_spec")
