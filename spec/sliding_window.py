"""Sliding-window block tables: a sequence keeps only the blocks its attention window still reads.

Rules (Mistral-style sliding-window attention; vLLM's sliding-window manager):

* A sequence of length L attends to its last ``window`` (W) tokens: positions
  ``L - W .. L - 1``, the window of its last token.  Logical block i (tokens
  ``i*B .. i*B + B - 1``) is **in the window** iff it holds a token at a
  position >= L - W, i.e. ``(i + 1) * B > L - W``.
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
  last first, as under ``dropped``.  ``_grow_ring`` replaces ``_grow``.
* ``window_of`` (under ``dropped``) -- ``last_token``, as above.  Under
  ``next_token`` (vLLM: ``get_num_skipped_tokens(c) = c - W + 1``) a block is
  kept for the window of the token computed next, at position L: positions
  ``L - W + 1 .. L``, one token narrower among the sequence's own
  (``window_start`` is the marked replacement).
* ``release`` (under ``dropped``) -- ``eager``, as above.  Under
  ``at_next_allocation`` (vLLM: ``remove_skipped_blocks`` at the top of
  ``allocate_slots``) a block that slides out stays in its table until the
  sequence's next allocation -- an append of at least one token -- which
  first releases what is outside the window of the L tokens computed so far,
  then allocates *every* new logical block (the forward computes them all;
  those already out of the window go at the next allocation).  An admission
  releases nothing and allocates the whole prompt.  The release happens
  before room is counted, so a refused append has released it too ("We can
  do this even if we cannot schedule this request"): ``after_refusal`` is the
  state a refused call leaves, and ``refusal_view`` what of a snapshot such a
  call must leave as it was (the slid-out blocks counted as free: the order
  in which they join the free queue is the pool's convention).
  ``_grow_at_next_allocation`` replaces ``_grow``.

Invariants:

* ``invariant_window_blocks_exact`` [safety] -- judged on the caller's record
  of each sequence it holds (``Written``: the tokens it wrote, and how many it
  had written at its last carried-out write): a sequence holds a block for
  every logical block in the declared window of those tokens, and none for a
  block that had slid out of the last token's window before that last write
  -- whatever the convention, a slid-out block is released by the sequence's
  next allocation at the latest (just when is the convention's, checked by
  refinement).  A ring holds exactly the blocks it needs, ``ceil(min(L, W) /
  B)``.  Whether a table is a ring is read off the table itself, so that what
  an implementation declares never makes a safety finding of a sound table.
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


@attrs.frozen
class Written:
    """The caller's record of a sequence it holds: the tokens it wrote, and how many it had written when its last
    write (an admission, or an append of at least one token) was carried out."""

    tokens: int
    before_last_write: int


@runtime_checkable
class WindowManager(Protocol):
    """``sliding_window_manager(pool, block_size, window)`` builds one."""

    def add_sequence(self, seq: SeqId, length: int) -> None: ...
    def append(self, seq: SeqId, n: int) -> None: ...
    def free(self, seq: SeqId) -> None: ...
    def block_table(self, seq: SeqId) -> Table: ...
    def snapshot(self) -> WindowState: ...


SLIDING_WINDOW_MANAGER = component_kind(
    "sliding_window_manager", WindowManager, builds="sliding_window_manager(pool, block_size, window)"
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


def window_start(length: int, window: int, window_of: str = "last_token") -> int:
    """The first position in the window of a sequence of ``length`` tokens: its last token's window is its last
    ``window`` tokens; under ``next_token`` (marked replacement) it is that of the token at position ``length``."""
    return length - window + (window_of == "next_token")


def first_in_window(length: int, block_size: int, window: int, window_of: str = "last_token") -> int:
    """The first logical block in the window of a sequence of ``length`` tokens: the one holding its start."""
    return max(0, window_start(length, window, window_of) // block_size)


def in_window(index: int, length: int, block_size: int, window: int, window_of: str = "last_token") -> bool:
    return index >= first_in_window(length, block_size, window, window_of)


def holders(tables: Mapping[SeqId, Table]) -> Counter[int]:
    return Counter(block for table in tables.values() for block in table if block is not None)


def abstract(windows: Windows) -> WindowState:
    pool = block_pool.abstract(windows.pool)
    return WindowState(windows.block_size, windows.window, pool, dict(windows.tables), dict(windows.lengths))


def _count(n: object, least: int) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < least:
        raise InvalidOperation(f"a token count must be an int >= {least}, got {n!r}")
    return n


def _slid_out(windows: Windows, table: Table, length: int) -> dict[int, int]:
    """The entries of ``table`` that name a block outside the declared window of ``length`` tokens."""
    size, window, window_of = windows.block_size, windows.window, windows.conventions.window_of
    return {i: b for i, b in enumerate(table) if b is not None and not in_window(i, length, size, window, window_of)}


def _grown(windows: Windows, seq: SeqId, pool: Pool, table: Table, length: int) -> Windows:
    return attrs.evolve(
        windows, pool=pool, tables={**windows.tables, seq: table}, lengths={**windows.lengths, seq: length}
    )


def _grow(windows: Windows, seq: SeqId, table: Table, length: int, added: int) -> Windows:
    """Drop what leaves the window of ``length + added`` tokens, then allocate the new logical blocks."""
    if windows.conventions.slid_out == "ring":
        return _grow_ring(windows, seq, table, length + added)
    if windows.conventions.release == "at_next_allocation":
        return _grow_at_next_allocation(windows, seq, table, length, added)
    size, window, window_of, pool = windows.block_size, windows.window, windows.conventions.window_of, windows.pool
    new_length = length + added
    dropped = _slid_out(windows, table, new_length)
    fresh = [
        i for i in range(len(table), blocks_for(new_length, size)) if in_window(i, new_length, size, window, window_of)
    ]
    if len(fresh) > len(pool.lru) + len(dropped):
        raise OutOfBlocks(len(fresh), len(pool.lru) + len(dropped))
    pool = block_pool.release(pool, list(dropped.values())[::-1])
    pool, blocks = block_pool.allocate(pool, len(fresh))
    entries = [None if i in dropped else b for i, b in enumerate(table)]
    entries += [None] * (blocks_for(new_length, size) - len(table) - len(fresh)) + list(blocks)
    return _grown(windows, seq, pool, tuple(entries), new_length)


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
    needed = ring_blocks(new_length, windows.block_size, windows.window) - len(table)
    pool, blocks = block_pool.allocate(windows.pool, needed)
    return _grown(windows, seq, pool, table + tuple(blocks), new_length)


# -- release="at_next_allocation": what replaces _grow, and what a refused allocation leaves ----


def _release_slid_out(windows: Windows, seq: SeqId) -> Windows:
    """Release the blocks of ``seq`` outside the window of the tokens it holds, last first; clear their entries."""
    table = windows.tables[seq]
    slid = _slid_out(windows, table, windows.lengths[seq])
    pool = block_pool.release(windows.pool, list(slid.values())[::-1])
    return _grown(
        windows, seq, pool, tuple(None if i in slid else b for i, b in enumerate(table)), windows.lengths[seq]
    )


def _grow_at_next_allocation(windows: Windows, seq: SeqId, table: Table, length: int, added: int) -> Windows:
    """Nothing to write is no allocation.  Otherwise release what slid out of the window of the ``length`` tokens
    computed so far, then allocate every new logical block of ``length + added`` (``OutOfBlocks``: no change
    here; ``after_refusal`` is what the refused call leaves)."""
    if not added:
        return windows
    if seq in windows.tables:
        windows = _release_slid_out(windows, seq)
        table = windows.tables[seq]
    fresh = blocks_for(length + added, windows.block_size) - len(table)
    pool, blocks = block_pool.allocate(windows.pool, fresh)
    return _grown(windows, seq, pool, table + tuple(blocks), length + added)


def after_refusal(windows: Windows, seq: SeqId) -> Windows:
    """The state an allocation of ``seq`` refused for want of room leaves: as it was, but under
    ``at_next_allocation`` a live sequence's slid-out blocks are released (before room was counted)."""
    dropped = windows.conventions.slid_out == "dropped"
    if dropped and windows.conventions.release == "at_next_allocation" and seq in windows.tables:
        return _release_slid_out(windows, seq)
    return windows


