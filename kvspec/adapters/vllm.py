"""kvspec's ``BlockPool`` protocol over vLLM's own v1 ``BlockPool`` (tested: vLLM 0.33.0).

    kvspec check --impl kvspec.adapters.vllm:factory

One engine call per operation, and no check the engine does not make itself:

* ``allocate(n)`` -> ``BlockPool.get_new_blocks(n)``; its ``ValueError`` ("Cannot get n
  free blocks") is translated to ``OutOfBlocks``, the only translation.
* ``share(blocks)`` -> ``touch(blocks)``; ``release(blocks)`` -> ``free_blocks(blocks)``,
  in the order given (vLLM's "eviction priority" order: first freed, first evicted).
* ``register(block, hash)`` -> ``_insert_block_hash(hash, block)``, the call
  ``cache_full_blocks`` makes for each newly full block of a request.  The kvspec hash is
  the engine's key as is (vLLM's keys are opaque bytes; the map only hashes and compares
  them), and the answer is True: vLLM keeps a second block under a cached hash.
* ``lookup(hash)`` -> ``cached_block_hash_to_block.get_one_block(hash)``, what
  ``get_cached_block`` does for one KV-cache group.
* ``evict(n)``: vLLM evicts *lazily* -- a free block keeps its hash until
  ``get_new_blocks`` hands it out, which is where ``allocate`` meets the spec's eviction.
  It has no "evict the n least recently used" call; its one eager eviction is
  ``evict_blocks(block_ids)`` (used by KV connectors).  The adapter reads the engine's
  free queue for the first ``n`` blocks that carry a hash -- the ones allocation would
  evict first -- and hands them to ``evict_blocks``.

The null block: vLLM pops block 0 off the free queue at start as a placeholder for
skipped positions, so a pool of ``capacity`` blocks is an engine pool of ``capacity + 1``,
and kvspec block ``b`` is engine block ``b + 1``.  Only LRU exists in vLLM: ``lfu`` is
declared unsupported.

Conventions, as read from ``vllm/v1/core/block_pool.py``:

* ``unhashed_free_position="head"``: ``free_blocks`` collects blocks reaching count 0
  without a hash in ``blocks_to_evict_first`` and ``free_block_queue.prepend_n``s them
  ("LIFO reuse of non-cached blocks for better GPU locality"); hashed ones are
  ``append_n``-ed to the tail.
* ``duplicate_hash="keep"``: ``BlockHashToBlockMap`` ("We currently don't de-duplicate
  the blocks in the cache ... so that block tables are append-only") turns a hash's entry
  into a ``{block_id: block}`` dict; ``get_one_block`` answers the first inserted.
* ``policies=("lru",)``: one ``FreeKVCacheBlockQueue``, a doubly linked list in LRU order.
* ``trusts_caller=True``: ``touch`` and ``free_blocks`` adjust ``ref_cnt`` unchecked (a
  double free drives it to -1), ``_insert_block_hash`` takes a free block, and
  ``get_new_blocks(-1)`` passes its ``num_blocks > free`` test.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from kvspec.spec.block_pool import Policy, PoolState
from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions, PoolConventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation

VERSION = "0.33.0"
CONVENTIONS = Conventions(
    pool=PoolConventions(unhashed_free_position="head", duplicate_hash="keep", policies=("lru",)),
    trusts_caller=True,
)


def engine_block_pool() -> Any:
    """vLLM's ``BlockPool`` class (importing vLLM takes a few seconds)."""
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    return VllmBlockPool


class VllmBlockPool:
    """A vLLM v1 ``BlockPool`` seen through ``kvspec.spec.block_pool.BlockPool``."""

    def __init__(self, capacity: int, policy: Policy = "lru") -> None:
        if policy not in CONVENTIONS.pool.policies:
            raise InvalidOperation(f"vLLM's BlockPool has no {policy!r} eviction policy (only LRU)")
        self.engine = engine_block_pool()(capacity + 1, enable_caching=True, hash_block_size=1)
        self._blocks = self.engine.blocks  # engine block b + 1 is kvspec block b; block 0 is the null block

    @property
    def capacity(self) -> int:
        return int(self.engine.num_gpu_blocks) - 1

    def num_free(self) -> int:
        return int(self.engine.get_num_free_blocks())

    def refcount(self, block: int) -> int:
        return int(self._blocks[block + 1].ref_cnt)

    def allocate(self, n: int) -> list[int]:
        try:
            blocks = self.engine.get_new_blocks(n)
        except ValueError:
            raise OutOfBlocks(n, self.engine.get_num_free_blocks()) from None
        return [block.block_id - 1 for block in blocks]

    def share(self, blocks: Sequence[int]) -> None:
        self.engine.touch([self._blocks[b + 1] for b in blocks])

    def release(self, blocks: Sequence[int]) -> None:
        self.engine.free_blocks([self._blocks[b + 1] for b in blocks])

    def register(self, block: int, block_hash: Hashable) -> bool:
        self.engine._insert_block_hash(block_hash, self._blocks[block + 1], num_tokens=None)
        return True

    def lookup(self, block_hash: Hashable) -> int | None:
        block = self.engine.cached_block_hash_to_block.get_one_block(block_hash)
        return None if block is None else int(block.block_id) - 1

    def evict(self, n: int) -> list[int]:
        victims = [b for b in self._free_queue() if b.block_hash is not None][: max(n, 0)]
        self.engine.evict_blocks({b.block_id for b in victims})
        return [b.block_id - 1 for b in victims]

    def snapshot(self) -> PoolState:
        """The engine's own fields: ``ref_cnt``, the linked free list, ``block_hash``, the hash map."""
        cached: dict[Hashable, tuple[int, ...]] = {}
        for block_hash, entry in self.engine.cached_block_hash_to_block._cache.items():
            carriers = entry.values() if isinstance(entry, dict) else [entry]  # a dict once a hash is duplicated
            cached[block_hash] = tuple(block.block_id - 1 for block in carriers)
        blocks = self._blocks[1:]
        return PoolState(
            capacity=self.capacity,
            refcounts=tuple(b.ref_cnt for b in blocks),
            free_queue=tuple(b.block_id - 1 for b in self._free_queue()),
            block_hashes=tuple(b.block_hash for b in blocks),
            cached=cached,
        )

    def _free_queue(self) -> list[Any]:
        return list(self.engine.free_block_queue.get_all_free_blocks())


def engine_version() -> str:
    import vllm

    return str(vllm.__version__)


def factory() -> Implementation:
    """vLLM's ``BlockPool`` under test; every other layer is the reference's, on top of it."""
    engine_block_pool()  # fail here, with the engine's ImportError, when vLLM is not installed
    name = f"vLLM {engine_version()} BlockPool"
    pool = Offer(VllmBlockPool, emulated={"evict"})  # vLLM evicts lazily; evict(n) is read off its free queue
    return Implementation(name=name, block_pool=pool, conventions=CONVENTIONS)
