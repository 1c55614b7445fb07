"""Layer 2 -- the block manager: sequences, block tables, fork and copy-on-write.

Rules (vLLM §4.2-4.4 and §5, lecture §4-5):

* A sequence is a list of token ids.  Its KV lives in blocks of ``block_size``
  (B) slots; its *block table* lists the physical blocks that hold logical
  blocks 0, 1, 2, ...  Token ``i`` lives in slot ``i mod B`` of block
  ``table[i div B]``.
* ``add_sequence(seq, prompt)`` allocates on demand: ceil(len/B) blocks and
  no more (no reservation for tokens not yet generated).
* ``append(seq, tokens)`` writes each token into the next slot.  A full last
  block (or an empty table) first gets a new block.  A partially filled last
  block that other tables share (reference count > 1), or that is registered
  under a hash, is first **copied**: the writer gets a private copy of the
  filled slots and drops its reference to the original (copy-on-write).  Full
  shared blocks are never written, so they are never copied; only a
  ``rollback`` (``kvspec.spec.speculative``) leaves a registered block partial.
* ``fork(parent, child)`` gives the child the parent's table: every block is
  shared (count + 1) and none is allocated -- under the convention
  ``fork_partial_block="copy"``, all but a partially filled last block, of which
  the child gets a copy in a fresh block at once (see Conventions).
* ``free(seq)`` releases the table's blocks, last block first.
* Swap -- ``move_sequences`` of a group to another device's manager, the
  optional operation ``SWAP`` -- is ``kvspec.spec.swap``'s.
* Partial residency across block sizes -- ``truncate`` a sequence to a
  resident prefix, load the rest back from a tiered store's larger blocks --
  is ``kvspec.spec.tiered_swap``'s (the optional operation ``tiered_swap_in``).
* Ownership: the caller keeps every list it passes (prompts, tokens, groups)
  and may overwrite or reuse it for the next request at once: the manager
  copies what it keeps.  Tables, reads and plans it answers are the caller's.
* Every operation is all or nothing: ``OutOfBlocks`` or ``InvalidOperation``
  leaves the manager and its pool as they were.

Conventions (``spec.conventions.ManagerConventions``; the reference's first):

* ``fork_partial_block`` -- ``share``: as above, the first write into the
  shared partial block copies it.  Under ``copy`` (HF transformers'
  ``PagedAttentionCache.prepare_fork_request``) the fork shares the parent's
  full blocks only: the child's last entry is a fresh block holding a copy of
  the parent's partial last block (``OutOfBlocks`` without one), so neither
  copies it on write later.  Replaces ``fork`` and, as it allocates, the
  count of ``invariant_fork_allocates_nothing``.

Slots hold the token ids written to them, so reading a sequence back through
its table is a real check of where its data lives: a missing copy shows up as
another sequence's token.

Invariants (checked after every step; the pool's invariants also hold, with
the holders of a block being the table entries that name it).  The safety
rules read the manager's own snapshot and the caller's *ledger* (``Held``):
the sequences the caller holds and the tokens it wrote into each, kept from
the calls the manager carried out -- never the model.

* ``invariant_read_back_exact`` [safety] -- reading through the table yields what the caller wrote.
* ``invariant_waste_bounded`` [safety] -- at most B-1 unused slots per sequence.
* ``invariant_table_length_exact`` [safety] -- len(table) = ceil(len(tokens) / B).
* ``invariant_fork_allocates_nothing`` [convention] -- a fork shares and allocates
  nothing (under ``copy``: nothing but the child's copy of the partial last block).
* ``invariant_copy_on_write_exact`` [convention] -- a write copies iff it lands in a
  shared (or registered), partially filled block, and then exactly once.
* ``invariant_parallel_sampling_copies`` [convention] -- n sequences sharing a half-full
  last block make n-1 copies between them (at their writes, or under ``copy``
  at the forks), none if the prompt fills whole blocks (lecture exercise 4).
* ``invariant_manager_refines_spec`` [convention] -- the implementation is in the model's state.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol, Self, runtime_checkable

import attrs

from kvspec.spec import block_pool
from kvspec.spec.block_pool import Pool, PoolState
from kvspec.spec.components import component_kind, optional_operation
from kvspec.spec.conventions import REFERENCE, ManagerConventions
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import Group, invariant, refinement

SeqId = Hashable
Held = Mapping[SeqId, tuple[int, ...] | None]
"""The caller's ledger of one manager: each sequence it holds there, with the tokens it wrote into it -- None where it
cannot vouch for them (an out-of-contract call on it was carried out)."""


@attrs.frozen
class ManagerState:
    """The abstract state of a block manager: what ``snapshot()`` returns."""

    block_size: int
    pool: PoolState
    tables: Mapping[SeqId, tuple[int, ...]]
    tokens: Mapping[SeqId, tuple[int, ...]]
    contents: Mapping[int, tuple[int, ...]]  # every block in use or cached -> tokens in its slots


@attrs.frozen
class WritePlan:
    """What a write did, for a KV store that must mirror it.

    ``copies`` are (source, destination) blocks copied before the writes
    (copy-on-write); ``slots`` are the (block, offset) of each token written, in
    order; ``cached_tokens`` leading prompt tokens were reused, not written.
    """

    copies: tuple[tuple[int, int], ...] = ()
    slots: tuple[tuple[int, int], ...] = ()
    cached_tokens: int = 0


@runtime_checkable
class BlockManager(Protocol):
    """What a block manager offers; ``pool`` is the block pool it allocates from."""

    @property
    def block_size(self) -> int: ...
    @property
    def pool(self) -> block_pool.BlockPool: ...
    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> WritePlan: ...
    def append(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan: ...
    def fork(self, parent: SeqId, child: SeqId) -> None: ...
    def free(self, seq: SeqId) -> None: ...
    def read(self, seq: SeqId) -> tuple[int, ...]: ...
    def block_table(self, seq: SeqId) -> tuple[int, ...]: ...
    def sequences(self) -> tuple[SeqId, ...]: ...
    # Swap moves between two managers of one implementation (a GPU's and a CPU's), hence ``Self``:
    def move_sequences(self, dst: Self, seqs: Sequence[SeqId]) -> tuple[tuple[int, int], ...]: ...
    def snapshot(self) -> ManagerState: ...


# -- the model -------------------------------------------------------------------


BLOCK_MANAGER = component_kind("block_manager", BlockManager, builds="block_manager(pool, block_size)")
MANAGERS = ("block_manager", "prefix_caching_manager")  # the kinds that manage blocks (a later chapter declares one)
# share every block of a sequence with a new one (parallel sampling, beam search):
FORK = optional_operation("fork", BlockManager, "fork", kinds=MANAGERS)


@attrs.frozen
class Manager:
    """The spec's model of a block manager."""

    block_size: int
    pool: Pool
    tables: Mapping[SeqId, tuple[int, ...]]
    tokens: Mapping[SeqId, tuple[int, ...]]
    contents: Mapping[int, tuple[int, ...]]
    conventions: ManagerConventions = REFERENCE.manager