def refusal_view(state: WindowState, conventions: WindowConventions) -> WindowState:
    """What of the implementation's ``state`` a refused call must leave as it was: all but the blocks outside
    their sequence's next token's window -- no token to come reads them, so a refusal may release them (vLLM's
    ``at_next_allocation`` does; releasing them undeclared is a refinement finding, never a safety one) -- which
    count as free (the free queue as a set, in block order: where a released block joins it is the pool's
    convention).  A ring holds no block outside its window: all of it."""
    if conventions.slid_out != "dropped":
        return state
    size, window = state.block_size, state.window
    tables: dict[SeqId, Table] = {}
    released: Counter[int] = Counter()
    for seq, table in state.tables.items():
        length = state.lengths.get(seq, 0)
        slid = {i for i, b in enumerate(table) if not in_window(i, length, size, window, "next_token")}
        tables[seq] = tuple(None if i in slid else b for i, b in enumerate(table))
        released.update(b for i, b in enumerate(table) if i in slid and b is not None)
    refcounts = tuple(count - released[b] for b, count in enumerate(state.pool.refcounts))
    free = sorted(set(state.pool.free_queue) | {b for b in released if refcounts[b] == 0})
    pool = attrs.evolve(state.pool, refcounts=refcounts, free_queue=tuple(free))
    return attrs.evolve(state, pool=pool, tables=tables)


