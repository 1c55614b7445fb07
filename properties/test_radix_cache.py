"""Layer 3, radix form: the radix cache against ``kvspec.spec.radix_cache``'s model.

The first machine drives insert / match_prefix / lock / unlock / evict, valid
and invalid, and serves requests as SGLang does: a request starts by matching
its prompt, caching it and locking it, runs while other requests evict, and
finishes by unlocking.  Keys are short strings over a three-letter alphabet,
drawn without looking at the state (so paths branch and nodes split often,
and a failure shrinks to a few steps).  The second has a radix cache and a
chained-hash prefix-caching manager with room to spare serve the same
requests (add, append, free, lookup); asked the same prefix, their hits must
agree at block granularity.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, consumes, initialize, invariant, rule

from kvspec.properties.harness import LockstepMachine, conformance_test
from kvspec.spec import radix_cache as model
from kvspec.spec.implementation import Implementation

TOKENS = st.integers(0, 2)
KEYS = st.lists(TOKENS, max_size=6)
NOT_TOKENS = st.sampled_from([-1, 1.5, None])
AMPLE_BLOCKS = 4096
CACHE_BUDGET = 8  # tokens a request's admission keeps the cache within, evicting


def drawn_key(data: st.DataObject, earlier: list[tuple[int, ...]], *, min_size: int = 0) -> list[int]:
    """Mostly a cut of an earlier key plus new tokens, so that requests share prefixes."""
    fresh = data.draw(st.lists(TOKENS, max_size=6), label="new tokens")
    if earlier and data.draw(st.booleans(), label="extend an earlier key"):
        base = data.draw(st.sampled_from(earlier), label="earlier key")
        fresh = list(base[: data.draw(st.integers(0, len(base)), label="cut")]) + fresh
    return fresh if len(fresh) >= min_size else fresh + [0] * (min_size - len(fresh))


class RadixCacheMachine(LockstepMachine):
    running = Bundle("running")  # the keys that running requests hold locked

    @initialize()
    def start(self) -> None:
        self.record("radix = radix_cache()")
        self.model = model.new_radix()
        self.radix = self.implementation.radix_cache()
        self.next_value = 0

    # -- the radix cache against its model ---------------------------------------------

    def values_for(self, key: list[int], corrupt: bool) -> list[int]:
        values = list(range(self.next_value, self.next_value + len(key)))
        self.next_value += len(key)
        return (values[:-1] + [-1] if values else [0]) if corrupt else values

    @rule(key=KEYS, corrupt=st.integers(0, 9).map(lambda n: n == 0))
    def insert(self, key: list[int], corrupt: bool) -> None:
        self.insert_both(key, self.values_for(key, corrupt))

    def insert_both(self, key: list[int], values: list[int]) -> bool:
        result = self.lockstep(
            f"radix.insert({key}, {values})",
            lambda: model.insert(self.model, key, values),
            lambda: self.radix.insert(key, values),
            self.radix.snapshot,
        )
        if result is None:
            return False
        (self.model, expected), actual = result
        self.check("invariant_result_matches_spec", expected, actual)
        return True

    @rule(key=KEYS)
    def match_prefix(self, key: list[int]) -> None:
        """A match alone, as a scheduler ranking its waiting requests by prefix does."""
        self.match_both(key)

    def match_both(self, key: list[int]) -> int:
        """Match ``key`` on both sides; the number of tokens that hit."""
        result = self.lockstep(
            f"radix.match_prefix({key})",
            lambda: model.match_prefix(self.model, key),
            lambda: self.radix.match_prefix(key),
            self.radix.snapshot,
        )
        if result is not None:
            (self.model, expected), actual = result
            self.check("invariant_radix_match_is_longest", expected, actual)
            event("radix hit" if actual else "radix miss")
            return len(actual)
        return 0

    def lock_both(self, operation: str, key: list[int]) -> bool:
        result = self.lockstep(
            f"radix.{operation}({key})",
            lambda: getattr(model, operation)(self.model, key),
            lambda: getattr(self.radix, operation)(key),
            self.radix.snapshot,
        )
        if result is not None:
            self.model = result[0]
        return result is not None

    @rule(key=KEYS, unlock=st.booleans())
    def lock_or_unlock(self, key: list[int], unlock: bool) -> None:
        """A lock or unlock of any key: an uncached key, or one holding no lock, is rejected."""
        self.lock_both("unlock" if unlock else "lock", key)

    @rule(target=running, key=st.lists(TOKENS, min_size=1, max_size=6))
    def start_request(self, key: list[int]) -> list[int]:
        """SGLang's admission: match the prompt, evict least recently used leaves to make room for the rest
        within a budget of cached tokens, cache it, and lock the whole path while the request runs."""
        matched = self.match_both(key)
        over_budget = len(self.model.values) + len(key) - matched - CACHE_BUDGET
        if over_budget > 0:
            self.evict_both(over_budget)
        self.insert_both(key, self.values_for(key, corrupt=False))
        self.lock_both("lock", key)
        return key

    @rule(key=consumes(running))
    def finish_request(self, key: list[int]) -> None:
        self.lock_both("unlock", key)

    @rule(n=st.integers(-1, 8))
    def evict(self, n: int) -> None:
        self.evict_both(n)

    def evict_both(self, n: int) -> None:
        before = self.radix.snapshot()
        result = self.lockstep(
            f"radix.evict({n})", lambda: model.evict(self.model, n), lambda: self.radix.evict(n), self.radix.snapshot
        )
        if result is None:
            return
        (self.model, expected), actual = result
        self.check("invariant_radix_locked_never_evicted", before, self.radix.snapshot(), actual, n)
        self.check("invariant_eviction_order", expected, actual)
        event("evicted from a tree with locks" if before.locks and actual else "evicted without locks")

    # -- after every step --------------------------------------------------------------

    @invariant()
    def matches_spec(self) -> None:
        if not hasattr(self, "model"):
            return
        state = self.radix.snapshot()
        self.check("invariant_radix_prefix_closed", state)
        sizes = (self.radix.total_size(), self.radix.evictable_size(), self.radix.protected_size())
        self.check("invariant_radix_sizes_consistent", state, *sizes)
        self.check("invariant_radix_refines_spec", state, model.abstract(self.model))


class RadixAgreesWithChainedHashMachine(LockstepMachine):
    """A radix cache and a chained-hash manager with room to spare serve the same requests."""

    @initialize(block_size=st.integers(1, 4))
    def start(self, block_size: int) -> None:
        self.record(f"radix = radix_cache(); chained = prefix_caching_manager(B={block_size}, {AMPLE_BLOCKS} blocks)")
        self.radix = self.implementation.radix_cache()
        pool = self.implementation.block_pool(AMPLE_BLOCKS, "lru")
        self.chained = self.implementation.prefix_caching_manager(pool, block_size)
        self.block_size = block_size
        self.requests: list[tuple[int, ...]] = []
        self.next_seq = 0

    def key(self, data: st.DataObject, earlier: list[tuple[int, ...]], *, min_size: int = 0) -> list[int]:
        return drawn_key(data, earlier, min_size=min_size)

    @rule(data=st.data())
    def serve_request(self, data: st.DataObject) -> None:
        prompt = self.key(data, self.requests, min_size=1)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.record(f"chained.add_sequence({seq}, {prompt}); radix.insert({prompt})")
        self.chained.add_sequence(seq, prompt)
        self.radix.insert(prompt, prompt)
        self.requests.append(tuple(prompt))

    @rule(data=st.data())
    def continue_request(self, data: st.DataObject) -> None:
        live = self.chained.sequences()
        if not live:
            return
        seq = data.draw(st.sampled_from(live), label="sequence")
        tokens = data.draw(st.lists(TOKENS, max_size=2 * self.block_size), label="tokens")
        self.record(f"chained.append({seq}, {tokens}); radix.insert(all of it)")
        self.chained.append(seq, tokens)
        everything = self.chained.read(seq)
        self.radix.insert(everything, everything)
        self.requests.append(everything)

    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        live = self.chained.sequences()
        if live:
            seq = data.draw(st.sampled_from(live), label="sequence")
            self.record(f"chained.free({seq})")
            self.chained.free(seq)

    @rule(data=st.data())
    def compare_hits(self, data: st.DataObject) -> None:
        key = self.key(data, self.requests)
        self.record(f"radix.match_prefix({key}) vs chained.cached_prefix({key})")
        radix_tokens = len(self.radix.match_prefix(key))
        chained_blocks = len(self.chained.cached_prefix(key))
        self.check("invariant_radix_agrees_with_chained_hash", radix_tokens, chained_blocks, self.block_size)
        event("block-level hit on both" if chained_blocks else "no block-level hit")


TestRadixCache = conformance_test(RadixCacheMachine)
TestRadixAgreesWithChainedHash = conformance_test(RadixAgreesWithChainedHashMachine)


def test_lru_leaf_first_eviction_keeps_the_shared_trunk(kv_implementation: Implementation) -> None:
    """Two branches share a trunk; evicting 3 tokens takes the older branch only."""
    cache = kv_implementation.radix_cache()
    cache.insert([1, 2, 3, 4, 5], [10, 20, 30, 40, 50])
    cache.insert([1, 2, 3, 7, 8], [10, 20, 30, 70, 80])
    assert cache.evict(3) == (50, 40, 80)
    assert cache.match_prefix([1, 2, 3, 7, 8]) == (10, 20, 30, 70)
    cache.lock([1, 2])
    assert cache.evict(10) == (70, 30)
    assert (cache.total_size(), cache.protected_size(), cache.evictable_size()) == (2, 2, 0)
