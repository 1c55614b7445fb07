"""Broken block pools: each breaks one rule of ``kvspec.spec.block_pool`` and must be caught.

Every factory returns an ``Implementation`` whose pool is a one-method
subclass of the reference; the meta-tests name the invariant that catches it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.impl.block_pool import BlockPool
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.implementation import Implementation


class LeaksOnFree(BlockPool):
    """Dropping the last reference forgets the block instead of queueing it."""

    def release(self, blocks: Sequence[int]) -> None:
        super().release([b for b in blocks if self._refcounts[b] > 1])


class AcceptsDoubleFree(BlockPool):
    """Releases blocks nobody holds, driving counts negative."""

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._free.push(block, self._uses[block])


class HitLeavesBlockQueued(BlockPool):
    """A cache hit revives a free block but leaves it in the free queue too."""

    def share(self, blocks: Sequence[int]) -> None:
        free = [b for b in blocks if self._refcounts[b] == 0]
        super().share(blocks)
        for block in free:
            self._free.push(block, self._uses[block])


class AllocateNotAtomic(BlockPool):
    """Takes what it can before noticing that there is not enough."""

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            super().allocate(len(self._free))
            raise OutOfBlocks(n, 0)
        return super().allocate(n)


class EvictsMostRecentFirst(BlockPool):
    """Hands out the block released last: the wrong end of the queue."""

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free) or n < 1:
            return super().allocate(n)
        blocks = list(self._free)[-n:][::-1]
        for block in blocks:
            self._free.remove(block)
            self._forget(block)
            self._refcounts[block] = self._uses[block] = 1
        return blocks


class EvictsInUseBlocks(BlockPool):
    """``evict`` drops cached hashes in block order, whether the block is free or not."""

    def evict(self, n: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            return super().evict(n)
        victims = [b for b, h in enumerate(self._hashes) if h is not None][:n]
        for block in victims:
            self._forget(block)
        return victims


def _with_pool(name: str, pool: type[BlockPool]) -> Implementation:
    """A pool alone: the suite runs the reference's other layers on top of it."""
    return Implementation(name=name, block_pool=pool)


def leaks_on_free() -> Implementation:
    return _with_pool("broken: leaks on free", LeaksOnFree)


def accepts_double_free() -> Implementation:
    return _with_pool("broken: accepts double free", AcceptsDoubleFree)


def hit_leaves_block_queued() -> Implementation:
    return _with_pool("broken: a hit leaves the block queued", HitLeavesBlockQueued)


def allocate_not_atomic() -> Implementation:
    return _with_pool("broken: failed allocate not rolled back", AllocateNotAtomic)


def evicts_most_recent_first() -> Implementation:
    return _with_pool("broken: wrong end of the free queue", EvictsMostRecentFirst)


def evicts_in_use_blocks() -> Implementation:
    return _with_pool("broken: evicts in-use cached blocks", EvictsInUseBlocks)
