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
  block that other tables share (reference count > 1) is first **copied**:
  the writer gets a private copy of the filled slots and drops its reference
  to the original (copy-on-write).  Full shared blocks are never written, so
  they are never copied.
* ``fork(parent, child)`` gives the child the parent's table: every block is
  shared (count + 1) and none is allocated.
* ``free(seq)`` releases the table's blocks, last block first.
* ``move_sequences(src, dst, seqs)`` moves a group of sequences to another
  device's manager of the same implementation (swap): all of their distinct blocks are copied into freshly
  allocated blocks of ``dst`` -- all or nothing -- the sharing inside the
  group is kept, and the blocks are released in ``src``.  Moved blocks arrive
  uncached: ``dst``'s prefix cache does not learn them, so a later prompt
  recomputes rather than hits them (swap is for resuming, not for sharing).
* **Partial residency across block sizes** (vLLM's offloading connector,
  LMCache, Mooncake: a tier whose blocks hold ``k * B`` tokens).  Tier block
  ``j`` of a sequence holds its tokens ``j*k*B .. (j+1)*k*B - 1`` -- device
  blocks ``j*k .. j*k + k - 1`` -- in layer 7's tiered store
  (``kvspec.spec.kv_store``), under the chained key ``tier_blocks`` gives it.
  A swap-out is the caller's: it ``put``s the tier blocks from the one that
  holds device block ``keep`` onwards, then ``truncate(seq, keep)`` keeps the
  first ``keep`` blocks resident (they are full) and releases the rest, last
  first.  ``swap_in(store, node, tier_block_size, seq, keys)`` loads the
  suffix back: with ``r`` blocks resident, ``keys[0]`` names tier block
  ``r // k``, whose first ``(r mod k) * B`` tokens are the resident ones and
  are skipped; the rest of it and every later tier block land in fresh
  blocks after the resident prefix, one device block per ``B`` tokens of a
  tier block -- all or nothing (``OutOfBlocks``).  It answers the transfer
  plan: (device block, tier key, token offset in the tier block) per loaded
  block.  A load is a transfer, not a use: the store does not change.  Keys
  the node no longer holds (the store evicted them: the caller recomputes),
  a tier block size that is not a multiple of B, a partial resident block, a
  tier block shorter than ``k * B`` before the last, or one whose resident
  part is not the sequence's are ``InvalidOperation``.  Loaded blocks arrive
  uncached, as moved ones do.  The machine that drives it is
  ``kvspec.properties.test_tiered_swap``: one device manager and one store
  node, swap-outs at any block, store pressure, swap-ins, and recomputation
  of a sequence whose tier blocks were evicted.
* Ownership: the caller keeps every list it passes (prompts, tokens, groups)
  and may overwrite or reuse it for the next request at once: the manager
  copies what it keeps.  Tables, reads and plans it answers are the caller's.
* Every operation is all or nothing: ``OutOfBlocks`` or ``InvalidOperation``
  leaves the manager and its pool as they were.

Slots hold the token ids written to them, so reading a sequence back through
its table is a real check of where its data lives: a missing copy shows up as
another sequence's token.

Invariants (checked after every step; the pool's invariants also hold, with
the holders of a block being the table entries that name it):

* ``invariant_read_back_exact`` [safety] -- reading through the table yields the tokens.
* ``invariant_waste_bounded`` [safety] -- at most B-1 unused slots per sequence.
* ``invariant_table_length_exact`` [safety] -- len(table) = ceil(len(tokens) / B).
* ``invariant_fork_allocates_nothing`` [safety] -- a fork shares and never allocates.
* ``invariant_copy_on_write_exact`` [convention] -- a write copies iff it lands in a
  shared, partially filled block, and then exactly once.
* ``invariant_parallel_sampling_copies`` [convention] -- n sequences sharing a half-full
  last block make n-1 copies between them, none if the prompt fills whole
  blocks (lecture exercise 4).
* ``invariant_load_lands_after_resident_prefix`` [safety] -- a partial swap-in
  leaves the resident blocks and their contents as they were.
* ``invariant_tier_blocks_cover_loaded_blocks`` [safety] -- each loaded block comes
  from the tier block that holds it, at its offset, exactly once.
* ``invariant_swap_round_trip_exact`` [safety] -- swapped out in part and loaded back,
  a sequence reads what it held.
* ``invariant_manager_refines_spec`` [convention] -- the implementation is in the model's state.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol, Self, runtime_checkable

import attrs

from kvspec.spec import block_pool, kv_store
from kvspec.spec.block_pool import Pool, PoolState
from kvspec.spec.components import component_kind
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import Group, diff_states, invariant

