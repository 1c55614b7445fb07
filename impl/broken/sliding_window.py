"""Broken sliding-window managers: each breaks a rule of ``kvspec.spec.sliding_window`` and declares what catches it."""

from __future__ import annotations

from kvspec.impl.broken import members
from kvspec.impl.sliding_window import NextTokenWindowManager, RingSlidingWindowManager, SlidingWindowManager
from kvspec.spec import block_pool
from kvspec.spec import sliding_window as spec
from kvspec.spec.block_manager import blocks_for
from kvspec.spec.conventions import Conventions
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import Invariant
from kvspec.spec.sliding_window import SeqId

declare = members("sliding_window_manager", "sliding-window tables")


def window(name: str, manager: type[SlidingWindowManager], *rules: Invariant) -> Implementation:
    """The member ``broken: name`` whose manager is ``manager``, caught by each of ``rules``, declaring the window
    choices its manager's class makes (the reference's, unless it subclasses another reference manager)."""
    return declare(name, manager, *rules, conventions=Conventions(window=manager.conventions))


class StaleEntryAfterSlide(SlidingWindowManager):
    """Releases a block that slid out but leaves its entry: the block, handed out again for the next logical
    block, is named twice, and freeing the sequence releases it twice."""

    def _drop(self, table: list[int | None], dropped: list[int]) -> None:
        self._pool.release([block for i in dropped[::-1] if (block := table[i]) is not None])


stale_entry_after_slide = window(
    "a slid-out block stays in the table", StaleEntryAfterSlide, block_pool.invariant_refcount_matches_holders
)


class KeepsWholeHistory(SlidingWindowManager):
    """Never drops a block: the window is applied to attention only, the memory it promised back stays held."""

    def _drop(self, table: list[int | None], dropped: list[int]) -> None:
        """Nothing is released."""


keeps_whole_history = window("the window never drops a block", KeepsWholeHistory, spec.invariant_window_blocks_exact)


class FreesFrontToBack(SlidingWindowManager):
    """Frees a table front to back, so the window's last block -- the least likely to be shared -- is kept longest."""

    def free(self, seq: SeqId) -> None:
        self._pool.release([b for b in self._table(seq) if b is not None])
        del self._tables[seq], self._lengths[seq]


frees_front_to_back = window("frees a window table front to back", FreesFrontToBack, spec.invariant_window_refines_spec)


class RingOfWholeBlocksOnly(RingSlidingWindowManager):
    """Declares the ring (HF transformers' shape) and sizes it as ``window // block_size`` blocks: with a window
    that is not a whole number of blocks, the oldest tokens still in the window are overwritten by the newest."""

    def _grow(self, seq: SeqId, added: int) -> None:
        table, length = self._tables[seq], self._lengths[seq] + added
        ring = max(1, min(blocks_for(length, self._block_size), self._window // self._block_size))
        table += self._pool.allocate(max(0, ring - len(table)))
        self._lengths[seq] = length


ring_of_whole_blocks_only = window(
    "a ring of window // block size blocks", RingOfWholeBlocksOnly, spec.invariant_window_blocks_exact
)


class RoundsSkippedBlocksUp(NextTokenWindowManager):
    """Declares vLLM's choices and counts the blocks the next token's window skips rounding up: the block the
    window starts in is released at the next allocation, though attention still reads its last tokens."""

    def _slid_out(self, table: list[int | None], length: int) -> list[int]:
        skipped = -(-spec.window_start(length, self._window, "next_token") // self._block_size)
        return [i for i, block in enumerate(table[: max(0, skipped)]) if block is not None]


rounds_skipped_blocks_up = window(
    "releases the block the next token's window starts in", RoundsSkippedBlocksUp, spec.invariant_window_blocks_exact
)


class KeepsSlidOutThroughRefusal(NextTokenWindowManager):
    """A legal choice kvspec does not model: declares vLLM's choices, but counts room before releasing what slid
    out, so a refused append releases nothing -- the slid-out blocks wait for the next allocation that succeeds.
    Held one step longer is no leak: only the state differs from the model's (a convention finding)."""

    def _grow(self, seq: SeqId, added: int) -> None:
        table, length = self._tables[seq], self._lengths[seq]
        fresh = blocks_for(length + added, self._block_size) - len(table)
        slid = self._slid_out(table, length) if added else []
        if fresh > self._pool.num_free() + len(slid):
            raise OutOfBlocks(fresh, self._pool.num_free() + len(slid))
        super()._grow(seq, added)


keeps_slid_out_through_refusal = window(
    "a legal choice: a refused append keeps what slid out",
    KeepsSlidOutThroughRefusal,
    spec.invariant_window_refines_spec,
)