def blocks_for(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): the blocks a sequence of that length occupies."""
    return -(-num_tokens // block_size)


def check_block_size(block_size: object) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise InvalidOperation(f"block size must be a positive int, got {block_size!r}")
    return block_size


def check_tokens(tokens: object, *, allow_empty: bool) -> tuple[int, ...]:
    """Token ids are non-negative integers; a prompt has at least one."""
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise InvalidOperation(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    plain = isinstance(tokens, list | tuple) and set(map(type, tokens)) <= {int}  # the common case, scanned in C
    if not plain or (tokens and min(tokens) < 0):
        for token in tokens:
            if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
                raise InvalidOperation(f"token {token!r} is not a non-negative integer id")
    if not tokens and not allow_empty:
        raise InvalidOperation("a prompt needs at least one token")
    return tuple(tokens) if plain else tuple(int(t) for t in tokens)


def new_manager(pool: Pool, block_size: int, conventions: ManagerConventions = REFERENCE.manager) -> Manager:
    return Manager(
        block_size=check_block_size(block_size), pool=pool, tables={}, tokens={}, contents={}, conventions=conventions
    )


def abstract(manager: Manager) -> ManagerState:
    pool = block_pool.abstract(manager.pool)
    live = {b: c for b, c in manager.contents.items() if pool.refcounts[b] > 0 or pool.block_hashes[b] is not None}
    return ManagerState(
        block_size=manager.block_size,
        pool=pool,
        tables=dict(manager.tables),
        tokens=dict(manager.tokens),
        contents=live,
    )


def holders(tables: Mapping[SeqId, Sequence[int]]) -> Counter[int]:
    """How many table entries name each block: what its reference count must be."""
    return Counter(block for table in tables.values() for block in table)


def require_live(manager: Manager, seq: SeqId) -> None:
    if seq not in manager.tables:
        raise InvalidOperation(f"sequence {seq!r} does not exist (never added, or freed)")


def require_new(manager: Manager, seq: SeqId) -> None:
    if not isinstance(seq, Hashable) or seq in manager.tables:
        raise InvalidOperation(f"sequence {seq!r} already exists")


def add_sequence(manager: Manager, seq: SeqId, prompt: Sequence[int]) -> tuple[Manager, WritePlan]:
    """Admit a sequence: ceil(len/B) new blocks holding the prompt."""
    prompt = check_tokens(prompt, allow_empty=False)
    require_new(manager, seq)
    return write(start_sequence(manager, seq, ()), seq, prompt)


def start_sequence(manager: Manager, seq: SeqId, shared_blocks: Sequence[int]) -> Manager:
    """A new sequence whose table starts with ``shared_blocks`` (already shared; full)."""
    tokens = tuple(t for b in shared_blocks for t in manager.contents[b])
    return attrs.evolve(
        manager,
        tables={**manager.tables, seq: tuple(shared_blocks)},
        tokens={**manager.tokens, seq: tokens},
    )


def append(manager: Manager, seq: SeqId, tokens: Sequence[int]) -> tuple[Manager, WritePlan]:
    """Write ``tokens`` after the sequence's last token, copying a shared last block first."""
    tokens = check_tokens(tokens, allow_empty=True)
    require_live(manager, seq)
    return write(manager, seq, tokens)


