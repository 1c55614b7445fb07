"""Layer 1 conformance: the block pool against ``kvspec.spec.block_pool``'s model.

The machine holds references the way a block manager would (a multiset of
blocks it has allocated or shared) and drives allocate / share / release /
register / lookup / evict, valid and invalid, on tiny pools where exhaustion
and eviction are common and on a realistic one.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.properties.harness import LockstepMachine, conformance_test
from kvspec.spec import block_pool as model
from kvspec.spec.block_pool import POLICIES

HASHES = st.sampled_from([f"h{i}" for i in range(6)])


class BlockPoolMachine(LockstepMachine):
    capacities = st.integers(1, 8)

    @initialize(data=st.data(), policy=st.sampled_from(POLICIES))
    def start(self, data: st.DataObject, policy: str) -> None:
        capacity = data.draw(self.capacities, label="capacity")
        self.record(f"pool = block_pool(capacity={capacity}, policy={policy!r})")
        self.model = model.new_pool(capacity, policy)
        self.pool = self.implementation.block_pool(capacity, policy)
        self.held: Counter[int] = Counter()

    def some_block(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, self.model.capacity - 1), label="block")

    @rule(n=st.one_of(st.integers(1, 2), st.integers(1, 2), st.integers(-1, 9)))
    def allocate(self, n: int) -> None:
        self._allocate(n)

    def _allocate(self, n: int) -> list[int]:
        before = self.pool.snapshot()
        result = self.lockstep(
            f"allocate(n={n})", lambda: model.allocate(self.model, n), lambda: self.pool.allocate(n), self.pool.snapshot
        )
        if result is None:
            return []
        (self.model, expected), actual = result
        self.check("invariant_in_use_never_reclaimed", before, self.pool.snapshot(), actual)
        self.check("invariant_eviction_order", expected, actual)
        self.held.update(actual)
        event("allocation exhausted the pool" if not self.model.lru else "allocation left free blocks")
        return list(actual)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share_held(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=3), label="blocks")
        self._share(blocks)

    @rule(data=st.data())
    def share_any(self, data: st.DataObject) -> None:
        self._share([self.some_block(data)])

    def _share(self, blocks: list[int]) -> None:
        result = self.lockstep(
            f"share({blocks})",
            lambda: model.share(self.model, blocks),
            lambda: self.pool.share(blocks),
            self.pool.snapshot,
        )
        if result is not None:
            self.model = result[0]
            self.held.update(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_held(self, data: st.DataObject) -> None:
        blocks = data.draw(st.permutations(sorted(self.held.elements())), label="order")
        blocks = blocks[: data.draw(st.integers(1, len(blocks)), label="count")]
        self._release(blocks)

    @rule(data=st.data())
    def release_any(self, data: st.DataObject) -> None:
        self._release([self.some_block(data)])

    def _release(self, blocks: list[int]) -> None:
        result = self.lockstep(
            f"release({blocks})",
            lambda: model.release(self.model, blocks),
            lambda: self.pool.release(blocks),
            self.pool.snapshot,
        )
        if result is not None:
            self.model = result[0]
            self.held.subtract(blocks)
            self.held = +self.held

    def unregistered_held(self) -> list[int]:
        return sorted(b for b in self.held if self.model.block_hashes[b] is None)

    @precondition(lambda self: self.unregistered_held())
    @rule(data=st.data(), block_hash=HASHES)
    def register(self, data: st.DataObject, block_hash: str) -> None:
        """Cache a full block the way a block manager does once it fills."""
        self._register(data.draw(st.sampled_from(self.unregistered_held()), label="block"), block_hash)

    @rule(block_hash=HASHES)
    def fill_and_cache(self, block_hash: str) -> None:
        """What a manager does for each prompt block: allocate it, fill it, register it."""
        for block in self._allocate(1):
            self._register(block, block_hash)

    @rule(data=st.data(), block_hash=HASHES)
    def register_any(self, data: st.DataObject, block_hash: str) -> None:
        self._register(self.some_block(data), block_hash)

    def _register(self, block: int, block_hash: str) -> None:
        result = self.lockstep(
            f"register(block={block}, hash={block_hash!r})",
            lambda: model.register(self.model, block, block_hash),
            lambda: self.pool.register(block, block_hash),
            self.pool.snapshot,
        )
        if result is not None:
            (self.model, expected), actual = result
            self.check("invariant_result_matches_spec", expected, actual)

    @rule(block_hash=HASHES)
    def lookup(self, block_hash: str) -> None:
        result = self.lockstep(
            f"lookup({block_hash!r})",
            lambda: model.lookup(self.model, block_hash),
            lambda: self.pool.lookup(block_hash),
            self.pool.snapshot,
        )
        if result is not None:
            expected, actual = result
            self.check("invariant_result_matches_spec", expected, actual)
            event("lookup hit" if expected is not None else "lookup miss")

    @rule(block_hash=HASHES)
    def hit(self, block_hash: str) -> None:
        """A prefix-cache hit: share the block cached under the hash, in use or free."""
        block = model.lookup(self.model, block_hash)
        if block is not None:
            event("hit on a free cached block" if self.model.refcounts[block] == 0 else "hit on a block in use")
            self._share([block])

    @rule(n=st.one_of(st.integers(1, 2), st.integers(-1, 3)))
    def evict(self, n: int) -> None:
        before = self.pool.snapshot()
        result = self.lockstep(
            f"evict(n={n})", lambda: model.evict(self.model, n), lambda: self.pool.evict(n), self.pool.snapshot
        )
        if result is not None:
            (self.model, expected), actual = result
            self.check("invariant_in_use_never_reclaimed", before, self.pool.snapshot(), actual)
            self.check("invariant_eviction_order", expected, actual)

    @precondition(lambda self: self.held)
    @rule()
    def release_everything(self) -> None:
        blocks = sorted(self.held.elements())
        result = self.lockstep(
            f"release({blocks})  # everything",
            lambda: model.release(self.model, blocks),
            lambda: self.pool.release(blocks),
            self.pool.snapshot,
        )
        if result is not None:
            self.model = result[0]
            self.held.clear()

    @invariant()
    def pool_matches_spec(self) -> None:
        if not hasattr(self, "pool"):
            return
        state = self.pool.snapshot()
        self.check("invariant_free_queue_exact", state)
        self.check("invariant_capacity_conserved", state)
        self.check("invariant_no_leak", state, self.held)
        self.check("invariant_refcount_matches_holders", state, self.held)
        self.check("invariant_hash_map_consistent", state)
        self.check("invariant_pool_refines_spec", state, model.abstract(self.model))


class RealisticBlockPoolMachine(BlockPoolMachine):
    """The same rules on a pool of realistic size, where scale bugs live."""

    capacities = st.just(1024)


TestBlockPool = conformance_test(BlockPoolMachine)
TestRealisticBlockPool = conformance_test(RealisticBlockPoolMachine, examples=0.2)
