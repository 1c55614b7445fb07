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
  is forgotten.  Short of blocks -- the free queue, its cached blocks counted
  (they are evictable), holds fewer than ``n`` -- it raises ``OutOfBlocks``
  and changes nothing; never otherwise.
* ``share(blocks)`` adds one reference to each block.  A free block may be
  shared only if it is cached (a prefix-cache hit, vLLM's ``touch``): it
  leaves the free queue and is in use again.
* ``release(blocks)`` drops one reference from each block, in the order
  given; a block whose count reaches zero enters the free queue.  Managers
  release a sequence's table last block first, so that a sequence's last
  blocks -- the least likely to be shared by a later prompt -- are evicted first.
* Ownership: the caller keeps the lists of blocks it passes and may overwrite
  them at once; a list the pool answers (``allocate``, ``evict``) is the caller's.
* ``register(block, hash)`` caches an in-use full block under a hash.
  ``lookup(hash)`` names the cached block, in use or free (of several, the
  one registered first).  ``evict(n)`` forgets the hashes of up to ``n`` free
  cached blocks, in eviction order.

The pool's optional batch operations -- a request's worth of hash-map calls
at once -- are ``kvspec.spec.batch_pool``'s.

Conventions (``spec.conventions.PoolConventions``; the reference's first):

* ``unhashed_free_position`` -- a block reaching count zero enters the queue's
  tail; under ``head`` one that carries no hash enters the head instead
  (those of one ``release`` in the order released, ahead of every block
  already queued), so cached blocks are kept longer.
* ``duplicate_hash`` -- under ``refuse`` a hash already cached leaves the new
  block uncached (``register`` answers False); under ``keep`` both blocks
  carry it (``register`` answers True) and the map lists both.
* ``policies`` -- the eviction policies the engine offers.

Eviction order is the policy's: ``lru`` is the queue's own order (released
earliest, evicted first); ``lfu`` evicts the fewest-used block first and
breaks ties in LRU order, where a block's *uses* count the allocations and
shares of its current contents.

Theory of operation: ``Pool`` below is the spec's model.  Transitions are pure
functions that return a new ``Pool``; an implementation's ``snapshot()``
returns a ``PoolState``, the abstraction both are compared through, and the
invariants are predicates over ``PoolState``.

Safety is judged on the pool's own snapshots and answers and on the caller's
*ledger*, kept from the calls the pool carried out: the references it holds
(``holders``: what it allocated and shared, less what it released) and what
it wrote into each block (``written``: the hash of the contents it registered
there, None once the block is handed out again to hold a request's own tokens).

Invariants (tier in brackets; ``STATE`` groups those over a snapshot and
its holders, which every machine with a pool checks):

* ``invariant_free_queue_exact`` [safety] -- the free queue holds exactly the
  blocks of reference count zero, once each.
* ``invariant_capacity_conserved`` [safety] -- used + free = capacity.
* ``invariant_no_leak`` [safety] -- every block in use has a holder.
* ``invariant_refcount_matches_holders`` [safety] -- each count equals its references.
* ``invariant_hash_map_consistent`` [safety] -- the hash map names exactly the
  blocks that carry each hash, each once.
* ``invariant_no_stale_hit`` [safety] -- a hash names only blocks that hold what
  was registered under it (the pool's map, and what a lookup answers).
* ``invariant_counts_match_snapshot`` [safety] -- ``num_free()`` and
  ``refcount()`` tell what ``snapshot()`` shows.
* ``invariant_in_use_never_reclaimed`` [safety] -- allocation and eviction
  touch only free blocks, each once.
* ``invariant_allocation_refused_only_when_short`` [safety] -- ``allocate(n)``
  is refused only when the free queue, cached blocks included, holds fewer than ``n``.
* ``invariant_eviction_order`` [convention] -- allocation and eviction follow the policy.
* ``invariant_pool_refines_spec`` [convention] -- the implementation's state is the model's.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec.components import component_kind
from kvspec.spec.conventions import POLICIES as POLICIES
from kvspec.spec.conventions import REFERENCE, PoolConventions
from kvspec.spec.conventions import Policy as Policy
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.invariants import Group, invariant, refinement


@attrs.frozen
class PoolState:
    """The abstract state of a block pool: what ``snapshot()`` returns."""

    capacity: int
    refcounts: tuple[int, ...]
    free_queue: tuple[int, ...]  # in eviction order: the head is handed out first
    block_hashes: tuple[Hashable | None, ...]
    cached: Mapping[Hashable, tuple[int, ...]]  # hash -> the blocks carrying it, first registered first

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


BLOCK_POOL = component_kind("block_pool", BlockPool, builds="block_pool(capacity, policy)")


@attrs.frozen
class Pool:
    """The spec's model of a pool.  ``lru`` keeps free blocks in queue order."""

    capacity: int
    policy: Policy
    refcounts: tuple[int, ...]
    lru: tuple[int, ...]
    block_hashes: tuple[Hashable | None, ...]
    cached: Mapping[Hashable, tuple[int, ...]]
    uses: tuple[int, ...]
    conventions: PoolConventions = REFERENCE.pool


def new_pool(capacity: int, policy: Policy = "lru", conventions: PoolConventions = REFERENCE.pool) -> Pool:
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
        cached={},
        uses=(0,) * capacity,
        conventions=conventions,
    )


def eviction_order(pool: Pool) -> tuple[int, ...]:
    """The free blocks, the one to hand out first at the head."""
    if pool.policy == "lru":
        return pool.lru
    return tuple(sorted(pool.lru, key=pool.uses.__getitem__))  # stable: LRU ties


def abstract(pool: Pool) -> PoolState:
    """The abstraction of the model, comparable with an implementation's snapshot."""
    return PoolState(
        capacity=pool.capacity,
        refcounts=pool.refcounts,
        free_queue=eviction_order(pool),
        block_hashes=pool.block_hashes,
        cached=dict(pool.cached),
    )


def _check_blocks(pool: Pool, blocks: Iterable[int]) -> None:
    for block in blocks:
        if not isinstance(block, int) or isinstance(block, bool) or not 0 <= block < pool.capacity:
            raise InvalidOperation(f"block {block!r} is not a block of this pool (0..{pool.capacity - 1})")


def _forget(pool: Pool, blocks: Iterable[int]) -> Pool:
    """The pool with the hashes of ``blocks`` forgotten."""
    hashes, cached = list(pool.block_hashes), dict(pool.cached)
    for block in blocks:
        block_hash = hashes[block]
        if block_hash is not None:
            hashes[block] = None
            cached[block_hash] = tuple(b for b in cached[block_hash] if b != block)
            if not cached[block_hash]:
                del cached[block_hash]
    return attrs.evolve(pool, block_hashes=tuple(hashes), cached=cached)


def allocate(pool: Pool, n: int) -> tuple[Pool, tuple[int, ...]]:
    """Hand out ``n`` free blocks from the head of the eviction order, all or none."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidOperation(f"cannot allocate {n!r} blocks")
    if n > len(pool.lru):
        raise OutOfBlocks(n, len(pool.lru))
    taken = eviction_order(pool)[:n]
    chosen = set(taken)
    pool = _forget(pool, taken)
    refcounts, uses = list(pool.refcounts), list(pool.uses)
    for block in taken:
        refcounts[block], uses[block] = 1, 1
    pool = attrs.evolve(
        pool,
        refcounts=tuple(refcounts),
        lru=tuple(b for b in pool.lru if b not in chosen),
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
    """One reference fewer on each block; blocks reaching zero join the queue where the conventions say."""
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
    to_head: tuple[int, ...] = ()
    if pool.conventions.unhashed_free_position == "head":
        to_head = tuple(b for b in freed if pool.block_hashes[b] is None)
    to_tail = tuple(b for b in freed if b not in to_head)
    return attrs.evolve(pool, refcounts=tuple(refcounts), lru=to_head + pool.lru + to_tail)


def register(pool: Pool, block: int, block_hash: Hashable) -> tuple[Pool, bool]:
    """Cache an in-use, unhashed block under ``block_hash``; a hash already cached per the conventions."""
    _check_blocks(pool, [block])
    if block_hash is None:
        raise InvalidOperation("None is not a block hash")
    if pool.refcounts[block] == 0:
        raise InvalidOperation(f"block {block} is free: only a block in use can be registered")
    if pool.block_hashes[block] is not None:
        raise InvalidOperation(f"block {block} is already registered")
    if block_hash in pool.cached and pool.conventions.duplicate_hash == "refuse":
        return pool, False
    hashes = list(pool.block_hashes)
    hashes[block] = block_hash
    cached = {**pool.cached, block_hash: pool.cached.get(block_hash, ()) + (block,)}
    return attrs.evolve(pool, block_hashes=tuple(hashes), cached=cached), True


def lookup(pool: Pool, block_hash: Hashable) -> int | None:
    """The block cached under ``block_hash``, in use or free, if any; of several, the first registered."""
    blocks = pool.cached.get(block_hash, ())
    return blocks[0] if blocks else None


def evict(pool: Pool, n: int) -> tuple[Pool, tuple[int, ...]]:
    """Forget the hashes of up to ``n`` free cached blocks, in eviction order."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidOperation(f"cannot evict {n!r} blocks")
    victims = tuple(b for b in eviction_order(pool) if pool.block_hashes[b] is not None)[:n]
    return _forget(pool, victims), victims


# -- invariants over snapshots ---------------------------------------------------


def blocks_where(flags: Iterable[object]) -> Iterator[int]:
    """The blocks whose flag (one a block, in block order) is true: a scan in C, as every step scans the pool."""
    return itertools.compress(itertools.count(), flags)


def in_use(refcounts: Sequence[int]) -> Iterator[int]:
    """The blocks of positive count."""
    return blocks_where(map(operator.gt, refcounts, itertools.repeat(0)))


@invariant(
    "a block missing from the queue is lost for good; one queued twice or while in use is handed out twice", "safety"
)
def invariant_free_queue_exact(state: PoolState) -> str | None:
    queued = set(state.free_queue)
    if len(queued) != len(state.free_queue):
        twice = sorted(b for b, c in Counter(state.free_queue).items() if c > 1)
        return f"blocks {twice} are queued more than once"
    zero = set(blocks_where(map(operator.not_, state.refcounts)))
    if queued != zero:
        return f"queued but in use: {sorted(queued - zero)}; free but not queued: {sorted(zero - queued)}"
    return None


@invariant("blocks are neither created nor destroyed: used + free must always equal capacity", "safety")
def invariant_capacity_conserved(state: PoolState) -> str | None:
    refcounts, queue = state.refcounts, state.free_queue
    if len(refcounts) != state.capacity or (refcounts and min(refcounts) < 0):
        return f"{len(refcounts)} reference counts for capacity {state.capacity}: {refcounts}"
    used = sum(map(bool, refcounts))
    if used + len(queue) != state.capacity:
        return f"used {used} + free {len(queue)} != capacity {state.capacity}"
    if queue and not (0 <= min(queue) and max(queue) < state.capacity):
        return f"free queue names blocks outside the pool: {queue}"
    return None


@invariant("a block in use that nobody holds can never be freed: memory leaks until restart", "safety")
def invariant_no_leak(state: PoolState, holders: Mapping[int, int]) -> str | None:
    leaked = [b for b in in_use(state.refcounts) if holders.get(b, 0) == 0]
    if leaked:
        return f"blocks {leaked} are in use but no one holds them"
    return None


@invariant("a count above the references leaks the block; one below frees memory still being read", "safety")
def invariant_refcount_matches_holders(state: PoolState, holders: Mapping[int, int]) -> str | None:
    outside = sorted(b for b in holders if not 0 <= b < len(state.refcounts))
    if outside:
        return f"blocks {outside} are held but are not blocks of this pool"
    held = [0] * len(state.refcounts)
    for block, references in holders.items():
        held[block] = references
    wrong = list(blocks_where(map(operator.ne, state.refcounts, held)))
    if wrong:
        return ", ".join(f"block {b}: count {state.refcounts[b]}, held {held[b]}" for b in wrong)
    return None


@invariant(
    "a lookup must return only a block that really holds the hashed contents, and know every such block", "safety"
)
def invariant_hash_map_consistent(state: PoolState) -> str | None:
    listed = [block for blocks in state.cached.values() for block in blocks]
    for block_hash, blocks in state.cached.items():
        if not blocks:
            return f"hash map lists {block_hash!r} with no block"
        for block in blocks:
            if not 0 <= block < state.capacity or state.block_hashes[block] != block_hash:
                return f"hash map names block {block} for a hash the block does not carry"
    if len(set(listed)) != len(listed):
        return f"the hash map names one block twice: {dict(state.cached)}"
    carried = set(blocks_where(map(operator.is_not, state.block_hashes, itertools.repeat(None))))
    if carried != set(listed):
        return f"blocks {sorted(carried - set(listed))} carry a hash the map does not list"
    return None


@invariant(
    "a hash must name only blocks that still hold what was cached under it: a block handed out again while its hash "
    "names it makes the next hit read another request's data",
    "safety",
)
def invariant_no_stale_hit(
    named: Mapping[Hashable, Sequence[int]], written: Mapping[int, Hashable | None]
) -> str | None:
    """``named``: the blocks the pool names under each hash (its snapshot's map, or what a lookup answered);
    ``written``: the caller's ledger of each block's contents (a block missing from it is one the caller cannot
    vouch for: an out-of-contract registration of it was carried out)."""
    for block_hash, blocks in named.items():
        for block in blocks:
            if block in written and written[block] != block_hash:
                held = "a request's own tokens" if written[block] is None else f"the contents of {written[block]!r}"
                return (
                    f"hash {block_hash!r} names block {block}, which holds {held}: a hit reads another request's data"
                )
    return None


@invariant(
    "a scheduler admits by num_free() and a manager copies by refcount(): they must tell what the pool holds", "safety"
)
def invariant_counts_match_snapshot(state: PoolState, num_free: int, refcounts: Sequence[int]) -> str | None:
    """``num_free`` and ``refcounts`` are what ``num_free()`` and ``refcount(b)`` for every block answered."""
    if num_free != state.num_free:
        return f"num_free() answers {num_free}, the snapshot queues {state.num_free} free blocks"
    if len(refcounts) != len(state.refcounts):
        raise ValueError(f"{len(refcounts)} answers of refcount() for {len(state.refcounts)} blocks")
    wrong = next(blocks_where(map(operator.ne, refcounts, state.refcounts)), None)
    if wrong is not None:
        return f"refcount({wrong}) answers {refcounts[wrong]}, the snapshot counts {state.refcounts[wrong]}"
    return None


@invariant("a block someone is reading must never be handed to another sequence nor lose its cached contents", "safety")
def invariant_in_use_never_reclaimed(before: PoolState, after: PoolState, reclaimed: Sequence[int]) -> str | None:
    busy = sorted({b for b in reclaimed if before.refcounts[b] > 0})
    if busy:
        return f"blocks {busy} were in use yet handed out or evicted"
    if len(set(reclaimed)) != len(reclaimed):
        return f"the same block was handed out twice in {list(reclaimed)}"
    hashes = before.block_hashes
    lost = [b for b in in_use(before.refcounts) if hashes[b] is not None and after.block_hashes[b] != hashes[b]]
    if lost:
        return f"in-use blocks {lost} lost their cached hash"
    return None


@invariant(
    "a false out-of-memory makes the scheduler wait for, or preempt a request to free, blocks the pool already has",
    "safety",
)
def invariant_allocation_refused_only_when_short(before: PoolState, n: int) -> str | None:
    """``allocate(n)`` was refused; ``before`` is the pool's own snapshot before the call."""
    if n <= before.num_free:
        cached = sum(1 for block in before.free_queue if before.block_hashes[block] is not None)
        return f"allocate({n}) refused while the free queue held {before.num_free} blocks, {cached} of them cached"
    return None


@invariant("the policy decides what is reused and what is lost; another order silently changes hit rates", "convention")
def invariant_eviction_order(expected: Sequence[int], actual: Sequence[int]) -> str | None:
    if tuple(expected) != tuple(actual):
        return f"policy order takes {tuple(expected)}, implementation took {tuple(actual)}"
    return None


invariant_pool_refines_spec = refinement("invariant_pool_refines_spec")


STATE = Group(
    (
        invariant_free_queue_exact,
        invariant_capacity_conserved,
        invariant_hash_map_consistent,
        invariant_no_leak,
        invariant_refcount_matches_holders,
    )
)
"""Every safety rule over a pool's snapshot, called as ``(state, holders)``."""
