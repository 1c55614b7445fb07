"""Layer 1 conformance: the block pool against ``kvspec.spec.block_pool``'s model.

The machine holds references the way a block manager would (a multiset of
blocks it has allocated or shared) and drives allocate / share / release /
register / lookup / evict, valid and invalid, on tiny pools where exhaustion
and eviction are common and on a realistic one.  Its ledger -- the references
it holds, and what it wrote into each block (the hash it registered there, or
a request's own tokens since the block was handed out) -- follows what the pool
carried out; the safety rules read it and the pool's own state and answers.
The model follows the pool's declared conventions, and only its declared
policies are drawn.
The search revisits: an allocation refused for want of blocks is retried
after a release, and a hash whose block was evicted is cached again.  Once
an example it allocates at the brim, with cached blocks free (``at_the_brim``),
and every refusal is checked against the pool's own state before the call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.spec import batch_pool
from kvspec.spec import block_pool as model

HASHES = st.sampled_from([f"h{i}" for i in range(6)])


class BlockPoolMachine(LockstepMachine):
    uses = frozenset({"block_pool"})
    judges = ("block_pool", "invariants")
    capacities = st.integers(1, 8)

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        capacity = data.draw(self.capacities, label="capacity")
        policy = data.draw(st.sampled_from(self.conventions.pool.policies), label="policy")
        self.record(f"pool = block_pool(capacity={capacity}, policy={policy!r})")
        spec = model.new_pool(capacity, policy, self.conventions.pool)
        refinement = (model.invariant_pool_refines_spec, model.abstract)
        self.pool = self.subject(
            "pool", (model, batch_pool), spec, self.implementation.block_pool(capacity, policy), refinement=refinement
        )
        self.held: Counter[int] = Counter()
        # What the caller wrote into each block: the hash it registered there, None for a request's own tokens
        self.written: dict[int, Hashable | None] = dict.fromkeys(range(capacity))
        self.refused = 0  # the blocks of the last allocation refused (0: none pending)
        self.ever_cached: set[str] = set()
        self.probed_the_brim = False

    def some_block(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, self.pool.model.capacity - 1), label="block")

    @rule(n=st.one_of(st.integers(1, 2), st.integers(1, 2), st.integers(-1, 9)), data=st.data())
    def allocate(self, n: int, data: st.DataObject) -> None:
        self.revisit(data)
        self._allocate(n)

    def revisit(self, data: st.DataObject) -> None:
        """Drawn inside the common rules, so that swarm testing never turns it off: as often as not,
        allocations at the brim (until an example has had them), the allocation refused last again, as it
        was, and an evicted hash cached again."""
        self.maybe_at_the_brim(data)
        if self.refused and data.draw(st.booleans(), label="retry the refused allocation"):
            event("revisit: retried a rejected call")
            self._allocate(self.refused)
        evicted = sorted(self.ever_cached - set(self.pool.model.cached))
        if bool(evicted) and data.draw(st.booleans(), label="cache an evicted hash again"):
            self.fill_and_cache(data.draw(st.sampled_from(evicted), label="evicted hash"))

    def cached_free(self) -> int:
        """The free blocks that carry a hash: evictable, yet counted free."""
        return sum(1 for block in self.pool.model.lru if self.pool.model.block_hashes[block] is not None)

    def finishing(self) -> list[int]:
        """The cached blocks held once: a request that finishes leaves them free and cached."""
        return sorted(b for b, count in self.held.items() if count == 1 and self.pool.model.block_hashes[b] is not None)

    def maybe_at_the_brim(self, data: st.DataObject) -> None:
        """As often as not (a draw the shrinker turns off), until an example has had them."""
        if not self.probed_the_brim and data.draw(st.booleans(), label="allocate at the brim"):
            self.at_the_brim(data)

    def at_the_brim(self, data: st.DataObject) -> None:
        """With cached blocks free (a request finishes first if none is), one block more than the queue holds,
        which must be refused, then one more than its uncached blocks, which must not (where a pool that
        forgets its evictable blocks refuses falsely): a short request of two samples that share its blocks
        and finish one after the other.  A probe evicts a cached block: one an example leaves the cache to the
        other rules."""
        if not self.cached_free() and not self.finishing():
            self.fill_and_cache(data.draw(HASHES, label="prompt block"))
        if not self.cached_free() and self.finishing():
            self._release([data.draw(st.sampled_from(self.finishing()), label="finished block")], note="finished")
        if not self.cached_free():
            return
        self.probed_the_brim = True
        self._allocate(len(self.pool.model.lru) + 1, waits=False)
        granted = self._allocate(len(self.pool.model.lru) - self.cached_free() + 1)
        if granted and self.pool("share", granted) is not None:  # a second sample shares them
            self.held.update(granted)
            self._release(granted[::-1], note="one sample finishes")
            self._release(granted[::-1], note="the other")

    def _allocate(self, n: int, waits: bool = True) -> list[int]:
        """Allocate; a caller refused for want of blocks ``waits`` to try again (see ``revisit``)."""
        before = self.pool.snapshot()
        answer = self.pool("allocate", n, judged_by=model.invariant_eviction_order)
        if answer is None:
            self.refused = n if waits and isinstance(n, int) and n > len(self.pool.model.lru) else self.refused
            if isinstance(n, int) and n > 0 and self.pool.snapshot() == before:  # in contract, and it refused
                self.check(model.invariant_allocation_refused_only_when_short, before, n)
                if any(before.block_hashes[block] is not None for block in before.free_queue):
                    event("allocation refused with cached blocks free")
            return []
        self.refused = 0 if n == self.refused else self.refused
        self.check(model.invariant_in_use_never_reclaimed, before, self.pool.snapshot(), answer.actual)
        if any(before.block_hashes[block] is not None for block in answer.actual):
            event("allocation evicted cached free blocks")
        self.held.update(answer.actual)
        self.written.update(dict.fromkeys(answer.actual))  # each new holder writes its own tokens
        event("allocation exhausted the pool" if not self.pool.model.lru else "allocation left free blocks")
        return list(answer.actual)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share_held(self, data: st.DataObject) -> None:
        self._share(data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=3), label="blocks"))

    @rule(data=st.data())
    def share_any(self, data: st.DataObject) -> None:
        self.revisit(data)
        self._share([self.some_block(data)])

    def _share(self, blocks: list[int]) -> None:
        if self.pool("share", blocks) is not None:
            self.held.update(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_held(self, data: st.DataObject) -> None:
        self.maybe_at_the_brim(data)
        blocks = data.draw(st.permutations(sorted(self.held.elements())), label="order")
        if blocks:
            self._release(blocks[: data.draw(st.integers(1, len(blocks)), label="count")])

    @rule(data=st.data())
    def release_any(self, data: st.DataObject) -> None:
        self.maybe_at_the_brim(data)
        self._release([self.some_block(data)])

    @precondition(lambda self: self.held)
    @rule()
    def release_everything(self) -> None:
        self._release(sorted(self.held.elements()), note="everything")

    def _release(self, blocks: list[int], note: str = "") -> None:
        """Release; then retry the allocation refused for want of blocks, as a waiting caller does."""
        if self.pool("release", blocks, note=note) is not None:
            self.held.subtract(blocks)
            self.held = +self.held
            if self.refused:
                event("revisit: retried a rejected call")
                self._allocate(self.refused)

    def unregistered_held(self) -> list[int]:
        return sorted(b for b in self.held if self.pool.model.block_hashes[b] is None)

    def _register(self, blocks: list[int], block_hashes: list[str], operation: str = "register_blocks") -> bool:
        """Register ``blocks`` under ``block_hashes`` (one pair: ``register``); whether the pool carried it out.
        A block the caller holds, filled with its own tokens, now holds the hash's contents; any other registration
        carried out (a block not held or already registered, hashes not one per block) leaves the caller unable to
        vouch for the block."""
        arguments = (blocks[0], block_hashes[0]) if operation == "register" else (blocks, block_hashes)
        if self.pool(operation, *arguments) is None:
            return False
        paired = len(blocks) == len(block_hashes)
        for block, block_hash in zip(blocks, block_hashes, strict=False):
            if paired and self.held[block] and block in self.written and self.written[block] is None:
                self.written[block] = block_hash
            else:
                self.written.pop(block, None)
        return True

    @precondition(lambda self: self.unregistered_held())
    @rule(data=st.data(), block_hash=HASHES)
    def register(self, data: st.DataObject, block_hash: str) -> None:
        """Cache a full block the way a block manager does once it fills."""
        block = data.draw(st.sampled_from(self.unregistered_held()), label="block")
        self._register([block], [block_hash], "register")

    @rule(block_hash=HASHES)
    def fill_and_cache(self, block_hash: str) -> None:
        """What a manager does for each prompt block: allocate it, fill it, register it."""
        if block_hash in self.ever_cached and block_hash not in self.pool.model.cached:
            event("revisit: replayed a prompt after eviction")
        for block in self._allocate(1):
            if self._register([block], [block_hash], "register"):
                self.ever_cached.add(block_hash)

    @rule(data=st.data(), block_hash=HASHES)
    def register_any(self, data: st.DataObject, block_hash: str) -> None:
        self._register([self.some_block(data)], [block_hash], "register")

    @rule(block_hash=HASHES, data=st.data())
    def lookup(self, block_hash: str, data: st.DataObject) -> None:
        self.revisit(data)
        answer = self.pool("lookup", block_hash)
        if answer is not None:
            self.check_hits([block_hash], [] if answer.actual is None else [answer.actual])
            event("lookup hit" if answer.actual is not None else "lookup miss")

    def check_hits(self, block_hashes: Sequence[str], blocks: Sequence[int]) -> None:
        """The blocks a lookup answered for the leading ``block_hashes`` hold what was registered under each."""
        named: dict[Hashable, tuple[int, ...]] = {}
        for block_hash, block in zip(block_hashes, blocks, strict=False):
            named[block_hash] = (*named.get(block_hash, ()), block)
        self.check(model.invariant_no_stale_hit, named, self.written)

    @precondition(lambda self: self.offers("block_pool", batch_pool.REGISTER_BLOCKS))
    @rule(data=st.data())
    def register_blocks(self, data: st.DataObject) -> None:
        """Cache several full blocks at once (vLLM's cache_full_blocks); now and then a block or a length that
        the call must refuse whole."""
        held = self.unregistered_held()
        blocks = data.draw(
            st.lists(st.sampled_from(held), max_size=3, unique=True) if held else st.just([]), label="blocks"
        )
        if data.draw(st.integers(0, 4), label="out of contract") == 0:
            blocks = [*blocks, self.some_block(data)]
        hashes = data.draw(st.lists(HASHES, min_size=len(blocks), max_size=len(blocks) + 1), label="hashes")
        self._register(blocks, hashes[: len(blocks) + data.draw(st.integers(0, 1), label="extra")])

    @precondition(
        lambda self: (
            self.offers("block_pool", batch_pool.LOOKUP_PREFIX)
            and self.offers("block_pool", batch_pool.REGISTER_BLOCKS)
        )
    )
    @rule(block_hashes=st.lists(HASHES, min_size=1, max_size=5))
    def serve_request(self, block_hashes: list[str]) -> None:
        """A request of a trace replay in five calls: its cached prefix shared, the rest allocated and registered,
        everything released last block first."""
        hit = self.pool("lookup_prefix", block_hashes)
        held = list(hit.actual) if hit is not None else []
        self.check_hits(block_hashes, held)
        if self.pool("share", held) is None:
            return
        self.held.update(held)
        misses = block_hashes[len(held) : len(held) + len(self.pool.model.lru)]
        fresh = self._allocate(len(misses))
        if fresh:
            self._register(fresh, misses)
            self.ever_cached.update(misses)
        if held or fresh:
            self._release([*held, *fresh][::-1])

    @rule(block_hash=HASHES)
    def hit(self, block_hash: str) -> None:
        """A prefix-cache hit: share the block cached under the hash, in use or free."""
        block = model.lookup(self.pool.model, block_hash)
        if block is not None:
            event("hit on a free cached block" if self.pool.model.refcounts[block] == 0 else "hit on a block in use")
            self._share([block])

    @rule(n=st.one_of(st.integers(1, 2), st.integers(-1, 3)), data=st.data())
    def evict(self, n: int, data: st.DataObject) -> None:
        self.revisit(data)
        before = self.pool.snapshot()
        answer = self.pool("evict", n, judged_by=model.invariant_eviction_order)
        if answer is not None:
            event("evicted cached blocks" if answer.actual else "nothing to evict")
            self.check(model.invariant_in_use_never_reclaimed, before, self.pool.snapshot(), answer.actual)

    @invariant()
    def pool_matches_spec(self) -> None:
        state, pool = self.pool.snapshot(), self.pool.impl
        self.check_group(model.STATE, state, self.held)
        self.check(model.invariant_no_stale_hit, state.cached, self.written)
        refcounts = [pool.refcount(block) for block in range(state.capacity)]
        self.check(model.invariant_counts_match_snapshot, state, pool.num_free(), refcounts)
        self.check(model.invariant_pool_refines_spec, state, model.abstract(self.pool.model))


class RealisticBlockPoolMachine(BlockPoolMachine):
    """The same rules on a pool of realistic size, where scale bugs live."""

    capacities = st.just(1024)


TestBlockPool = conformance_test(BlockPoolMachine, "block pool")
TestRealisticBlockPool = conformance_test(RealisticBlockPoolMachine, "block pool (1,024 blocks)", examples=0.2)
