"""Sliding-window block tables: a sequence keeps only the blocks its attention window still reads.

Rules (Mistral-style sliding-window attention; vLLM's sliding-window manager):

* A sequence of length L attends to its last ``window`` (W) tokens.  Logical
  block i (tokens ``i*B .. i*B + B - 1``) is **in the window** iff it holds a
  token at a position >= L - W, i.e. ``(i + 1) * B > L - W``.
* Its table has one entry per logical block: the physical block for a block
  in the window, ``None`` for one that has slid out -- **dropped**: released
  to the pool, its entry cleared (vLLM's null block, named by many entries
  and held by none).
* The decision "count = holders" needs: a block's reference count equals the
  entries *in the window* that name it.  A dropped entry holds nothing, so a
  table that names a block twice -- a stale entry left behind when a dropped
  block is reused for a new logical block -- holds it twice and is wrong.
* ``add_sequence(seq, length)`` allocates only the blocks of the prompt's
  window (the earlier ones are dropped as the prefill passes them);
  ``append(seq, n)`` first drops the blocks that leave the window, then
  allocates the new logical blocks, so a dropped block can be reused at once;
  ``free(seq)`` releases the blocks in the window, last first.  All or
  nothing: short of blocks (counting those the append drops), ``OutOfBlocks``
  and no change.
* Ownership: nothing but ints is passed; tables answered belong to the caller.

Conventions (``spec.conventions.WindowConventions``; the reference's first):

* ``slid_out`` -- ``dropped``, as above.  Under ``ring`` (HF transformers'
  ``SlidingAttentionCacheAllocator``) nothing is dropped: a sequence of length
  L holds ``ceil(min(L, W) / B)`` blocks, every entry of its table a block,
  and position p lives at slot ``(p mod W) mod B`` of entry ``(p mod W) div
  B`` -- written over the token W positions back, which has left the window.
  The table grows to ``ceil(W / B)`` entries and no further; ``append``
  allocates only what it adds (all or nothing), ``free`` releases the table
  last first, as under ``dropped``.  ``invariant_window_blocks_exact`` takes
  the declared convention and checks the ring's rule.  The functions ``ring``
  replaces are marked below.

Invariants:

* ``invariant_window_blocks_exact`` [safety] -- a sequence holds a block for
  every logical block in its window and none for one outside it; under
  ``ring``, exactly the blocks its ring needs, ``ceil(min(L, W) / B)``.
* The pool's ``STATE`` group, with the holders of a block being the entries
  in windows that name it (``holders``): counts equal holders, no leak.
* ``invariant_window_refines_spec`` [convention] -- the implementation is in the model's state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec import block_pool
from kvspec.spec.block_manager import blocks_for, check_block_size
from kvspec.spec.block_pool import Pool, PoolState
from kvspec.spec.components import component_kind
from kvspec.spec.conventions import REFERENCE, WindowConventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.invariants import diff_states, invariant

SeqId = Hashable
Table = tuple[int | None, ...]


@attrs.frozen
class WindowState:
    """What ``snapshot()`` returns (and the model is): the pool, each table and each length."""

    block_size: int
    window: int
    pool: PoolState
    tables: Mapping[SeqId, Table]
    lengths: Mapping[SeqId, int]


@runtime_checkable
class WindowManager(Protocol):
    """``sliding_window_manager(pool, block_size, window)`` builds one."""

    def add_sequence(self, seq: SeqId, length: int) -> None: ...
    def append(self, seq: SeqId, n: int) -> None: ...
    def free(self, seq: SeqId) -> None: ...
    def block_table(self, seq: SeqId) -> Table: ...
    def snapshot(self) -> WindowState: ...


SLIDING_WINDOW_MANAGER = component_kind(
    "sliding_window_manager",
    builds="sliding_window_manager(pool, block_size, window)",
    methods=("add_sequence", "append", "free", "block_table", "snapshot"),
)


@attrs.frozen
class Windows:
    block_size: int
    window: int
    pool: Pool
    tables: Mapping[SeqId, Table]
    lengths: Mapping[SeqId, int]
    conventions: WindowConventions = REFERENCE.window


def new_windows(block_size: int, window: int, pool: Pool, conventions: WindowConventions = REFERENCE.window) -> Windows:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InvalidOperation(f"a window is a positive number of tokens, got {window!r}")
    return Windows(check_block_size(block_size), window, pool, {}, {}, conventions)


def in_window(index: int, length: int, block_size: int, window: int) -> bool:
    return (index + 1) * block_size > length - window


def holders(tables: Mapping[SeqId, Table]) -> Counter[int]:
    return Counter(block for table in tables.values() for block in table if block is not None)


def abstract(windows: Windows) -> WindowState:
    pool = block_pool.abstract(windows.pool)
    return WindowState(windows.block_size, windows.window, pool, dict(windows.tables), dict(windows.lengths))


def _count(n: object, least: int) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < least:
        raise InvalidOperation(f"a token count must be an int >= {least}, got {n!r}")
    return n


def _grow(windows: Windows, seq: SeqId, table: Table, length: int, added: int) -> Windows:
    """Drop what leaves the window of ``length + added`` tokens, then allocate the new logical blocks."""
    if windows.conventions.slid_out == "ring":
        return _grow_ring(windows, seq, table, length + added)
    size, window, pool = windows.block_size, windows.window, windows.pool
    new_length = length + added
    dropped = {i: b for i, b in enumerate(table) if b is not None and not in_window(i, new_length, size, window)}
    fresh = [i for i in range(len(table), blocks_for(new_length, size)) if in_window(i, new_length, size, window)]
    if len(fresh) > len(pool.lru) + len(dropped):
        raise OutOfBlocks(len(fresh), len(pool.lru) + len(dropped))
    pool = block_pool.release(pool, list(dropped.values())[::-1])
    pool, blocks = block_pool.allocate(pool, len(fresh))
    entries = [None if i in dropped else b for i, b in enumerate(table)]
    entries += [None] * (blocks_for(new_length, size) - len(table) - len(fresh)) + list(blocks)
    return attrs.evolve(
        windows, pool=pool, tables={**windows.tables, seq: tuple(entries)}, lengths={**windows.lengths, seq: new_length}
    )


def add_sequence(windows: Windows, seq: SeqId, length: int) -> Windows:
    _count(length, 1)
    if not isinstance(seq, Hashable) or seq in windows.tables:
        raise InvalidOperation(f"sequence {seq!r} already exists")
    return _grow(windows, seq, (), 0, length)


def _live(windows: Windows, seq: SeqId) -> Table:
    if not isinstance(seq, Hashable) or seq not in windows.tables:
        raise InvalidOperation(f"sequence {seq!r} does not exist (never added, or freed)")
    return windows.tables[seq]


def append(windows: Windows, seq: SeqId, n: int) -> Windows:
    table = _live(windows, seq)
    return _grow(windows, seq, table, windows.lengths[seq], _count(n, 0))


def free(windows: Windows, seq: SeqId) -> Windows:
    table = _live(windows, seq)
    pool = block_pool.release(windows.pool, [b for b in table[::-1] if b is not None])
    rest = {s: t for s, t in windows.tables.items() if s != seq}
    return attrs.evolve(windows, pool=pool, tables=rest, lengths={s: n for s, n in windows.lengths.items() if s != seq})


def block_table(windows: Windows, seq: SeqId) -> Table:
    return _live(windows, seq)


# -- slid_out="ring": what replaces _grow, and the ring's rule of invariant_window_blocks_exact ----


def ring_blocks(length: int, block_size: int, window: int) -> int:
    """The blocks a ring holds for a sequence of ``length`` tokens: those its last ``window`` tokens fill."""
    return blocks_for(min(length, window), block_size)


def _grow_ring(windows: Windows, seq: SeqId, table: Table, new_length: int) -> Windows:
    """Allocate the blocks the ring still lacks at ``new_length`` tokens; nothing is dropped (``OutOfBlocks``:
    no change)."""
    pool, blocks = block_pool.allocate(
        windows.pool, ring_blocks(new_length, windows.block_size, windows.window) - len(table)
    )
    return attrs.evolve(
        windows,
        pool=pool,
        tables={**windows.tables, seq: table + tuple(blocks)},
        lengths={**windows.lengths, seq: new_length},
    )


def ring_problem(state: WindowState) -> str | None:
    """What is wrong with the tables of ``state`` as rings (``invariant_window_blocks_exact`` under ``ring``)."""
    for seq, table in state.tables.items():
        length = state.lengths.get(seq, 0)
        needed = ring_blocks(length, state.block_size, state.window)
        if len(table) != needed or None in table:
            return (
                f"sequence {seq!r} of {length} tokens holds {table} as its ring; a window of {state.window} "
                f"in blocks of {state.block_size} needs {needed} blocks"
            )
    return None


# -- invariants --------------------------------------------------------------------


@invariant(
    "a block still in the window is read by attention; one kept outside it is memory the window promised back", "safety"
)
def invariant_window_blocks_exact(state: WindowState, conventions: WindowConventions) -> str | None:
    """Under ``ring``: a ring of fewer blocks than the window's tokens fill overwrites KV attention still reads."""
    if conventions.slid_out == "ring":
        return ring_problem(state)
    for seq, table in state.tables.items():
        length = state.lengths.get(seq, 0)
        if len(table) != blocks_for(length, state.block_size):
            return f"sequence {seq!r} of {length} tokens has {len(table)} entries (block size {state.block_size})"
        for i, block in enumerate(table):
            if (block is not None) != in_window(i, length, state.block_size, state.window):
                where = "in" if block is None else "outside"
                return f"sequence {seq!r}: logical block {i} is {where} the window of {state.window} but has {block}"
    return None


@invariant("the implementation must be in exactly the state the model predicts", "convention")
def invariant_window_refines_spec(actual: WindowState, expected: WindowState) -> str | None:
    return None if actual == expected else diff_states(actual, expected)
