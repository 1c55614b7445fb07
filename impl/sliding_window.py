"""The reference sliding-window managers (spec.sliding_window): tables whose dropped entries are None, and rings."""

from __future__ import annotations

from kvspec.spec.block_manager import blocks_for, check_block_size
from kvspec.spec.block_pool import BlockPool
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.sliding_window import SeqId, Table, WindowState, in_window, ring_blocks


class SlidingWindowManager:
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
        self._grow(seq, self._check_count(n, 0))

    def free(self, seq: SeqId) -> None:
        self._pool.release([b for b in self._table(seq)[::-1] if b is not None])
        del self._tables[seq], self._lengths[seq]

    def block_table(self, seq: SeqId) -> Table:
        return tuple(self._table(seq))

    def snapshot(self) -> WindowState:
        tables = {seq: tuple(table) for seq, table in self._tables.items()}
        return WindowState(self._block_size, self._window, self._pool.snapshot(), tables, dict(self._lengths))

    def _grow(self, seq: SeqId, added: int) -> None:
        table, size = self._tables[seq], self._block_size
        length = self._lengths[seq] + added
        dropped = [i for i, b in enumerate(table) if b is not None and not in_window(i, length, size, self._window)]
        fresh = [i for i in range(len(table), blocks_for(length, size)) if in_window(i, length, size, self._window)]
        if len(fresh) > self._pool.num_free() + len(dropped):
            raise OutOfBlocks(len(fresh), self._pool.num_free() + len(dropped))
        self._drop(table, dropped)
        blocks = self._pool.allocate(len(fresh))
        table += [None] * (blocks_for(length, size) - len(table) - len(fresh))
        table += blocks
        self._lengths[seq] = length

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


class RingSlidingWindowManager(SlidingWindowManager):
    """Declares ``WindowConventions(slid_out="ring")``: a sequence keeps the blocks of its last ``window`` tokens
    as a ring and reuses them in place; nothing slides out of its table."""

    def _grow(self, seq: SeqId, added: int) -> None:
        table, length = self._tables[seq], self._lengths[seq] + added
        table += self._pool.allocate(ring_blocks(length, self._block_size, self._window) - len(table))
        self._lengths[seq] = length
