"""Broken sliding-window managers: each breaks a rule of ``kvspec.spec.sliding_window`` and declares what catches it."""

from __future__ import annotations

from kvspec.impl.broken import caught_by, member
from kvspec.impl.sliding_window import SlidingWindowManager
from kvspec.spec import block_pool
from kvspec.spec import sliding_window as spec
from kvspec.spec.implementation import Implementation
from kvspec.spec.sliding_window import SeqId


class StaleEntryAfterSlide(SlidingWindowManager):
    """Releases a block that slid out but leaves its entry: the block, handed out again for the next logical
    block, is named twice, and freeing the sequence releases it twice."""

    def _drop(self, table: list[int | None], dropped: list[int]) -> None:
        self._pool.release([block for i in dropped[::-1] if (block := table[i]) is not None])


class KeepsWholeHistory(SlidingWindowManager):
    """Never drops a block: the window is applied to attention only, the memory it promised back stays held."""

    def _drop(self, table: list[int | None], dropped: list[int]) -> None:
        """Nothing is released."""


class FreesFrontToBack(SlidingWindowManager):
    """Frees a table front to back, so the window's last block -- the least likely to be shared -- is kept longest."""

    def free(self, seq: SeqId) -> None:
        self._pool.release([b for b in self._table(seq) if b is not None])
        del self._tables[seq], self._lengths[seq]


@caught_by(spec.invariant_window_blocks_exact, "sliding-window tables")
def keeps_whole_history() -> Implementation:
    return member("broken: the window never drops a block", sliding_window_manager=KeepsWholeHistory)


@caught_by(spec.invariant_window_refines_spec, "sliding-window tables")
def frees_front_to_back() -> Implementation:
    return member("broken: frees a window table front to back", sliding_window_manager=FreesFrontToBack)


@caught_by(block_pool.invariant_refcount_matches_holders, "sliding-window tables")
def stale_entry_after_slide() -> Implementation:
    return member("broken: a slid-out block stays in the table", sliding_window_manager=StaleEntryAfterSlide)