SeqId = Hashable
TierLoad = tuple[tuple[int, kv_store.Key, int], ...]  # (device block, tier key, token offset in it) per loaded block


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
    # Partial residency: keep a prefix, load the suffix back from a tiered store's larger blocks:
    def truncate(self, seq: SeqId, blocks: int) -> None: ...
    def swap_in(
        self, store: kv_store.KVStore, node: int, tier_block_size: int, seq: SeqId, keys: Sequence[kv_store.Key]
    ) -> TierLoad: ...
    def snapshot(self) -> ManagerState: ...


# -- the model -------------------------------------------------------------------


MANAGER_METHODS = (
    "block_size",
    "pool",
    "add_sequence",
    "append",
    "free",
    "read",
    "block_table",
    "sequences",
    "snapshot",
)
MANAGER_OPERATIONS = {
    "fork": ("fork",),  # share every block of a sequence with a new one (parallel sampling, beam search)
    "swap": ("move_sequences",),  # move sequence groups between two managers' pools (swap out / in)
    "tiered_swap_in": ("truncate", "swap_in"),  # load a sequence's tail back from a tier of larger blocks
}
BLOCK_MANAGER = component_kind(
    "block_manager", builds="block_manager(pool, block_size)", methods=MANAGER_METHODS, optional=MANAGER_OPERATIONS
)


@attrs.frozen
class Manager:
    """The spec's model of a block manager."""

    block_size: int
    pool: Pool
    tables: Mapping[SeqId, tuple[int, ...]]
    tokens: Mapping[SeqId, tuple[int, ...]]
    contents: Mapping[int, tuple[int, ...]]


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
    for token in tokens:
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
            raise InvalidOperation(f"token {token!r} is not a non-negative integer id")
    if not tokens and not allow_empty:
        raise InvalidOperation("a prompt needs at least one token")
    return tuple(int(t) for t in tokens)


def new_manager(block_size: int, pool: Pool) -> Manager:
    return Manager(block_size=check_block_size(block_size), pool=pool, tables={}, tokens={}, contents={})


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
        elif pool.refcounts[table[-1]] > 1:
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
    """The child shares every block of the parent; nothing is allocated."""
    require_live(manager, parent)
    require_new(manager, child)
    pool = block_pool.share(manager.pool, manager.tables[parent])
    return attrs.evolve(
        manager,
        pool=pool,
        tables={**manager.tables, child: manager.tables[parent]},
        tokens={**manager.tokens, child: manager.tokens[parent]},
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


def move_sequences(
    src: Manager, dst: Manager, seqs: Sequence[SeqId]
) -> tuple[Manager, Manager, tuple[tuple[int, int], ...]]:
    """Move a group of sequences from ``src`` to ``dst``, all or nothing, keeping their sharing.

    Returns the (source block, destination block) copies, in order of first use.
    """
    if len(set(seqs)) != len(seqs) or not seqs:
        raise InvalidOperation(f"a group to move needs distinct sequences, got {list(seqs)!r}")
    for seq in seqs:
        require_live(src, seq)
        require_new(dst, seq)
    if src.block_size != dst.block_size:
        raise InvalidOperation(f"block sizes differ: {src.block_size} and {dst.block_size}")
    distinct = list(dict.fromkeys(b for seq in seqs for b in src.tables[seq]))
    dst_pool, fresh = block_pool.allocate(dst.pool, len(distinct))
    mapping = dict(zip(distinct, fresh, strict=True))
    group_holders = holders({seq: src.tables[seq] for seq in seqs})
    dst_pool = block_pool.share(dst_pool, [mapping[b] for b, n in group_holders.items() for _ in range(n - 1)])
    contents = dict(dst.contents)
    for old, new in mapping.items():
        contents[new] = src.contents[old]
    moved_tables = {seq: tuple(mapping[b] for b in src.tables[seq]) for seq in seqs}
    dst = attrs.evolve(
        dst,
        pool=dst_pool,
        tables={**dst.tables, **moved_tables},
        tokens={**dst.tokens, **{seq: src.tokens[seq] for seq in seqs}},
        contents=contents,
    )
    for seq in seqs:
        src = free(src, seq)
    return src, dst, tuple(mapping.items())


def tier_blocks(
    tokens: Sequence[int], tier_block_size: int, first: int = 0
) -> tuple[tuple[kv_store.Key, kv_store.Tokens], ...]:
    """Tier blocks ``first`` onwards of a sequence's tokens, each under its chained key: the prefix to its end."""
    starts = range(first * tier_block_size, len(tokens), tier_block_size)
    return tuple(
        (("tier", tuple(tokens[: s + tier_block_size])), tuple(tokens[s : s + tier_block_size])) for s in starts
    )


def truncate(manager: Manager, seq: SeqId, blocks: int) -> Manager:
    """Keep the first ``blocks`` blocks of the sequence resident, with their tokens; release the rest, last first."""
    require_live(manager, seq)
    table = manager.tables[seq]
    if not isinstance(blocks, int) or isinstance(blocks, bool) or not 0 <= blocks <= len(table):
        raise InvalidOperation(f"sequence {seq!r} has {len(table)} blocks: it cannot keep {blocks!r}")
    return attrs.evolve(
        manager,
        pool=block_pool.release(manager.pool, table[blocks:][::-1]),
        tables={**manager.tables, seq: table[:blocks]},
        tokens={**manager.tokens, seq: manager.tokens[seq][: blocks * manager.block_size]},
    )


def tier_factor(tier_block_size: object, block_size: int) -> int:
    """How many device blocks one tier block holds; the tier's block size must be a multiple of B."""
    if not isinstance(tier_block_size, int) or isinstance(tier_block_size, bool) or tier_block_size < 1:
        raise InvalidOperation(f"a tier block size is a positive int, got {tier_block_size!r}")
    if tier_block_size % block_size:
        raise InvalidOperation(f"tier blocks of {tier_block_size} tokens do not hold whole blocks of {block_size}")
    return tier_block_size // block_size


def tier_contents(store: kv_store.StoreState, node: object, keys: Sequence[kv_store.Key]) -> list[kv_store.Tokens]:
    """What each tier block holds on ``node``; a node that is down or a block it lost is refused."""
    if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(store.alive) or not store.alive[node]:
        raise InvalidOperation(f"node {node!r} is not a live node of the store")
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence) or not keys:
        raise InvalidOperation(f"a load names one or more tier blocks, got {keys!r}")
    lost = [key for key in keys if (node, key) not in store.contents]
    if lost:
        raise InvalidOperation(f"node {node} no longer holds tier block(s) {lost!r}: recompute the sequence")
    return [store.contents[(node, key)] for key in keys]


