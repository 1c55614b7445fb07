"""The reference block pool: O(1) free queue, reference counts, hash map.

Blocks reaching reference count zero join the free queue's tail; ``allocate``
pops from the head.  Under ``lru`` the queue is an ``OrderedDict`` (O(1) push,
pop and removal from the middle when a cached block is hit); under ``lfu`` it
is one such queue per use count, with a heap of the live counts.

Speed: a request of a trace replay (``kvspec trace``) is five calls, each
over all of its blocks -- ``lookup_prefix``, ``share``, ``allocate``,
``register_blocks``, ``release`` -- and each walks its blocks in one Python
loop that checks a block where it reads it (separate C-level passes cost
more on CPython 3.11).  ``release`` and ``register_blocks`` undo what the
loop did before the first block they refuse; ``share`` cannot (a hit block
leaves the middle of the queue), so it checks every block first.  Under LRU
the loops work on the queue's ``OrderedDict`` itself; under LFU the queue
moves a call's blocks in one method call (``push_all``, ``remove_all``,
``pop_many``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence

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
        return self._queue.popitem(False)[0]

    def push_all(self, blocks: Sequence[int], uses: Sequence[int]) -> None:
        """``push`` each block in order; ``uses`` is indexed by block."""
        queue = self._queue
        for block in blocks:
            queue[block] = None

    def remove_all(self, blocks: Iterable[int], uses: Sequence[int]) -> None:
        queue = self._queue
        for block in blocks:
            del queue[block]

    def pop_many(self, n: int) -> list[int]:
        popitem = self._queue.popitem
        return [popitem(False)[0] for _ in range(n)]


class LFUFreeQueue:
    """Free blocks bucketed by uses, each bucket in release order; the least used is evicted first.

    A heap holds the distinct use counts that have a bucket, so push, pop and
    removal are O(1) amortized while few distinct counts are live.  A block is
    filed under the uses it had when pushed: the pool changes a block's uses
    only while it is out of the queue.
    """

    def __init__(self, blocks: Sequence[int]) -> None:
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._counts: list[int] = []
        self._size = 0
        self.push_all(blocks, [0] * len(blocks))

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._buckets[uses] for uses in sorted(self._buckets))

    def push(self, block: int, uses: int) -> None:
        self._bucket(uses)[block] = None
        self._size += 1

    def remove(self, block: int) -> None:
        uses = next(uses for uses, bucket in self._buckets.items() if block in bucket)
        self._take(uses, block)

    def pop(self) -> int:
        return self.pop_many(1)[0]

    def push_all(self, blocks: Sequence[int], uses: Sequence[int]) -> None:
        buckets = self._buckets
        for block in blocks:
            count = uses[block]
            bucket = buckets.get(count)
            if bucket is None:
                bucket = self._bucket(count)
            bucket[block] = None
        self._size += len(blocks)

    def remove_all(self, blocks: Iterable[int], uses: Sequence[int]) -> None:
        for block in blocks:
            self._take(uses[block], block)

    def pop_many(self, n: int) -> list[int]:
        taken: list[int] = []
        buckets, counts = self._buckets, self._counts
        while len(taken) < n:
            while counts[0] not in buckets:
                heapq.heappop(counts)  # a count whose bucket emptied by removal
            bucket = buckets[counts[0]]
            popitem = bucket.popitem
            taken += [popitem(False)[0] for _ in range(min(n - len(taken), len(bucket)))]
            if not bucket:
                del buckets[heapq.heappop(counts)]
        self._size -= n
        return taken

    def _bucket(self, uses: int) -> OrderedDict[int, None]:
        bucket = self._buckets.get(uses)
        if bucket is None:
            bucket = self._buckets[uses] = OrderedDict()
            heapq.heappush(self._counts, uses)
        return bucket

    def _take(self, uses: int, block: int) -> None:
        bucket = self._buckets[uses]
        del bucket[block]
        self._size -= 1
        if not bucket:
            del self._buckets[uses]  # its count leaves the heap lazily, in pop_many


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
        return len(self._free if self._lru is None else self._lru)

    def refcount(self, block: int) -> int:
        if type(block) is not int or not 0 <= block < self._capacity:  # _check's test, inline: a manager asks often
            self._check(block)
        return self._refcounts[block]

    def allocate(self, n: int) -> list[int]:
        if type(n) is not int or n < 0:
            raise InvalidOperation(f"cannot allocate {n!r} blocks")
        free = self._free
        if n > len(free):
            raise OutOfBlocks(n, len(free))
        refcounts, hashes, uses = self._refcounts, self._hashes, self._uses
        if n == 1:  # the commonest call: a sequence grows by one block (and the one that forgets through _forget)
            block = free.pop()
            if hashes[block] is not None:
                self._forget(block)
            refcounts[block] = uses[block] = 1
            return [block]
        blocks, cached = free.pop_many(n), self._cached
        for block in blocks:
            block_hash = hashes[block]
            if block_hash is not None:  # handing out a cached block evicts it
                del cached[block_hash]
                hashes[block] = None
            refcounts[block] = uses[block] = 1
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        refcounts, hashes, capacity = self._refcounts, self._hashes, self._capacity
        for block in blocks:  # all or nothing: every block checked before any changes
            if (
                type(block) is not int
                or not 0 <= block < capacity
                or not (refcounts[block] or hashes[block] is not None)
            ):
                self._refuse_share(blocks)
        lru, uses = self._lru, self._uses
        if lru is None:  # LFU files a free block under its uses: revived blocks leave before this use counts
            self._free.remove_all(dict.fromkeys([block for block in blocks if not refcounts[block]]), uses)
        for block in blocks:
            count = refcounts[block]
            if not count and lru is not None:  # a hit on a free cached block: it leaves the queue
                del lru[block]
            refcounts[block] = count + 1
            uses[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        refcounts, capacity, lru = self._refcounts, self._capacity, self._lru
        freed = []  # under LFU, queued at the end
        for done, block in enumerate(blocks):
            if type(block) is not int or not 0 <= block < capacity or not refcounts[block]:
                self._undo_release(blocks[:done])
                self._refuse_release(blocks)
            count = refcounts[block] - 1
            refcounts[block] = count
            if count == 0:
                if lru is None:
                    freed.append(block)
                else:
                    lru[block] = None
        if freed:
            self._free.push_all(freed, self._uses)

    def register(self, block: int, block_hash: Hashable) -> bool:
        return self.register_blocks((block,), (block_hash,))[0]

    def register_blocks(self, blocks: Sequence[int], block_hashes: Sequence[Hashable]) -> list[bool]:
        if len(blocks) != len(block_hashes):
            raise InvalidOperation(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        refcounts, hashes, cached, capacity = self._refcounts, self._hashes, self._cached, self._capacity
        answers: list[bool] = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if (
                type(block) is not int
                or not 0 <= block < capacity
                or not refcounts[block]
                or hashes[block] is not None
                or block_hash is None
            ):
                self._undo_registration(blocks[: len(answers)], answers)
                self._refuse_registration(blocks, block_hashes)
            fresh = block_hash not in cached
            if fresh:
                hashes[block] = block_hash
                cached[block_hash] = block
            answers.append(fresh)
        return answers

    def lookup(self, block_hash: Hashable) -> int | None:
        return self._cached.get(block_hash)

    def lookup_prefix(self, block_hashes: Sequence[Hashable]) -> list[int]:
        found = list(map(self._cached.get, block_hashes))
        try:
            del found[found.index(None) :]
        except ValueError:  # every hash is cached
            pass
        return found  # type: ignore[return-value]  # cut at the first None

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

    def _refuse_share(self, blocks: Sequence[int]) -> None:
        self._check_all(blocks)
        block = next(b for b in blocks if self._refcounts[b] == 0 and self._hashes[b] is None)
        raise InvalidOperation(f"block {block} is free and uncached: its contents are gone")

    def _undo_release(self, released: Sequence[int]) -> None:
        """Take back the references ``release`` dropped before it met a block it must refuse."""
        for block in released:
            if self._refcounts[block] == 0 and self._lru is not None:
                del self._lru[block]  # queued at the tail by this call: taken out, the queue is as it was
            self._refcounts[block] += 1

    def _refuse_release(self, blocks: Sequence[int]) -> None:
        self._check_all(blocks)
        block, times = next((b, t) for b, t in Counter(blocks).items() if self._refcounts[b] < t)
        raise InvalidOperation(
            f"block {block} released {times} time(s) but holds {self._refcounts[block]} reference(s)"
        )

    def _undo_registration(self, blocks: Sequence[int], answers: Sequence[bool]) -> None:
        for block, registered in zip(blocks, answers, strict=True):
            if registered:
                self._forget(block)

    def _refuse_registration(self, blocks: Sequence[int], block_hashes: Sequence[Hashable]) -> None:
        """Raise what the first refused ``register`` of ``blocks``, in order, raises."""
        self._check_all(blocks)
        registered: set[int] = set()
        added: set[Hashable] = set()
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block_hash is None:
                raise InvalidOperation("None is not a block hash")
            if self._refcounts[block] == 0:
                raise InvalidOperation(f"block {block} is free: only a block in use can be registered")
            if self._hashes[block] is not None or block in registered:
                raise InvalidOperation(f"block {block} is already registered")
            if block_hash not in self._cached and block_hash not in added:
                registered.add(block)
                added.add(block_hash)

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