def write(manager: Manager, seq: SeqId, tokens: tuple[int, ...]) -> tuple[Manager, WritePlan]:
    """The one write path: on-demand allocation and copy-on-write, token by token."""
    block_size, pool = manager.block_size, manager.pool
    table, written = list(manager.tables[seq]), manager.tokens[seq]
    contents = dict(manager.contents)
    copies, slots = [], []
    for token in tokens:
        offset = len(written) % block_size
        if offset == 0:
            pool, (block,) = block_pool.allocate(pool, 1)
            contents[block] = ()
            table.append(block)
        elif pool.refcounts[table[-1]] > 1 or pool.block_hashes[table[-1]] is not None:
            pool, (copy,) = block_pool.allocate(pool, 1)
            contents[copy] = contents[table[-1]][:offset]
            pool = block_pool.release(pool, [table[-1]])
            copies.append((table[-1], copy))
            table[-1] = copy
        block = table[-1]
        contents[block] = contents[block][:offset] + (token,)
        slots.append((block, offset))
        written += (token,)
    manager = attrs.evolve(
        manager,
        pool=pool,
        tables={**manager.tables, seq: tuple(table)},
        tokens={**manager.tokens, seq: written},
        contents=contents,
    )
    return manager, WritePlan(copies=tuple(copies), slots=tuple(slots))