def require_continuation(
    seq: SeqId, tokens: Sequence[int], block_size: int, tier_block_size: int, contents: Sequence[kv_store.Tokens]
) -> int:
    """The tier blocks must continue the resident blocks, all full; answers the first one's resident tokens."""
    if len(tokens) % block_size:
        raise InvalidOperation(f"sequence {seq!r} ends in a partial block: it has no suffix to load")
    skip = len(tokens) % tier_block_size
    if (
        len(contents[0]) <= skip
        or tuple(contents[0][:skip]) != tuple(tokens[len(tokens) - skip :])
        or any(len(tier) != tier_block_size for tier in contents[:-1])
    ):
        raise InvalidOperation(f"the tier blocks do not continue the resident blocks of {seq!r}")
    return skip


def swap_in(
    manager: Manager, store: kv_store.Store, node: int, tier_block_size: int, seq: SeqId, keys: Sequence[kv_store.Key]
) -> tuple[Manager, kv_store.Store, TierLoad]:
    """Load the suffix of ``seq`` from the tier blocks ``keys`` into fresh blocks after its resident prefix."""
    require_live(manager, seq)
    size, tokens = manager.block_size, manager.tokens[seq]
    tier_factor(tier_block_size, size)
    contents = tier_contents(kv_store.abstract(store), node, keys)
    skip = require_continuation(seq, tokens, size, tier_block_size, contents)
    slices = [
        (key, offset, tier[offset : offset + size])
        for index, (key, tier) in enumerate(zip(keys, contents, strict=True))
        for offset in range(skip if index == 0 else 0, len(tier), size)
    ]
    pool, fresh = block_pool.allocate(manager.pool, len(slices))
    loaded = dict(zip(fresh, (part for _, _, part in slices), strict=True))
    manager = attrs.evolve(
        manager,
        pool=pool,
        tables={**manager.tables, seq: manager.tables[seq] + tuple(fresh)},
        tokens={**manager.tokens, seq: tokens + tuple(t for part in loaded.values() for t in part)},
        contents={**manager.contents, **loaded},
    )
    return manager, store, tuple((block, key, offset) for block, (key, offset, _) in zip(fresh, slices, strict=True))


# -- invariants over snapshots ---------------------------------------------------


@invariant(
    "a sequence must read back exactly its own tokens; anything else is another sequence's data (CoW isolation)",
    "safety",
)
def invariant_read_back_exact(state: ManagerState) -> str | None:
    for seq, tokens in state.tokens.items():
        got = read_through_table(state.contents, state.tables.get(seq, ()), len(tokens), state.block_size)
        if got != tokens:
            return f"sequence {seq!r} reads back {got}, its tokens are {tokens}"
    return None


