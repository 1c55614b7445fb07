"""Layer 1 -- the block pool: physical KV blocks, reference counts, the free queue.

Rules (vLLM §4.1-4.2, lecture §4; vLLM v1 ``BlockPool`` is the model):

* The device's KV memory is cut into ``capacity`` physical blocks, numbered
  ``0 .. capacity-1``.  Each block has a reference count: how many block-table
  entries point at it.  A block is *in use* when its count is positive.
* A block whose count is zero is *free* and sits in the **free queue**.  A
  free block may still carry a hash (*free-but-cached*): its contents are a
  complete block of a prefix that a later request may reuse.
* ``allocate(n)`` hands out the first ``n`` blocks of the free queue in
  eviction order, all or none.  Handing out a cached block evicts it: its hash
  is forgotten.  Short of blocks, it raises ``OutOfBlocks`` and changes nothing.
* ``share(blocks)`` adds one reference to each block.  A free block may be
  shared only if it is cached (a prefix-cache hit, vLLM's ``touch``): it
  leaves the free queue and is in use again.
* ``release(blocks)`` drops one reference from each block, in the order
  given; a block whose count reaches zero enters the queue's tail.  Managers
  release a sequence's table last block first, so that a sequence's last
  blocks -- the least likely to be shared by a later prompt -- are evicted first.
* ``register(block, hash)`` caches an in-use full block under a hash.  The
  hash map is injective: if the hash already names a block, the new block
  stays uncached (``register`` answers False).  ``lookup(hash)`` names the
  cached block, in use or free.  ``evict(n)`` forgets the hashes of up to
  ``n`` free cached blocks, in eviction order.

Eviction order is the policy's: ``lru`` is the queue's own order (released
earliest, evicted first); ``lfu`` evicts the fewest-used block first and
breaks ties in LRU order, where a block's *uses* count the allocations and
shares of its current contents.

Theory of operation: ``Pool`` below is the spec's model.  Transitions are pure
functions that return a new ``Pool``; an implementation's ``snapshot()``
returns a ``PoolState``, the abstraction both are compared through, and the
invariants are predicates over ``PoolState``.

Invariants (checked after every step by ``kvspec.properties.machines``):

* ``invariant_free_queue_exact`` -- the free queue holds exactly the blocks of
  reference count zero, once each.
* ``invariant_capacity_conserved`` -- used + free = capacity.
* ``invariant_no_leak`` -- every block in use has a holder.
* ``invariant_refcount_matches_holders`` -- each count equals its references.
* ``invariant_hash_map_consistent`` -- the hash map is injective and names
  only blocks that carry that hash.
* ``invariant_in_use_never_reclaimed`` -- allocation and eviction touch only
  free blocks.
* ``invariant_eviction_order`` -- allocation and eviction follow the policy.
* ``invariant_pool_refines_spec`` -- the implementation's state is the model's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs

from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.invariants import diff_states, invariant

Policy = Literal["lru", "lfu"]
POLICIES: tuple[Policy, ...] = ("lru", "lfu")


@attrs.frozen
class PoolState:
    """The abstract state of a block pool: what ``snapshot()`` returns."""

    capacity: int
    refcounts: tuple[int, ...]
    free_queue: tuple[int, ...]  # in eviction order: the head is handed out first
    block_hashes: tuple[Hashable | None, ...]
    cached: Mapping[Hashable, int]  # hash -> block

    @property
    def num_free(self) -> int:
        return len(self.free_queue)


@runtime_checkable
class BlockPool(Protocol):
    """What a block pool offers.  Thin enough to wrap vLLM v1's ``BlockPool``."""

    @property
    def capacity(self) -> int: ...
    def num_free(self) -> int: ...
    def refcount(self, block: int) -> int: ...
    def allocate(self, n: int) -> list[int]: ...
    def share(self, blocks: Sequence[int]) -> None: ...
    def release(self, blocks: Sequence[int]) -> None: ...
    def register(self, block: int, block_hash: Hashable) -> bool: ...
    def lookup(self, block_hash: Hashable) -> int | None: ...
    def evict(self, n: int) -> list[int]: ...
    def snapshot(self) -> PoolState: ...


# -- the model -------------------------------------------------------------------


@attrs.frozen
class Pool:
    """The spec's model of a pool.  ``lru`` keeps free blocks in release order."""

    capacity: int
    policy: Policy
    refcounts: tuple[int, ...]
    lru: tuple[int, ...]
    block_hashes: tuple[Hashable | None, ...]
    uses: tuple[int, ...]