def fork(manager: Manager, parent: SeqId, child: SeqId) -> Manager:
    """The child shares every block of the parent; nothing is allocated.  Under ``fork_partial_block="copy"`` a
    partially filled last block is not shared: the child gets a fresh block holding a copy of its slots."""
    require_live(manager, parent)
    require_new(manager, child)
    table, contents = manager.tables[parent], dict(manager.contents)
    filled = len(manager.tokens[parent]) % manager.block_size
    copies = filled > 0 and manager.conventions.fork_partial_block == "copy"
    shared = table[:-1] if copies else table
    pool, child_table = block_pool.share(manager.pool, shared), shared
    if copies:
        pool, (copy,) = block_pool.allocate(pool, 1)
        contents[copy] = contents[table[-1]][:filled]
        child_table = shared + (copy,)
    return attrs.evolve(
        manager,
        pool=pool,
        tables={**manager.tables, child: child_table},
        tokens={**manager.tokens, child: manager.tokens[parent]},
        contents=contents,
    )


def free(manager: Manager, seq: SeqId) -> Manager:
    """Release the sequence's blocks, last block first, and forget it."""
    require_live(manager, seq)
    pool = block_pool.release(manager.pool, manager.tables[seq][::-1])
    return attrs.evolve(
        manager,
        pool=pool,
        tables={s: t for s, t in manager.tables.items() if s != seq},
        tokens={s: t for s, t in manager.tokens.items() if s != seq},
    )


