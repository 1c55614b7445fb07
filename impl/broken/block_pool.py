"""Broken block pools: each breaks a rule of ``kvspec.spec.block_pool`` and must be caught.

Every member is an ``Implementation`` whose pool is a small subclass of
the reference and declares the invariants that catch it.  The last ones
declare a convention other than the reference's (or that they trust their
caller), honour it, and then break a safety rule: a declared convention never
excuses one.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvspec.impl.block_pool import BlockPool, LFUFreeQueue, LRUFreeQueue
from kvspec.impl.broken import members
from kvspec.spec import block_pool as spec
from kvspec.spec.conventions import Conventions, Policy, PoolConventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.invariants import (
    invariant_answer_not_changed_later,
    invariant_failed_operation_changes_nothing,
    invariant_no_untyped_error,
    invariant_out_of_contract_call_rejected,
    invariant_result_matches_spec,
)

pool = members("block_pool", "block pool")  # a member: its pool, and the rules that catch it in that machine


class LeaksOnFree(BlockPool):
    """Dropping the last reference forgets the block instead of queueing it: it stays counted, held by no one."""

    def release(self, blocks: Sequence[int]) -> None:
        super().release(blocks)
        for block in set(blocks):
            if self._refcounts[block] == 0:
                self._free.remove(block)
                self._refcounts[block] = 1


leaks_on_free = pool("leaks on free", LeaksOnFree, spec.invariant_no_leak, spec.invariant_refcount_matches_holders)
# Declares that it trusts its caller -- and leaks on free, which no caller excuses.
trusting_leaks_on_free = pool(
    "trusts its caller, leaks on free", LeaksOnFree, spec.invariant_no_leak, conventions=Conventions(trusts_caller=True)
)


class AcceptsDoubleFree(BlockPool):
    """Releases blocks nobody holds, driving counts negative."""

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._free.push(block, self._uses[block])


accepts_double_free = pool(
    "accepts double free", AcceptsDoubleFree, invariant_out_of_contract_call_rejected, spec.invariant_capacity_conserved
)


class HitLeavesBlockQueued(BlockPool):
    """A cache hit revives a free block but leaves it in the free queue too."""

    def share(self, blocks: Sequence[int]) -> None:
        free = [b for b in blocks if self._refcounts[b] == 0]
        super().share(blocks)
        for block in free:
            self._free.push(block, self._uses[block])


hit_leaves_block_queued = pool("a hit leaves the block queued", HitLeavesBlockQueued, spec.invariant_free_queue_exact)


class AllocateNotAtomic(BlockPool):
    """Takes what it can before noticing that there is not enough."""

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            super().allocate(len(self._free))
            raise OutOfBlocks(n, 0)
        return super().allocate(n)


allocate_not_atomic = pool(
    "failed allocate not rolled back", AllocateNotAtomic, invariant_failed_operation_changes_nothing
)


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


evicts_most_recent_first = pool("wrong end of the free queue", EvictsMostRecentFirst, spec.invariant_eviction_order)


class ReleasesTogetherInReverse(BlockPool):
    """A legal choice kvspec does not model: the blocks of one ``release`` are queued last first.  Only the
    eviction order differs (a convention finding); every count and holder is right, so no safety rule fails."""

    def release(self, blocks: Sequence[int]) -> None:
        super().release(list(blocks)[::-1])


releases_together_in_reverse = pool(
    "a legal choice: blocks released together queued in reverse",
    ReleasesTogetherInReverse,
    spec.invariant_pool_refines_spec,
)


class NewestFirstAmongEquals(LFUFreeQueue):
    """LFU's ties broken the other way: of the blocks used equally often, the one released last goes first."""

    def push(self, block: int, uses: int) -> None:
        super().push(block, uses)
        self._buckets[uses].move_to_end(block, last=False)

    def push_all(self, blocks: Sequence[int], uses: Sequence[int]) -> None:
        for block in blocks:
            self.push(block, uses[block])


