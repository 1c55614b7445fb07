"""Layer 3, radix form: the radix cache against ``kvspec.spec.radix_cache``'s model.

The first machine drives insert / match_prefix / lock / unlock / evict, valid
and invalid, and serves requests as SGLang does: a request starts by matching
its prompt, caching it and locking it, runs while other requests evict, and
finishes by unlocking.  Keys are short strings over a three-letter alphabet,
drawn without looking at the state (so paths branch and nodes split often,
and a failure shrinks to a few steps) -- or an earlier request's prompt
again, often after eviction took part of it; a refused lock or unlock is
retried once the tree has changed.  The caller keeps its own ledger of the
locks the cache took (``locked``): an eviction must leave every path in it.  The second has a radix cache and a
chained-hash prefix-caching manager with room to spare serve the same
requests (add, append, free, lookup); asked the same prefix, their hits must
agree at block granularity.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, MultipleResults, consumes, initialize, invariant, multiple, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.spec import block_pool, radix_conventions
from kvspec.spec import radix_cache as model
from kvspec.spec.conventions import REFERENCE, RadixConventions
from kvspec.spec.implementation import Implementation

TOKENS = st.integers(0, 2)
KEYS = st.lists(TOKENS, max_size=6)
NOT_TOKENS = st.sampled_from([-1, 1.5, None])
EXTRA_KEYS = st.sampled_from([None, "lora-a", "lora-b"])  # SGLang's RadixKey.extra_key: a LoRA adapter's name
AMPLE_BLOCKS = 4096
CACHE_BUDGET = 8  # tokens a request's admission keeps the cache within, evicting


def drawn_key(data: st.DataObject, earlier: list[tuple[int, ...]], *, min_size: int = 0) -> list[int]:
    """Mostly a cut of an earlier key plus new tokens, so that requests share prefixes."""
    fresh = data.draw(st.lists(TOKENS, max_size=6), label="new tokens")
    if bool(earlier) and data.draw(st.booleans(), label="extend an earlier key"):
        base = data.draw(st.sampled_from(earlier), label="earlier key")
        fresh = list(base[: data.draw(st.integers(0, len(base)), label="cut")]) + fresh
    return fresh if len(fresh) >= min_size else fresh + [0] * (min_size - len(fresh))


class RadixCacheMachine(LockstepMachine):
    uses = frozenset({"radix_cache"})
    judges = ("radix_cache", "block_pool", "invariants")
    running = Bundle("running")  # (key, extra key) of each running request: what it locked

    @initialize()
    def start(self) -> None:
        self.record("radix = radix_cache()")
        spec = radix_conventions.new_radix(self.conventions.radix)
        self.radix = self.subject("radix", radix_conventions, spec, self.implementation.radix_cache())
        self.next_value = 0
        self.extra_key: str | None = None  # the namespace the next calls come from
        self.prompts: list[tuple[list[int], int]] = []  # each request's prompt, with the evictions before it
        self.evicted = 0  # tokens evicted so far
        self.refused: tuple[str, list[int]] | None = None  # the lock or unlock refused last
        self.locked: Counter[model.Key] = Counter()  # the caller's ledger: each path it holds locked, how often
        self.inserted: list[tuple[list[int], int]] = []  # each key inserted alone, with the evictions before it

    # -- the radix cache against its model ---------------------------------------------

    def values_for(self, key: list[int], corrupt: bool) -> list[int]:
        values = list(range(self.next_value, self.next_value + len(key)))
        self.next_value += len(key)
        return (values[:-1] + [-1] if values else [0]) if corrupt else values

    @rule(key=KEYS, corrupt=st.integers(0, 9).map(lambda n: n == 0), data=st.data())
    def insert(self, key: list[int], corrupt: bool, data: st.DataObject) -> None:
        self.revisit(data)
        self.inserted.append((key, self.evicted))
        self.radix("insert", key, self.values_for(key, corrupt), *self.namespace(self.extra_key))

    @rule(extra_key=EXTRA_KEYS)
    def switch_namespace(self, extra_key: str | None) -> None:
        """The next calls come from another LoRA adapter, if the cache declares extra-key namespaces."""
        if self.conventions.radix.extra_key_namespaces:
            self.extra_key = extra_key

    @staticmethod
    def namespace(extra_key: str | None) -> tuple[str, ...]:
        """What a call passes after its arguments: the extra key, if there is one."""
        return () if extra_key is None else (extra_key,)

    @rule(key=KEYS, data=st.data())
    def match_prefix(self, key: list[int], data: st.DataObject) -> None:
        """A match alone, as a scheduler ranking its waiting requests by prefix does; then, as often as not, a
        token evicted: the match's recency decides which leaf goes."""
        self.revisit(data)
        self.match(key)
        if data.draw(st.booleans(), label="then evict a token"):
            self.evict_both(1)

    def revisit(self, data: st.DataObject) -> None:
        """Drawn inside the common rules, so that swarm testing never turns it off: as often as not, the lock or
        unlock refused last again; as often, an earlier request's prompt or inserted key met again -- matched
        and cached."""
        if self.refused is not None and data.draw(st.booleans(), label="retry the refused call first"):
            (operation, key), self.refused = self.refused, None
            event("revisit: retried a rejected call")
            if not self.lock_call(operation, key, self.extra_key):
                self.refused = (operation, key)
        if bool(self.prompts + self.inserted) and data.draw(st.booleans(), label="an earlier prompt again"):
            key = self.earlier_prompt(data, self.prompts + self.inserted)
            self.match(key)
            self.radix("insert", key, self.values_for(key, corrupt=False), *self.namespace(self.extra_key))

    def earlier_prompt(self, data: st.DataObject, earlier: list[tuple[list[int], int]]) -> list[int]:
        key, evicted_then = data.draw(st.sampled_from(earlier), label="earlier prompt")
        event("revisit: re-admitted an earlier prompt")
        if evicted_then < self.evicted:
            event("revisit: replayed a prompt after eviction")
        return key

    def match(self, key: list[int]) -> int:
        """Match ``key`` on both sides; the number of tokens that hit."""
        before = self.radix.snapshot()
        answer = self.radix("match_prefix", key, *self.namespace(self.extra_key))
        if answer is None:
            return 0
        radix = self.conventions.radix
        page = len(key) - len(key) % radix.page_size
        named = model.name_tokens(key[:page], radix.page_size, self.extra_key)
        self.check(model.invariant_radix_match_is_longest, before, named, answer.actual)
        event("radix hit" if answer.actual else "radix miss")
        return len(answer.actual)

    @rule(key=KEYS, unlock=st.booleans(), retry=st.booleans())
    def lock_or_unlock(self, key: list[int], unlock: bool, retry: bool) -> None:
        """A lock or unlock of any key: an uncached key, or one holding no lock, is out of contract.
        If ``retry``, the one refused last instead, now that the tree may have changed."""
        operation = "unlock" if unlock else "lock"
        if retry and self.refused is not None:
            (operation, key), self.refused = self.refused, None
            event("revisit: retried a rejected call")
        if not self.lock_call(operation, key, self.extra_key):
            self.refused = (operation, key)

    def lock_call(self, operation: str, key: list[int], extra_key: str | None) -> bool:
        """A lock or unlock of ``key``; whether the cache carried it out.  The caller's ledger of the locks it
        holds (``locked``) follows: a lock the cache took is held until an unlock it carried out releases it."""
        before = self.radix.snapshot()
        if self.radix(operation, key, *self.namespace(extra_key)) is None:
            return False
        path = self.locked_path(before, key, extra_key)
        if path and operation == "lock":
            self.locked[path] += 1
        elif path and self.locked[path] > 0:
            self.locked[path] -= 1
        return True

    def locked_path(self, before: model.RadixState, key: list[int], extra_key: str | None) -> model.Key:
        """The path a lock or unlock of ``key`` names: the key, or (locks by handle) the node where the key's
        longest cached prefix ends, in the cache's own state when asked."""
        radix = self.conventions.radix
        named = model.name_tokens(key[: len(key) - len(key) % radix.page_size], radix.page_size, extra_key)
        return named[: len(model.longest_cached(before, named))] if radix.lock_by == "handle" else named

    @rule(target=running, key=st.lists(TOKENS, min_size=1, max_size=6), data=st.data())
    def start_request(self, key: list[int], data: st.DataObject) -> MultipleResults[tuple[list[int], str | None]]:
        """SGLang's admission: match the prompt, evict least recently used leaves to make room for the rest
        within a budget of cached tokens, cache it, and lock the whole path while the request runs.  As often
        as not the prompt is an earlier request's, met again after the tree changed.  A prompt is whole pages.
        The request runs, holding its lock, if the cache took the lock."""
        key += [0] * (-len(key) % self.conventions.radix.page_size)
        if bool(self.prompts) and data.draw(st.booleans(), label="an earlier prompt"):
            key = self.earlier_prompt(data, self.prompts)
        self.prompts.append((key, self.evicted))
        matched = self.match(key)
        over_budget = len(self.radix.snapshot().values) + len(key) - matched - CACHE_BUDGET
        if over_budget > 0:
            self.evict_both(over_budget)
        self.radix("insert", key, self.values_for(key, corrupt=False), *self.namespace(self.extra_key))
        if not self.lock_call("lock", key, self.extra_key):
            return multiple()
        return multiple((key, self.extra_key))

    @rule(request=consumes(running))
    def finish_request(self, request: tuple[list[int], str | None]) -> None:
        key, extra_key = request
        self.lock_call("unlock", key, extra_key)

    @rule(n=st.integers(-1, 8), data=st.data())
    def evict(self, n: int, data: st.DataObject) -> None:
        self.evict_both(n)
        self.revisit(data)

    def evict_both(self, n: int) -> None:
        before = self.radix.snapshot()
        answer = self.radix("evict", n, judged_by=block_pool.invariant_eviction_order)
        if answer is None:
            return
        after = self.radix.snapshot()
        self.check(model.invariant_radix_locked_never_evicted, model.locked_paths(self.locked), before, after)
        self.check(model.invariant_radix_evicts_what_was_asked, before, after, answer.actual, n)
        self.evicted += len(answer.actual)
        event("evicted from a tree with locks" if before.locks and answer.actual else "evicted without locks")

    # -- after every step --------------------------------------------------------------

    @invariant()
    def matches_spec(self) -> None:
        state, cache = self.radix.snapshot(), self.radix.impl
        self.check_group(model.STATE, state, cache.total_size(), cache.evictable_size(), cache.protected_size())
        self.check(model.invariant_radix_refines_spec, state, model.abstract(self.radix.model))


