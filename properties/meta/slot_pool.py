"""A third party's component for the example layer (``request_slots``), a broken one, and their declarations."""

from __future__ import annotations

from kvspec.properties.meta.request_slots import SlotState
from kvspec.spec.components import Offer
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation


class SlotPool:
    def __init__(self, size: int) -> None:
        self._size, self._held = size, set[int]()

    def acquire(self) -> int:
        free = [slot for slot in range(self._size) if slot not in self._held]
        if not free:
            raise OutOfBlocks(1, 0, "slots")
        self._held.add(free[0])
        return free[0]

    def release(self, slot: int) -> None:
        if slot not in self._held:
            raise InvalidOperation(f"slot {slot!r} is not held")
        self._held.remove(slot)

    def snapshot(self) -> SlotState:
        return SlotState(self._size, frozenset(self._held))


class CountsItsSlots(SlotPool):
    """Hands out slot number ``len(held)``: right until a slot below the last is released."""

    def acquire(self) -> int:
        if len(self._held) == self._size:
            raise OutOfBlocks(1, 0, "slots")
        self._held.add(len(self._held))
        return len(self._held) - 1


def factory() -> Implementation:
    return Implementation(name="example slot pool", slot_pool=Offer(SlotPool))


def broken_factory() -> Implementation:
    return Implementation(name="example slot pool, broken", slot_pool=Offer(CountsItsSlots))
