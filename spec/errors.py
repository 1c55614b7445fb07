"""The typed errors every kvspec implementation raises.

Rules:

* Every error an operation raises on bad input derives from ``KVSpecError``.
* ``OutOfBlocks`` means the request was well formed but the device is short
  of blocks right now; the caller may free, evict or preempt and try again.
* ``InvalidOperation`` means the request can never succeed as asked (unknown
  or freed sequence, double free, negative token, block size 0, ...).
* ``RequestTooLarge`` is the scheduler's refusal of a request that could not
  fit the device even if it ran alone: waiting would never help.
* An operation that raises leaves the state exactly as it was before the
  call ("no other consequences -- feel free to try again", as h11 puts it).
  The property suites check this after every rejected operation.
"""

from __future__ import annotations


class KVSpecError(Exception):
    """Base class of every error an implementation raises on bad input."""


class OutOfBlocks(KVSpecError):
    """Not enough free blocks for the request; nothing was allocated."""

    def __init__(self, requested: int, available: int, what: str = "blocks") -> None:
        super().__init__(f"need {requested} {what}, only {available} free")
        self.requested = requested
        self.available = available


class InvalidOperation(KVSpecError):
    """The operation is not allowed in the current state or with these arguments."""


class RequestTooLarge(InvalidOperation):
    """A request that could not fit the device even alone; rejected at arrival."""


def verdict(error: BaseException | None) -> str:
    """How an operation ended: 'ok', or the name of the error class it raised."""
    return "ok" if error is None else type(error).__name__