class RadixAgreesWithChainedHashMachine(LockstepMachine):
    """A radix cache and a chained-hash manager with room to spare serve the same requests."""

    uses = frozenset({"radix_cache", "block_pool", "prefix_caching_manager"})
    judges = ("radix_cache",)

    @initialize(block_size=st.integers(1, 4))
    def start(self, block_size: int) -> None:
        self.record(f"radix = radix_cache(); chained = prefix_caching_manager(B={block_size}, {AMPLE_BLOCKS} blocks)")
        impl = self.implementation
        self.radix = self.subject("radix", None, None, impl.radix_cache())
        pool = impl.block_pool(AMPLE_BLOCKS, impl.conventions.pool.policies[0])
        self.chained = self.subject("chained", None, None, impl.prefix_caching_manager(pool, block_size))
        self.block_size = block_size
        self.requests: list[tuple[int, ...]] = []
        self.next_seq = 0

    def live(self) -> list[int]:
        return list(self.chained.impl.sequences())

    @rule(data=st.data())
    def serve_request(self, data: st.DataObject) -> None:
        prompt = drawn_key(data, self.requests, min_size=1)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.chained("add_sequence", seq, prompt)
        self.radix("insert", prompt, prompt)
        self.requests.append(tuple(prompt))

    @rule(data=st.data())
    def continue_request(self, data: st.DataObject) -> None:
        if not self.live():
            return
        seq = data.draw(st.sampled_from(self.live()), label="sequence")
        self.chained("append", seq, data.draw(st.lists(TOKENS, max_size=2 * self.block_size), label="tokens"))
        everything = self.chained.impl.read(seq)
        self.radix("insert", everything, everything)
        self.requests.append(everything)

    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        if self.live():
            self.chained("free", data.draw(st.sampled_from(self.live()), label="sequence"))

    @rule(data=st.data())
    def compare_hits(self, data: st.DataObject) -> None:
        key = drawn_key(data, self.requests)
        radix, chained = self.radix("match_prefix", key), self.chained("cached_prefix", key)
        if radix is None or chained is None:
            return
        self.check(
            model.invariant_radix_agrees_with_chained_hash, len(radix.actual), len(chained.actual), self.block_size
        )
        event("block-level hit on both" if chained.actual else "no block-level hit")


