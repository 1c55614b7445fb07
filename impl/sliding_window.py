"""The reference sliding-window managers (spec.sliding_window): tables whose dropped entries are None, and rings.

``SlidingWindowManager`` takes its choices from its class's ``conventions`` (the reference's by default):
``window_of`` and ``release`` say which blocks a write keeps and when the others go.  Its subclass
``NextTokenWindowManager`` is vLLM's choice (the next token's window, released at the next allocation);
``RingSlidingWindowManager`` is HF transformers' ring.
"""

from __future__ import annotations

from typing import ClassVar

from kvspec.spec.block_manager import blocks_for, check_block_size
from kvspec.spec.block_pool import BlockPool
from kvspec.spec.conventions import WindowConventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.sliding_window import SeqId, Table, WindowState, first_in_window, ring_blocks


class SlidingWindowManager:
    conventions: ClassVar[WindowConventions] = WindowConventions()  # the window choices it makes

    def __init__(self, pool: BlockPool, block_size: int, window: int) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise InvalidOperation(f"a window is a positive number of tokens, got {window!r}")
        self._pool, self._block_size, self._window = pool, check_block_size(block_size), window
        self._tables: dict[SeqId, list[int | None]] = {}
        self._lengths: dict[SeqId, int] = {}

    def add_sequence(self, seq: SeqId, length: int) -> None:
        self._check_count(length, 1)
        if seq in self._tables:
            raise InvalidOperation(f"sequence {seq!r} already exists")
        self._tables[seq], self._lengths[seq] = [], 0
        try:
            self._grow(seq, length)
        except OutOfBlocks:
            del self._tables[seq], self._lengths[seq]
            raise

    def append(self, seq: SeqId, n: int) -> None:
        self._table(seq)
        self._grow(seq, n if type(n) is int and n >= 0 else self._check_count(n, 0))

    def free(self, seq: SeqId) -> None:
        self._pool.release([b for b in self._table(seq)[::-1] if b is not None])
        del self._tables[seq], self._lengths[seq]

    def block_table(self, seq: SeqId) -> Table:
        return tuple(self._table(seq))

    def snapshot(self) -> WindowState:
        tables = {seq: tuple(table) for seq, table in self._tables.items()}
        return WindowState(self._block_size, self._window, self._pool.snapshot(), tables, dict(self._lengths))

    def _grow(self, seq: SeqId, added: int) -> None:
        """Drop what the window of the new length leaves, then allocate the new logical blocks in it."""
        table, length = self._tables[seq], self._lengths[seq] + added
        dropped = self._slid_out(table, length)
        end = blocks_for(length, self._block_size)
        fresh = max(0, end - max(len(table), self._first_in_window(length)))  # the new logical blocks in the window
        if fresh and fresh > self._pool.num_free() + len(dropped):
            raise OutOfBlocks(fresh, self._pool.num_free() + len(dropped))
        if dropped:
            self._drop(table, dropped)
        if end > len(table):  # most appends add a token to the last block: no pool call
            blocks = self._pool.allocate(fresh)
            table += [None] * (end - len(table) - fresh)
            table += blocks
        self._lengths[seq] = length

    def _first_in_window(self, length: int) -> int:
        return first_in_window(length, self._block_size, self._window, self.conventions.window_of)

    def _slid_out(self, table: list[int | None], length: int) -> list[int]:
        """The entries of ``table`` that name a block outside the window of ``length`` tokens.  The window only
        moves forward and a table's blocks follow its dropped entries, so these are the blocks just before the
        window's first one, found from there back: O(blocks slid out) a token, not O(table)."""
        end = min(len(table), self._first_in_window(length))
        start = end
        while start and table[start - 1] is not None:
            start -= 1
        return list(range(start, end))

    def _drop(self, table: list[int | None], dropped: list[int]) -> None:
        """Release the blocks that slid out of the window, last first, and clear their entries."""
        self._pool.release([block for i in dropped[::-1] if (block := table[i]) is not None])
        for i in dropped:
            table[i] = None

    def _check_count(self, n: object, least: int) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < least:
            raise InvalidOperation(f"a token count must be an int >= {least}, got {n!r}")
        return n

    def _table(self, seq: SeqId) -> list[int | None]:
        try:
            return self._tables[seq]
        except (KeyError, TypeError):
            raise InvalidOperation(f"sequence {seq!r} does not exist (never added, or freed)") from None


class NextTokenWindowManager(SlidingWindowManager):
    """Declares vLLM's choices: a block is kept for the window of the token computed next, and one that slid out
    is released at the sequence's next allocation -- before room is counted, so a refused one releases it too."""

    conventions = WindowConventions(window_of="next_token", release="at_next_allocation")

    def _grow(self, seq: SeqId, added: int) -> None:
        if not added:
            return  # nothing to compute: no allocation
        table, length = self._tables[seq], self._lengths[seq]
        self._drop(table, self._slid_out(table, length))
        fresh = blocks_for(length + added, self._block_size) - len(table)
        table += self._pool.allocate(fresh)  # all or nothing: OutOfBlocks leaves what was dropped dropped
        self._lengths[seq] = length + added


class RingSlidingWindowManager(SlidingWindowManager):
    """Declares ``WindowConventions(slid_out="ring")``: a sequence keeps the blocks of its last ``window`` tokens
    as a ring and reuses them in place; nothing slides out of its table."""

    conventions = WindowConventions(slid_out="ring")

    def _grow(self, seq: SeqId, added: int) -> None:
        table, length = self._tables[seq], self._lengths[seq] + added
        table += self._pool.allocate(ring_blocks(length, self._block_size, self._window) - len(table))
        self._lengths[seq] = length