class BreaksLFUTiesTheOtherWay(BlockPool):
    """A legal choice kvspec does not model: under LFU, ties go to the most recently released block.  Only
    the eviction order differs from the declared policy's (a convention finding), never a count or a holder."""

    def __init__(self, capacity: int, policy: Policy = "lru") -> None:
        super().__init__(capacity, policy)
        if policy == "lfu":
            self._free = NewestFirstAmongEquals(range(capacity))


breaks_lfu_ties_the_other_way = pool(
    "a legal choice: LFU ties broken the other way",
    BreaksLFUTiesTheOtherWay,
    spec.invariant_eviction_order,
)


class EvictsInUseBlocks(BlockPool):
    """``evict`` drops cached hashes in block order, whether the block is free or not."""

    def evict(self, n: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            return super().evict(n)
        victims = [b for b, h in enumerate(self._hashes) if h is not None][:n]
        for block in victims:
            self._forget(block)
        return victims


evicts_in_use_blocks = pool("evicts in-use cached blocks", EvictsInUseBlocks, spec.invariant_in_use_never_reclaimed)


class KeepsTheHashOfBlocksHandedOut(BlockPool):
    """Hands out a free cached block without forgetting its hash: the map still names it under the hash, so the
    next hit shares a block its new holder is overwriting with its own tokens (a stale hit)."""

    def allocate(self, n: int) -> list[int]:
        hashes = list(self._hashes)
        blocks = super().allocate(n)
        for block in blocks:
            if hashes[block] is not None:
                self._hashes[block] = hashes[block]
                self._cached[hashes[block]] = block
        return blocks


keeps_the_hash_of_blocks_handed_out = pool(
    "hands out cached blocks still named by their hash", KeepsTheHashOfBlocksHandedOut, spec.invariant_no_stale_hit
)


class RegisterAlwaysSucceeds(BlockPool):
    """Answers True for a hash it refused: the caller believes its block is cached."""

    def register(self, block: int, block_hash: Hashable) -> bool:
        super().register(block, block_hash)
        return True


register_always_succeeds = pool(
    "register answers True for a refused hash", RegisterAlwaysSucceeds, invariant_result_matches_spec
)


class NumFreeSkipsCachedBlocks(BlockPool):
    """``num_free()`` counts only the free blocks that carry no hash, as if cached ones were in use."""

    def num_free(self) -> int:
        return sum(1 for block in self._free if self._hashes[block] is None)


num_free_skips_cached_blocks = pool(
    "num_free() leaves out cached free blocks", NumFreeSkipsCachedBlocks, spec.invariant_counts_match_snapshot
)


class LFUIgnoresHits(BlockPool):
    """Under LFU a hit is not counted as a use: popular blocks are evicted as if cold."""

    def share(self, blocks: Sequence[int]) -> None:
        uses = list(self._uses)
        super().share(blocks)
        self._uses = uses


lfu_ignores_hits = pool("LFU does not count hits", LFUIgnoresHits, spec.invariant_pool_refines_spec)


class HeadQueuesEveryRelease(BlockPool):
    """vLLM's convention -- a freed block without a hash goes to the head -- applied to every release of such
    a block, not only the one that frees it: a shared block is queued while still in use."""

    def release(self, blocks: Sequence[int]) -> None:
        super().release(blocks)
        assert isinstance(self._free, LRUFreeQueue), "this pool offers LRU only"
        queue = self._free._queue
        for block in reversed([b for b in blocks if self._hashes[b] is None]):
            queue[block] = None
            queue.move_to_end(block, last=False)


head_queues_every_release = pool(
    "head of the queue on every release",
    HeadQueuesEveryRelease,
    spec.invariant_free_queue_exact,
    conventions=Conventions(pool=PoolConventions(unhashed_free_position="head", policies=("lru",))),
)


class KeepsDuplicatesForgetsBoth(BlockPool):
    """vLLM's convention -- a second block under a cached hash keeps it too -- but forgetting one of them
    drops the hash's whole entry, while the other block still carries the hash."""

    def __init__(self, capacity: int, policy: Policy = "lru") -> None:
        super().__init__(capacity, policy)
        self._carriers: dict[Hashable, list[int]] = {}

    def register(self, block: int, block_hash: Hashable) -> bool:
        if super().register(block, block_hash):
            self._carriers[block_hash] = [block]
        else:
            self._hashes[block] = block_hash
            self._carriers[block_hash].append(block)
        return True

    def lookup(self, block_hash: Hashable) -> int | None:
        carriers = self._carriers.get(block_hash)
        return carriers[0] if carriers else None

    def _forget(self, block: int) -> None:
        block_hash = self._hashes[block]
        if block_hash is not None:
            self._cached.pop(block_hash, None)
            self._carriers.pop(block_hash, None)
            self._hashes[block] = None

    def snapshot(self) -> spec.PoolState:
        carriers = {block_hash: tuple(blocks) for block_hash, blocks in self._carriers.items()}
        state = super().snapshot()
        return spec.PoolState(state.capacity, state.refcounts, state.free_queue, state.block_hashes, carriers)


keeps_duplicates_forgets_both = pool(
    "duplicate hashes kept, then both forgotten",
    KeepsDuplicatesForgetsBoth,
    spec.invariant_hash_map_consistent,
    conventions=Conventions(pool=PoolConventions(duplicate_hash="keep")),
)


class LookupRaisesOnMiss(BlockPool):
    """``lookup`` reads the hash map with ``[]``: a miss raises ``KeyError`` into the caller's scheduling step."""

    def lookup(self, block_hash: Hashable) -> int | None:
        return self._cached[block_hash]


lookup_raises_on_miss = pool("lookup raises KeyError on a miss", LookupRaisesOnMiss, invariant_no_untyped_error)


class ReusesItsAnswer(BlockPool):
    """``allocate`` answers one scratch list of its own, refilled by the next allocation: a caller that kept the
    first answer (a block table row under construction) finds it holding the second's blocks."""

    def __init__(self, capacity: int, policy: Policy = "lru") -> None:
        super().__init__(capacity, policy)
        self._scratch: list[int] = []

    def allocate(self, n: int) -> list[int]:
        self._scratch[:] = super().allocate(n)
        return self._scratch


reuses_its_answer = pool(
    "allocate answers a scratch list it refills", ReusesItsAnswer, invariant_answer_not_changed_later
)


class LRUOnly(LeaksOnFree):
    """Offers LRU alone (and says so); then leaks on free."""

    def __init__(self, capacity: int, policy: Policy = "lru") -> None:
        if policy != "lru":
            raise InvalidOperation(f"this pool offers LRU only, not {policy!r}")
        super().__init__(capacity, policy)


lru_only_leaks = pool(
    "LRU only, leaks on free",
    LRUOnly,
    spec.invariant_no_leak,
    conventions=Conventions(pool=PoolConventions(policies=("lru",))),
)


class ForgetsEvictableBlocks(BlockPool):
    """Sizes an allocation by the free blocks that carry no hash, as if a cached free block were still in use:
    with the prefix cache warm it reports out of memory while evictable blocks fill its queue, and the
    scheduler waits, or preempts a request, for blocks the pool already has."""

    def allocate(self, n: int) -> list[int]:
        uncached = sum(1 for block in self._free if self._hashes[block] is None)
        if type(n) is int and uncached < n <= len(self._free):
            raise OutOfBlocks(n, uncached)
        return super().allocate(n)


forgets_evictable_blocks = pool(
    "out of blocks while cached blocks are free",
    ForgetsEvictableBlocks,
    spec.invariant_allocation_refused_only_when_short,
)