TestRadixCache = conformance_test(RadixCacheMachine, "radix cache")
TestRadixAgreesWithChainedHash = conformance_test(RadixAgreesWithChainedHashMachine, "radix = chained hash")


def test_lru_leaf_first_eviction_keeps_the_shared_trunk(kv_implementation: Implementation) -> None:
    """Two branches share a trunk; evicting 3 tokens takes the older branch only."""
    if kv_implementation.conventions.radix != REFERENCE.radix:
        pytest.skip("the example's numbers are the reference conventions'")
    cache = kv_implementation.radix_cache()
    cache.insert([1, 2, 3, 4, 5], [10, 20, 30, 40, 50])
    cache.insert([1, 2, 3, 7, 8], [10, 20, 30, 70, 80])
    assert cache.evict(3) == (50, 40, 80)
    assert cache.match_prefix([1, 2, 3, 7, 8]) == (10, 20, 30, 70)
    cache.lock([1, 2])
    assert cache.evict(10) == (70, 30)
    assert (cache.total_size(), cache.protected_size(), cache.evictable_size()) == (2, 2, 0)


def test_a_new_leaf_is_newer_than_the_walk_that_made_it(kv_implementation: Implementation) -> None:
    """Found against SGLang 0.5.23 (shrunk): the second insert splits [1, 1, 0, 0, 0] off its node and adds the
    leaf [0, 0] beside it; SGLang stamps that new leaf after the walk, so the split-off tail is older and goes
    first.  The implementation under test must evict what the model of its declared conventions evicts."""
    calls: list[tuple[Any, ...]] = [
        ("insert", [0, 0], [0, 1]),
        ("lock", [0, 0]),
        ("insert", [0, 1, 1, 0, 0, 0], [2, 3, 4, 5, 6, 7]),
        ("lock", [0, 1, 1, 0, 0, 0]),
        ("unlock", [0, 1, 1, 0, 0, 0]),
        ("insert", [0, 1, 0, 0], [8, 9, 10, 11]),
        ("match_prefix", [0]),
    ]
    sglang = radix_conventions.new_radix(
        RadixConventions(eviction_granularity="whole_leaves", recency="per_node", lock_by="handle")
    )
    cache, radix = kv_implementation.radix_cache(), radix_conventions.new_radix(kv_implementation.conventions.radix)
    if kv_implementation.conventions.radix.page_size != 1:
        pytest.skip("the example's keys are not whole pages")
    for operation, *args in calls:
        getattr(cache, operation)(*args)
        radix = model_step(radix, operation, *args)
        sglang = model_step(sglang, operation, *args)
    assert radix_conventions.evict(sglang, 1)[1] == (7, 6, 5, 4)
    assert cache.evict(1) == radix_conventions.evict(radix, 1)[1]


def model_step(radix: model.Radix, operation: str, *args: object) -> model.Radix:
    result = getattr(radix_conventions, operation)(radix, *args)
    return result[0] if isinstance(result, tuple) else result