def read(manager: Manager, seq: SeqId) -> tuple[int, ...]:
    require_live(manager, seq)
    table, size = manager.tables[seq], manager.block_size
    return tuple(manager.contents[table[i // size]][i % size] for i in range(len(manager.tokens[seq])))


def read_through_table(
    contents: Mapping[int, Sequence[int]], table: Sequence[int], length: int, block_size: int
) -> tuple[int | None, ...]:
    """Token i from slot i mod B of block table[i div B]; None where no token was written."""
    out: list[int | None] = []
    for i in range(length):
        index = i // block_size
        block_contents = contents.get(table[index], ()) if index < len(table) else ()
        offset = i % block_size
        out.append(block_contents[offset] if offset < len(block_contents) else None)
    return tuple(out)


# -- invariants over snapshots ---------------------------------------------------


def to_read_back(state: ManagerState, held: Held | None) -> Mapping[SeqId, tuple[int, ...]]:
    """The tokens each sequence must read back: what the caller wrote, for the sequences whose tokens its ledger
    ``held`` vouches for; the manager's own record of the others (of every one, without a ledger)."""
    if held is None:
        return state.tokens
    return {**state.tokens, **{seq: tokens for seq, tokens in held.items() if tokens is not None}}


@invariant(
    "a sequence must read back exactly what was written into it; anything else is another sequence's data "
    "(CoW isolation)",
    "safety",
)
def invariant_read_back_exact(state: ManagerState, held: Held | None = None) -> str | None:
    """Reads the manager's tables, contents and own record of each sequence's tokens against the caller's ledger
    ``held`` (None: the manager's own record alone, for a machine that keeps no ledger)."""
    for seq, tokens in to_read_back(state, held).items():
        if seq not in state.tokens:
            return f"sequence {seq!r} is gone from the manager, though the caller wrote {tokens} and never freed it"
        if state.tokens[seq] != tokens:
            return f"sequence {seq!r} holds {state.tokens[seq]} by the manager's own record; the caller wrote {tokens}"
        got = read_through_table(state.contents, state.tables.get(seq, ()), len(tokens), state.block_size)
        if got != tokens:
            return f"sequence {seq!r} reads back {got}, its tokens are {tokens}"
    return None


@invariant(
    "paging promises waste only in the last block: at most B-1 unused slots per sequence",
    "safety",
)
def invariant_waste_bounded(state: ManagerState, held: Held | None = None) -> str | None:
    """Each table against the tokens its sequence must read back (``to_read_back``)."""
    for seq, tokens in to_read_back(state, held).items():
        waste = len(state.tables.get(seq, ())) * state.block_size - len(tokens)
        if waste > state.block_size - 1:
            return f"sequence {seq!r} wastes {waste} slots with block size {state.block_size}"
    return None


@invariant(
    "on-demand allocation: a sequence holds exactly the blocks its tokens need, no reservation",
    "safety",
)
def invariant_table_length_exact(state: ManagerState, held: Held | None = None) -> str | None:
    """Each table against the tokens its sequence must read back (``to_read_back``)."""
    for seq, tokens in to_read_back(state, held).items():
        table = state.tables.get(seq, ())
        if len(table) != blocks_for(len(tokens), state.block_size):
            return f"sequence {seq!r} has {len(tokens)} tokens in {len(table)} blocks of {state.block_size}"
    if set(state.tables) != set(state.tokens):
        return f"tables for {sorted(map(repr, state.tables))}, tokens for {sorted(map(repr, state.tokens))}"
    return None


@invariant(
    "forking is what makes parallel sampling and beam search cheap: it shares the parent's blocks and allocates "
    "nothing, but the copy of a partial last block that the declared convention makes at once",
    "convention",
    needs=(FORK,),
)
def invariant_fork_allocates_nothing(
    before: ManagerState, after: ManagerState, parent: SeqId, child: SeqId, conventions: ManagerConventions
) -> str | None:
    """Under ``fork_partial_block="copy"`` the child's last entry is a fresh block, if the parent's is partial."""
    table = before.tables[parent]
    partial = len(before.tokens[parent]) % before.block_size != 0
    copied = 1 if partial and conventions.fork_partial_block == "copy" else 0
    allocated = before.pool.num_free - after.pool.num_free
    if allocated != copied:
        return f"fork allocated {allocated} blocks, the declared fork copies {copied}"
    child_table = after.tables.get(child, ())
    if child_table[: len(table) - copied] != table[: len(table) - copied] or len(child_table) != len(table):
        return f"child table {child_table} does not share the parent's {table}"
    if copied and child_table[-1] in table:
        return f"child table {child_table} shares the parent's partial last block {table[-1]}"
    return None


@invariant(
    "a copy is needed only to write into a shared partial block; more wastes memory, fewer corrupts a sibling",
    "convention",
)
def invariant_copy_on_write_exact(expected: Sequence[tuple[int, int]], actual: Sequence[tuple[int, int]]) -> str | None:
    if len(expected) != len(actual):
        return f"the write needed {len(expected)} copy-on-write copies, the implementation made {len(actual)}"
    return None


@invariant(
    "lecture exercise 4: n samples sharing a half-full block copy it n-1 times, never when blocks are full",
    "convention",
    fails_only_with="the samples' copies are their forks' allocations and their writes' copies: a count off the "
    "lecture's is a fork that allocates otherwise than its convention (invariant_fork_allocates_nothing) or a "
    "write that copies otherwise (invariant_copy_on_write_exact)",
    needs=(FORK,),
)
def invariant_parallel_sampling_copies(n: int, prompt_len: int, block_size: int, copies: int) -> str | None:
    """``copies``: the blocks the forks allocated and the copies the samples' writes made, together."""
    expected = n - 1 if prompt_len % block_size else 0
    if copies != expected:
        return f"{n} samples of a {prompt_len}-token prompt (B={block_size}) made {copies} copies, expected {expected}"
    return None


invariant_manager_refines_spec = refinement("invariant_manager_refines_spec")


def held_tables(state: ManagerState, held: Held | None = None) -> Mapping[SeqId, tuple[int, ...]]:
    """The tables of the sequences the caller holds (``held``; without a ledger, every table): their entries are
    the holders of the blocks, so a table of a sequence the caller freed holds blocks no one will release."""
    return state.tables if held is None else {seq: state.tables.get(seq, ()) for seq in held}


STATE = Group((invariant_read_back_exact, invariant_waste_bounded, invariant_table_length_exact)).including(
    block_pool.STATE, lambda state, held=None: (state.pool, holders(held_tables(state, held)))
)
"""Every safety rule over a manager's snapshot, its pool's included (the table entries hold the blocks), called as
``(state, held)``: ``held`` the caller's ledger, if it keeps one."""
