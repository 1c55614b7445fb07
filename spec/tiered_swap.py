"""Layers 2 and 7 together -- partial swap-in from a tier of larger blocks.

Rules (vLLM's offloading connector, LMCache, Mooncake: a tier whose blocks
hold ``k * B`` tokens, over a block manager of ``B``-token blocks):

* Tier block ``j`` of a sequence holds its tokens ``j*k*B .. (j+1)*k*B - 1``
  -- device blocks ``j*k .. j*k + k - 1`` -- in layer 7's tiered store
  (``kvspec.spec.kv_store``), under the chained key ``tier_blocks`` gives it.
* A swap-out is the caller's: it ``put``s the tier blocks from the one that
  holds device block ``keep`` onwards, then the block manager's
  ``truncate(seq, keep)`` keeps the first ``keep`` blocks resident (they are
  full) and releases the rest, last first.
* ``swap_in(store, node, tier_block_size, seq, keys)`` -- a block manager's
  optional operation (``tiered_swap_in``, with ``truncate``) -- loads the
  suffix back: with ``r`` blocks resident, ``keys[0]`` names tier block
  ``r // k``, whose first ``(r mod k) * B`` tokens are the resident ones and
  are skipped; the rest of it and every later tier block land in fresh
  blocks after the resident prefix, one device block per ``B`` tokens of a
  tier block -- all or nothing (``OutOfBlocks``).  It answers the transfer
  plan: (device block, tier key, token offset in the tier block) per loaded
  block.  A load is a transfer, not a use: the store does not change.
* Keys the node no longer holds (the store evicted them: the caller
  recomputes), a tier block size that is not a multiple of B, a partial
  resident block, a tier block shorter than ``k * B`` before the last, or one
  whose resident part is not the sequence's are ``InvalidOperation``.
  Loaded blocks arrive uncached, as moved ones do.

This module sits above both layers it joins: the block manager
(``kvspec.spec.block_manager``) and the store know nothing of it.  The
machine that drives it is ``kvspec.properties.test_tiered_swap``: one device
manager and one store node, swap-outs at any block, store pressure,
swap-ins, and recomputation of a sequence whose tier blocks were evicted.

Invariants (tier in brackets; the manager's and the store's hold too):

* ``invariant_load_lands_after_resident_prefix`` [safety] -- a partial swap-in
  leaves the resident blocks and their contents as they were.
* ``invariant_tier_blocks_cover_loaded_blocks`` [safety] -- each loaded block comes
  from the tier block that holds it, at its offset, exactly once.
* ``invariant_swap_round_trip_exact`` [safety] -- swapped out in part and loaded back,
  a sequence reads what it held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec import block_pool, kv_store
from kvspec.spec.block_manager import MANAGERS, BlockManager, Manager, ManagerState, SeqId, require_live
from kvspec.spec.components import optional_operation
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import invariant

TierLoad = tuple[tuple[int, kv_store.Key, int], ...]  # (device block, tier key, token offset in it) per loaded block


@runtime_checkable
class TieredBlockManager(BlockManager, Protocol):
    """A block manager that offers ``tiered_swap_in``: it keeps a resident prefix, and loads the rest back."""

    def truncate(self, seq: SeqId, blocks: int) -> None: ...
    def swap_in(
        self, store: kv_store.KVStore, node: int, tier_block_size: int, seq: SeqId, keys: Sequence[kv_store.Key]
    ) -> TierLoad: ...


TIERED_SWAP_IN = optional_operation("tiered_swap_in", TieredBlockManager, "truncate", "swap_in", kinds=MANAGERS)


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


# -- invariants ------------------------------------------------------------------


@invariant(
    "a partial swap-in writes only after the resident prefix: a load over it overwrites KV the device still serves",
    "safety",
    needs=(TIERED_SWAP_IN,),
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
    needs=(TIERED_SWAP_IN,),
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
    needs=(TIERED_SWAP_IN,),
)
def invariant_swap_round_trip_exact(seq: SeqId, held: Sequence[int], read: Sequence[int]) -> str | None:
    if tuple(held) != tuple(read):
        return f"sequence {seq!r} held {tuple(held)} and reads back {tuple(read)} after its swap-in"
    return None