def new_pool(capacity: int, policy: Policy = "lru") -> Pool:
    """A pool whose blocks are all free, queued in block order."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise InvalidOperation(f"pool capacity must be a positive int, got {capacity!r}")
    if policy not in POLICIES:
        raise InvalidOperation(f"unknown eviction policy {policy!r}; choose from {POLICIES}")
    return Pool(
        capacity=capacity,
        policy=policy,
        refcounts=(0,) * capacity,
        lru=tuple(range(capacity)),
        block_hashes=(None,) * capacity,
        uses=(0,) * capacity,
    )


def eviction_order(pool: Pool) -> tuple[int, ...]:
    """The free blocks, the one to hand out first at the head."""
    if pool.policy == "lru":
        return pool.lru
    return tuple(sorted(pool.lru, key=lambda block: pool.uses[block]))  # stable: LRU ties


def abstract(pool: Pool) -> PoolState:
    """The abstraction of the model, comparable with an implementation's snapshot."""
    cached = {h: b for b, h in enumerate(pool.block_hashes) if h is not None}
    return PoolState(
        capacity=pool.capacity,
        refcounts=pool.refcounts,
        free_queue=eviction_order(pool),
        block_hashes=pool.block_hashes,
        cached=cached,
    )


def _check_blocks(pool: Pool, blocks: Iterable[int]) -> None:
    for block in blocks:
        if not isinstance(block, int) or isinstance(block, bool) or not 0 <= block < pool.capacity:
            raise InvalidOperation(f"block {block!r} is not a block of this pool (0..{pool.capacity - 1})")


def allocate(pool: Pool, n: int) -> tuple[Pool, tuple[int, ...]]:
    """Hand out ``n`` free blocks from the head of the eviction order, all or none."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidOperation(f"cannot allocate {n!r} blocks")
    if n > len(pool.lru):
        raise OutOfBlocks(n, len(pool.lru))
    taken = eviction_order(pool)[:n]
    chosen = set(taken)
    refcounts, hashes, uses = list(pool.refcounts), list(pool.block_hashes), list(pool.uses)
    for block in taken:
        refcounts[block], hashes[block], uses[block] = 1, None, 1
    pool = attrs.evolve(
        pool,
        refcounts=tuple(refcounts),
        lru=tuple(b for b in pool.lru if b not in chosen),
        block_hashes=tuple(hashes),
        uses=tuple(uses),
    )
    return pool, taken


def share(pool: Pool, blocks: Sequence[int]) -> Pool:
    """One more reference to each block; a free block must be cached (a hit)."""
    _check_blocks(pool, blocks)
    for block in blocks:
        if pool.refcounts[block] == 0 and pool.block_hashes[block] is None:
            raise InvalidOperation(f"block {block} is free and uncached: its contents are gone")
    refcounts, uses = list(pool.refcounts), list(pool.uses)
    for block in blocks:
        refcounts[block] += 1
        uses[block] += 1
    revived = {b for b in blocks if pool.refcounts[b] == 0}
    return attrs.evolve(
        pool,
        refcounts=tuple(refcounts),
        lru=tuple(b for b in pool.lru if b not in revived),
        uses=tuple(uses),
    )


def release(pool: Pool, blocks: Sequence[int]) -> Pool:
    """One reference fewer on each block; blocks reaching zero join the queue's tail."""
    _check_blocks(pool, blocks)
    for block, times in Counter(blocks).items():
        if pool.refcounts[block] < times:
            raise InvalidOperation(
                f"block {block} released {times} time(s) but holds {pool.refcounts[block]} reference(s)"
            )
    refcounts, freed = list(pool.refcounts), []
    for block in blocks:
        refcounts[block] -= 1
        if refcounts[block] == 0:
            freed.append(block)
    return attrs.evolve(pool, refcounts=tuple(refcounts), lru=pool.lru + tuple(freed))


def register(pool: Pool, block: int, block_hash: Hashable) -> tuple[Pool, bool]:
    """Cache an in-use, unhashed block under ``block_hash`` unless the hash is taken."""
    _check_blocks(pool, [block])
    if block_hash is None:
        raise InvalidOperation("None is not a block hash")
    if pool.refcounts[block] == 0:
        raise InvalidOperation(f"block {block} is free: only a block in use can be registered")
    if pool.block_hashes[block] is not None:
        raise InvalidOperation(f"block {block} is already registered")
    if block_hash in pool.block_hashes:
        return pool, False
    hashes = list(pool.block_hashes)
    hashes[block] = block_hash
    return attrs.evolve(pool, block_hashes=tuple(hashes)), True


def lookup(pool: Pool, block_hash: Hashable) -> int | None:
    """The block cached under ``block_hash``, in use or free, if any."""
    for block, h in enumerate(pool.block_hashes):
        if h is not None and h == block_hash:
            return block
    return None


