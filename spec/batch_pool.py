"""Layer 1's batch operations: a request's worth of hash-map calls at once (optional).

Rules (vLLM v1 ``BlockPool``'s ``find_longest_cache_hit`` and ``cache_full_blocks``):

* ``allocate``, ``share`` and ``release`` already take a whole request's
  blocks; these two do the same for the hash map, so that serving a request
  -- look its prefix up, share it, allocate the rest, register it, release
  everything -- is five calls.
* ``lookup_prefix(hashes)`` answers the blocks ``lookup`` names for
  ``hashes[0], hashes[1], ...`` up to the first hash not cached: the cached
  prefix of a request.  It changes nothing.
* ``register_blocks(blocks, hashes)`` is ``register(blocks[i], hashes[i])``
  for each ``i`` in order and answers their answers, all or nothing: lists of
  unequal lengths, or a pair that ``register`` would refuse, refuse the whole
  call and change nothing.

Each is an optional operation of a block pool (``LOOKUP_PREFIX``,
``REGISTER_BLOCKS``); a pool that offers one is a ``BatchBlockPool``.  The
transitions below extend ``kvspec.spec.block_pool``'s model, and the pool's
invariants judge them: a batch is its single calls in order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

from kvspec.spec.block_pool import BLOCK_POOL, BlockPool, Pool, lookup, register
from kvspec.spec.components import optional_operation
from kvspec.spec.errors import InvalidOperation


@runtime_checkable
class BatchBlockPool(BlockPool, Protocol):
    """A block pool that also offers the optional batch operations."""

    def lookup_prefix(self, block_hashes: Sequence[Hashable]) -> list[int]: ...
    def register_blocks(self, blocks: Sequence[int], block_hashes: Sequence[Hashable]) -> list[bool]: ...


LOOKUP_PREFIX = optional_operation("lookup_prefix", BatchBlockPool, "lookup_prefix", kinds=(BLOCK_POOL.name,))
REGISTER_BLOCKS = optional_operation("register_blocks", BatchBlockPool, "register_blocks", kinds=(BLOCK_POOL.name,))


def lookup_prefix(pool: Pool, block_hashes: Sequence[Hashable]) -> list[int]:
    """The blocks ``lookup`` names for the leading hashes, up to the first not cached."""
    found = []
    for block_hash in block_hashes:
        block = lookup(pool, block_hash)
        if block is None:
            break
        found.append(block)
    return found


def register_blocks(pool: Pool, blocks: Sequence[int], block_hashes: Sequence[Hashable]) -> tuple[Pool, list[bool]]:
    """``register`` each block under its hash, in order; one refused as out of contract refuses them all."""
    if len(blocks) != len(block_hashes):
        raise InvalidOperation(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
    answers = []
    for block, block_hash in zip(blocks, block_hashes, strict=True):
        pool, answer = register(pool, block, block_hash)
        answers.append(answer)
    return pool, answers
