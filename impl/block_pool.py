"""The reference block pool: O(1) free queue, reference counts, hash map.

Blocks reaching reference count zero join the free queue's tail; ``allocate``
pops from the head.  Under ``lru`` the queue is an ``OrderedDict`` (O(1) push,
pop and removal from the middle when a cached block is hit); under ``lfu`` it
is one such queue per use count, with a heap of the live counts.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator, Sequence

from kvspec.spec.block_pool import POLICIES, Policy, PoolState
from kvspec.spec.errors import InvalidOperation, OutOfBlocks


class LRUFreeQueue:
    """Free blocks in release order; the head is evicted first."""

    def __init__(self, blocks: Sequence[int]) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)

    def push(self, block: int, uses: int) -> None:
        self._queue[block] = None

    def remove(self, block: int) -> None:
        del self._queue[block]

    def pop(self) -> int:
        return self._queue.popitem(last=False)[0]


class LFUFreeQueue:
    """Free blocks bucketed by uses, each bucket in release order; the least used is evicted first.

    A heap holds the distinct use counts that have a bucket, so push, pop and
    removal are O(1) amortized while few distinct counts are live.
    """

    def __init__(self, blocks: Sequence[int]) -> None:
        self._uses_of: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._counts: list[int] = []
        for block in blocks:
            self.push(block, 0)

    def __len__(self) -> int:
        return len(self._uses_of)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._buckets[uses] for uses in sorted(self._buckets))

    def push(self, block: int, uses: int) -> None:
        bucket = self._buckets.get(uses)
        if bucket is None:
            bucket = self._buckets[uses] = OrderedDict()
            heapq.heappush(self._counts, uses)
        bucket[block] = None
        self._uses_of[block] = uses

    def remove(self, block: int) -> None:
        uses = self._uses_of.pop(block)
        bucket = self._buckets[uses]
        del bucket[block]
        if not bucket:
            del self._buckets[uses]  # its count leaves the heap lazily, in pop

    def pop(self) -> int:
        while self._counts[0] not in self._buckets:
            heapq.heappop(self._counts)
        uses = self._counts[0]
        bucket = self._buckets[uses]
        block = bucket.popitem(last=False)[0]
        if not bucket:
            del self._buckets[uses]
            heapq.heappop(self._counts)
        del self._uses_of[block]
        return block


FREE_QUEUES: dict[str, type[LRUFreeQueue] | type[LFUFreeQueue]] = {"lru": LRUFreeQueue, "lfu": LFUFreeQueue}
_INT = {int}


class BlockPool:
    """Physical blocks with reference counts, a free queue and a block-hash map."""

    def __init__(self, capacity: int, policy: Policy = "lru") -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise InvalidOperation(f"pool capacity must be a positive int, got {capacity!r}")
        if policy not in POLICIES:
            raise InvalidOperation(f"unknown eviction policy {policy!r}; choose from {POLICIES}")
        self._capacity = capacity
        self._refcounts = [0] * capacity
        self._uses = [0] * capacity
        self._hashes: list[Hashable | None] = [None] * capacity
        self._cached: dict[Hashable, int] = {}
        self._free: LRUFreeQueue | LFUFreeQueue = FREE_QUEUES[policy](range(capacity))
        # Under LRU the hot paths work on the queue's OrderedDict directly (no per-block method calls).
        self._lru: OrderedDict[int, None] | None = self._free._queue if isinstance(self._free, LRUFreeQueue) else None

    @property
    def capacity(self) -> int:
        return self._capacity

    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refcounts[block]

    def allocate(self, n: int) -> list[int]:
        if type(n) is not int or n < 0:
            raise InvalidOperation(f"cannot allocate {n!r} blocks")
        free = self._free
        if n > len(free):
            raise OutOfBlocks(n, len(free))
        lru, refcounts, hashes = self._lru, self._refcounts, self._hashes
        if lru is not None:
            if n == 1:  # the commonest call: a sequence grows by one block
                block = lru.popitem(False)[0]
                if hashes[block] is not None:
                    self._forget(block)
                refcounts[block] = 1
                return [block]
            popitem = lru.popitem
            blocks = [popitem(False)[0] for _ in range(n)]
        else:
            pop, uses = free.pop, self._uses
            blocks = [pop() for _ in range(n)]
            for block in blocks:
                uses[block] = 1
        cached = self._cached
        for block in blocks:
            block_hash = hashes[block]
            if block_hash is not None:  # handing out a cached block evicts it
                del cached[block_hash]
                hashes[block] = None
            refcounts[block] = 1
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        refcounts, hashes = self._refcounts, self._hashes
        self._check_all(blocks)
        if 0 in map(refcounts.__getitem__, blocks):
            for block in blocks:
                if refcounts[block] == 0 and hashes[block] is None:
                    raise InvalidOperation(f"block {block} is free and uncached: its contents are gone")
        lru, uses = self._lru, self._uses
        for block in blocks:
            if refcounts[block] == 0:
                if lru is not None:
                    del lru[block]
                else:
                    self._free.remove(block)
            refcounts[block] += 1
            uses[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        refcounts = self._refcounts
        self._check_all(blocks)
        if 0 in map(refcounts.__getitem__, blocks) or (len(blocks) > 1 and len(set(blocks)) != len(blocks)):
            for block, times in Counter(blocks).items():
                if refcounts[block] < times:
                    raise InvalidOperation(
                        f"block {block} released {times} time(s) but holds {refcounts[block]} reference(s)"
                    )
        lru = self._lru
        if lru is not None:
            for block in blocks:
                count = refcounts[block] - 1
                refcounts[block] = count
                if count == 0:
                    lru[block] = None
            return
        push, uses = self._free.push, self._uses
        for block in blocks:
            count = refcounts[block] - 1
            refcounts[block] = count
            if count == 0:
                push(block, uses[block])

    def register(self, block: int, block_hash: Hashable) -> bool:
        if type(block) is not int or not 0 <= block < self._capacity:
            self._check(block)
        if block_hash is None:
            raise InvalidOperation("None is not a block hash")
        if self._refcounts[block] == 0:
            raise InvalidOperation(f"block {block} is free: only a block in use can be registered")
        if self._hashes[block] is not None:
            raise InvalidOperation(f"block {block} is already registered")
        if block_hash in self._cached:
            return False
        self._hashes[block] = block_hash
        self._cached[block_hash] = block
        return True

    def lookup(self, block_hash: Hashable) -> int | None:
        return self._cached.get(block_hash)

    def evict(self, n: int) -> list[int]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidOperation(f"cannot evict {n!r} blocks")
        victims = list(itertools.islice((b for b in self._free if self._hashes[b] is not None), n))
        for block in victims:
            self._forget(block)
        return victims

    def snapshot(self) -> PoolState:
        return PoolState(
            capacity=self._capacity,
            refcounts=tuple(self._refcounts),
            free_queue=tuple(self._free),
            block_hashes=tuple(self._hashes),
            cached={block_hash: (block,) for block_hash, block in self._cached.items()},
        )

    def _forget(self, block: int) -> None:
        block_hash = self._hashes[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[block] = None

    def _check_all(self, blocks: Sequence[int]) -> None:
        """``_check`` for many blocks, with the common all-valid case in C-level builtins."""
        if len(blocks) == 1:
            block = blocks[0]
            if type(block) is not int or not 0 <= block < self._capacity:
                self._check(block)
        elif blocks and not (set(map(type, blocks)) <= _INT and min(blocks) >= 0 and max(blocks) < self._capacity):
            for block in blocks:
                self._check(block)

    def _check(self, block: object) -> None:
        if type(block) is not int or not 0 <= block < self._capacity:
            raise InvalidOperation(f"block {block!r} is not a block of this pool (0..{self._capacity - 1})")