def evict(pool: Pool, n: int) -> tuple[Pool, tuple[int, ...]]:
    """Forget the hashes of up to ``n`` free cached blocks, in eviction order."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidOperation(f"cannot evict {n!r} blocks")
    victims = tuple(b for b in eviction_order(pool) if pool.block_hashes[b] is not None)[:n]
    hashes = list(pool.block_hashes)
    for block in victims:
        hashes[block] = None
    return attrs.evolve(pool, block_hashes=tuple(hashes)), victims


# -- invariants over snapshots ---------------------------------------------------


@invariant("a block missing from the queue is lost for good; one queued twice or while in use is handed out twice")
def invariant_free_queue_exact(state: PoolState) -> str | None:
    counts = Counter(state.free_queue)
    twice = sorted(b for b, c in counts.items() if c > 1)
    if twice:
        return f"blocks {twice} are queued more than once"
    zero = {b for b, r in enumerate(state.refcounts) if r == 0}
    if set(counts) != zero:
        in_use = sorted(set(counts) - zero)
        missing = sorted(zero - set(counts))
        return f"queued but in use: {in_use}; free but not queued: {missing}"
    return None


@invariant("blocks are neither created nor destroyed: used + free must always equal capacity")
def invariant_capacity_conserved(state: PoolState) -> str | None:
    used = sum(1 for r in state.refcounts if r > 0)
    if len(state.refcounts) != state.capacity or any(r < 0 for r in state.refcounts):
        return f"{len(state.refcounts)} reference counts for capacity {state.capacity}, some negative"
    if used + len(state.free_queue) != state.capacity:
        return f"used {used} + free {len(state.free_queue)} != capacity {state.capacity}"
    if any(not 0 <= b < state.capacity for b in state.free_queue):
        return f"free queue names blocks outside the pool: {state.free_queue}"
    return None


@invariant("a block in use that nobody holds can never be freed: memory leaks until restart")
def invariant_no_leak(state: PoolState, holders: Mapping[int, int]) -> str | None:
    leaked = sorted(b for b, r in enumerate(state.refcounts) if r > 0 and holders.get(b, 0) == 0)
    if leaked:
        return f"blocks {leaked} are in use but no one holds them"
    return None


@invariant("a count above the references leaks the block; one below frees memory still being read")
def invariant_refcount_matches_holders(state: PoolState, holders: Mapping[int, int]) -> str | None:
    wrong = {b: (r, holders.get(b, 0)) for b, r in enumerate(state.refcounts) if r != holders.get(b, 0)}
    if wrong:
        shown = ", ".join(f"block {b}: count {r}, held {h}" for b, (r, h) in sorted(wrong.items()))
        return shown
    return None


@invariant("a lookup must return only a block that really holds the hashed contents, and one block per hash")
def invariant_hash_map_consistent(state: PoolState) -> str | None:
    for block_hash, block in state.cached.items():
        if not 0 <= block < state.capacity or state.block_hashes[block] != block_hash:
            return f"hash map names block {block} for a hash the block does not carry"
    if len(set(state.cached.values())) != len(state.cached):
        return "the hash map names one block under two hashes"
    carried = {b for b, h in enumerate(state.block_hashes) if h is not None}
    if carried != set(state.cached.values()):
        return f"blocks {sorted(carried - set(state.cached.values()))} carry a hash the map does not list"
    return None


@invariant("a block someone is reading must never be handed to another sequence nor lose its cached contents")
def invariant_in_use_never_reclaimed(before: PoolState, after: PoolState, reclaimed: Sequence[int]) -> str | None:
    busy = sorted({b for b in reclaimed if before.refcounts[b] > 0})
    if busy:
        return f"blocks {busy} were in use yet handed out or evicted"
    if len(set(reclaimed)) != len(reclaimed):
        return f"the same block was handed out twice in {list(reclaimed)}"
    lost = [
        b
        for b, r in enumerate(before.refcounts)
        if r > 0 and before.block_hashes[b] is not None and after.block_hashes[b] != before.block_hashes[b]
    ]
    if lost:
        return f"in-use blocks {lost} lost their cached hash"
    return None


@invariant("the policy decides what is reused and what is lost; another order silently changes hit rates")
def invariant_eviction_order(expected: Sequence[int], actual: Sequence[int]) -> str | None:
    if tuple(expected) != tuple(actual):
        return f"policy order takes {tuple(expected)}, implementation took {tuple(actual)}"
    return None


@invariant("the implementation must be in exactly the state the specification model predicts")
def invariant_pool_refines_spec(actual: PoolState, expected: PoolState) -> str | None:
    if actual != expected:
        return diff_states(actual, expected)
    return None