@invariant(
    "paging promises waste only in the last block: at most B-1 unused slots per sequence",
    "safety",
)
def invariant_waste_bounded(state: ManagerState) -> str | None:
    for seq, tokens in state.tokens.items():
        waste = len(state.tables.get(seq, ())) * state.block_size - len(tokens)
        if waste > state.block_size - 1:
            return f"sequence {seq!r} wastes {waste} slots with block size {state.block_size}"
    return None


@invariant(
    "on-demand allocation: a sequence holds exactly the blocks its tokens need, no reservation",
    "safety",
)
def invariant_table_length_exact(state: ManagerState) -> str | None:
    for seq, tokens in state.tokens.items():
        table = state.tables.get(seq, ())
        if len(table) != blocks_for(len(tokens), state.block_size):
            return f"sequence {seq!r} has {len(tokens)} tokens in {len(table)} blocks of {state.block_size}"
    if set(state.tables) != set(state.tokens):
        return f"tables for {sorted(map(repr, state.tables))}, tokens for {sorted(map(repr, state.tokens))}"
    return None


@invariant(
    "forking is what makes parallel sampling and beam search cheap: it must share, not allocate",
    "safety",
    needs=("block_manager.fork", "prefix_caching_manager.fork", "paged_kv_cache.fork"),
)
def invariant_fork_allocates_nothing(
    before: ManagerState, after: ManagerState, parent: SeqId, child: SeqId
) -> str | None:
    if after.pool.num_free != before.pool.num_free:
        return f"fork changed the free blocks from {before.pool.num_free} to {after.pool.num_free}"
    if after.tables.get(child) != before.tables[parent]:
        return f"child table {after.tables.get(child)} is not the parent's {before.tables[parent]}"
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
    needs=("block_manager.fork",),
)
def invariant_parallel_sampling_copies(n: int, prompt_len: int, block_size: int, copies: int) -> str | None:
    expected = n - 1 if prompt_len % block_size else 0
    if copies != expected:
        return f"{n} samples of a {prompt_len}-token prompt (B={block_size}) made {copies} copies, expected {expected}"
    return None


@invariant(
    "a partial swap-in writes only after the resident prefix: a load over it overwrites KV the device still serves",
    "safety",
    needs=("block_manager.tiered_swap_in",),
)
def invariant_load_lands_after_resident_prefix(before: ManagerState, after: ManagerState, seq: SeqId) -> str | None:
    resident = before.tables[seq]
    now = after.tables.get(seq, ())[: len(resident)]
    if now != resident:
        return f"sequence {seq!r}'s resident blocks {resident} became {now}"
    overwritten = [block for block in resident if after.contents.get(block) != before.contents[block]]
    if overwritten:
        return f"the load wrote into resident block(s) {overwritten} of sequence {seq!r}"
    return None


@invariant(
    "a device block is one B-token slice of the one tier block that holds it: any other slice is other tokens' KV",
    "safety",
    needs=("block_manager.tiered_swap_in",),
)
def invariant_tier_blocks_cover_loaded_blocks(
    plan: TierLoad, resident: int, table: Sequence[int], keys: Sequence[kv_store.Key], factor: int, block_size: int
) -> str | None:
    filled = [block for block, _, _ in plan]
    if filled != list(table[resident:]):
        return f"the load filled blocks {filled}; after the {resident} resident ones the table has {list(table[resident:])}"
    for index, (block, key, offset) in enumerate(plan, start=resident):
        tier = index // factor - resident // factor
        expected = (keys[tier] if tier < len(keys) else None, index % factor * block_size)
        if (key, offset) != expected:
            return f"device block {index} ({block}) came from {key!r} at token {offset}; it is {expected[0]!r} at {expected[1]}"
    if {key for _, key, _ in plan} != set(keys):
        return f"the load read tier blocks {sorted(repr(key) for key in {k for _, k, _ in plan})} of {list(keys)!r}"
    return None


@invariant(
    "a sequence swapped out in part and loaded back must read what it held, or it decodes from other tokens' KV",
    "safety",
    needs=("block_manager.tiered_swap_in",),
)
def invariant_swap_round_trip_exact(seq: SeqId, held: Sequence[int], read: Sequence[int]) -> str | None:
    if tuple(held) != tuple(read):
        return f"sequence {seq!r} held {tuple(held)} and reads back {tuple(read)} after its swap-in"
    return None


@invariant(
    "the implementation must be in exactly the state the model of its declared conventions predicts",
    "convention",
)
def invariant_manager_refines_spec(actual: ManagerState, expected: ManagerState) -> str | None:
    if actual != expected:
        return diff_states(actual, expected)
    return None


STATE = Group((invariant_read_back_exact, invariant_waste_bounded, invariant_table_length_exact)).including(
    block_pool.STATE, lambda state: (state.pool, holders(state.tables))
)
"""Every safety rule over a manager's snapshot, its pool's included (the table entries hold the blocks)."""