# -- invariants --------------------------------------------------------------------


def eagerly_written(state: WindowState) -> dict[SeqId, Written]:
    """The record of a caller that wrote each sequence's tokens as ``state`` says and expects slid-out blocks
    released at once: for a check made without a caller of its own (an adapter's test of the state alone)."""
    return {seq: Written(length, length) for seq, length in state.lengths.items()}


def ring_problem(seq: SeqId, table: Table, record: Written, block_size: int, window: int) -> str:
    """What is wrong with ``table`` as a ring ("" if nothing): it holds the blocks the window's tokens fill."""
    needed = ring_blocks(record.tokens, block_size, window)
    if len(table) == needed and None not in table:
        return ""
    return (
        f"sequence {seq!r} of {record.tokens} tokens holds {table} as its ring; a window of {window} "
        f"in blocks of {block_size} needs {needed} blocks"
    )


def table_problem(seq: SeqId, table: Table, record: Written, block_size: int, window: int, window_of: str) -> str:
    """What is wrong with ``table`` as one entry per logical block ("" if nothing): a block for each in the window
    of the tokens written, none for one that had left the last token's window before the last write."""
    if len(table) != blocks_for(record.tokens, block_size):
        return f"sequence {seq!r} of {record.tokens} tokens has {len(table)} entries (block size {block_size})"
    for i, block in enumerate(table):
        if block is None and in_window(i, record.tokens, block_size, window, window_of):
            return (
                f"sequence {seq!r}: logical block {i} is in the window of {window} of its {record.tokens} "
                f"tokens ({window_of}), but was released"
            )
        if block is not None and not in_window(i, record.before_last_write, block_size, window):
            return (
                f"sequence {seq!r}: logical block {i} had left the window of {window} at "
                f"{record.before_last_write} tokens, before its last write, but still holds block {block}"
            )
    return ""


@invariant(
    "a block still in the window is read by attention; one kept outside it is memory the window promised back", "safety"
)
def invariant_window_blocks_exact(
    state: WindowState, conventions: WindowConventions, written: Mapping[SeqId, Written] | None = None
) -> str | None:
    """``written`` is the caller's record of each sequence it holds (default: ``eagerly_written(state)``).  A table
    with one entry per logical block holds a block for every one in the declared window of the tokens written, and
    none for one that had slid out of the last token's window before the last write (released by the next
    allocation at the latest, whatever the convention); a ring holds the blocks its window's tokens fill -- fewer,
    and it overwrites KV attention still reads.  Which of the two a table is, is read off the table, not the
    declaration: a table that is neither is wrong whatever was declared (the declared one names the problem)."""
    written = eagerly_written(state) if written is None else written
    strays = sorted(map(repr, state.tables.keys() - written.keys()))
    if strays:
        return f"sequences {', '.join(strays)} hold tables, but the caller holds no such sequence"
    size, window = state.block_size, state.window
    for seq, record in written.items():
        table = state.tables.get(seq, ())
        as_ring = ring_problem(seq, table, record, size, window)
        as_table = table_problem(seq, table, record, size, window, conventions.window_of)
        if as_ring and as_table:
            return as_ring if conventions.slid_out == "ring" else as_table
    return None


@invariant("the implementation must be in exactly the state the model predicts", "convention")
def invariant_window_refines_spec(actual: WindowState, expected: WindowState) -> str | None:
    return None if actual == expected else diff_states(actual, expected)
