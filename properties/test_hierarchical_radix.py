"""Layer 3, hierarchical form: a two-tier radix cache against ``kvspec.spec.hierarchical_radix``'s model.

The machine serves requests as SGLang's scheduler does under HiCache's write-through policy: a request
matches its prompt, loads its host hit back into fresh device slots, evicts from the device to keep it
within a budget, caches the prompt and (as often as not) writes it through to the host.  Between requests
writes and loads land, or stay in flight while the device and the host evict.  Keys are short strings over
a three-letter alphabet, as often as not an earlier prompt cut somewhere and extended, so walks end inside
runs whose write-through is still in flight, and split them.  Every call is checked on the cache's own
states before and after it: in-flight writes keep their device copies, the host drops only its leaves.
The caller goes on as the cache answers (what a match hit, how many slots a load back takes, how full the
device is), and keeps its own ledger of the KV it computed (``computed_for``): what every copy must hold.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.properties.subjects import Answer
from kvspec.spec import hierarchical_radix as model
from kvspec.spec import radix_cache
from kvspec.spec.hierarchical_radix import HierarchicalRadixCache, HierState
from kvspec.spec.implementation import Implementation
from kvspec.spec.radix_cache import Key

KIND = model.HIERARCHICAL_RADIX_CACHE.name
# A request in one draw (a few choices, which keeps a step cheap): how many new tokens and which (the digits of a
# number in base 3), whether they follow an earlier prompt, which one and how many of its tokens are cut off (both
# taken modulo what there is), and whether the prompt is written through to the host.
REQUESTS = st.tuples(
    st.integers(0, 5), st.integers(0, 3**5 - 1), st.booleans(), st.integers(0, 15), st.integers(0, 8), st.booleans()
)
# A scheduler step in one draw: whether it comes first (in a rule that is not one: then it admits one request),
# how many requests it admits, whether the writes and the loads in flight land.
STEPS = st.tuples(st.booleans(), st.integers(1, 2), st.booleans(), st.booleans())
DEVICE_BUDGET = 6  # tokens on the device a request's admission keeps the cache within, evicting
WALKS = frozenset({"match_prefix", "insert", "write_through", "load_back"})


class HierarchicalRadixMachine(LockstepMachine):
    uses = frozenset({KIND})
    judges = ("hierarchical_radix", "invariants")

    @initialize(host_capacity=st.integers(6, 12), requests=st.integers(1, 4), data=st.data())
    def start(self, host_capacity: int, requests: int, data: st.DataObject) -> None:
        """A cache that has served a few requests already, so that even a short example starts on two tiers."""
        self.record(f"cache = hierarchical_radix_cache({host_capacity})")
        built = self.implementation.component(KIND)(host_capacity)
        self.cache = self.subject("cache", model, model.new_hier(host_capacity), built)
        self.next_value = 0
        self.computed_for: dict[int, Key] = {}  # the caller's ledger: each KV it wrote, and the token it is for
        self.prompts: list[tuple[int, ...]] = []
        self.state = self.cache.snapshot()  # the cache's own state after the last call
        for _ in range(requests):
            self.admit(data)

    def drawn_key(self, data: st.DataObject) -> list[int]:
        return self.drawn_request(data)[0]

    def drawn_request(self, data: st.DataObject) -> tuple[list[int], bool]:
        """A prompt -- as often as not an earlier prompt cut somewhere, and new tokens after it -- and whether it
        is written through."""
        length, digits, after_earlier, which, cut, write = data.draw(REQUESTS, label="request")
        fresh = [digits // 3**i % 3 for i in range(length)]
        if not self.prompts or not after_earlier:
            return fresh, write
        earlier = self.prompts[which % len(self.prompts)]
        return list(earlier[: len(earlier) - cut % (len(earlier) + 1)]) + fresh, write

    def fresh_values(self, count: int) -> list[int]:
        values = list(range(self.next_value, self.next_value + count))
        self.next_value += count
        return values

    def call(self, operation: str, *args: Any) -> tuple[Answer | None, HierState, HierState]:
        """One call on both sides, with the rules over the cache's own states before and after it."""
        before = self.state
        if operation in WALKS:
            note_cut(before, tuple(args[0]))
        answer = self.cache(operation, *args)
        after = self.state = self.cache.snapshot()
        self.check(model.invariant_hicache_write_through_pins_device, before, after)
        self.check(model.invariant_hicache_host_evicts_only_leaves, before, after)
        if any(
            copies.host and not getattr(after.copies.get(token), "host", False)
            for token, copies in before.copies.items()
        ):
            event(f"{operation}: host leaves evicted")
        return answer, before, after

    def match(self, key: list[int]) -> tuple[tuple[int, ...], int]:
        answer, before, _ = self.call("match_prefix", key)
        if answer is None:
            return (), 0
        values, host_hit = answer.actual
        self.check(model.invariant_hicache_hit_read_from_device, before, tuple(key), values)
        event("match: host hit" if host_hit else "match: no host hit")
        return values, host_hit  # the caller goes on as the cache answered

    # -- requests ----------------------------------------------------------------------

    @rule(data=st.data())
    def scheduler_step(self, data: st.DataObject) -> None:
        """One step of SGLang's scheduler: the writes that finished land (``writing_check``), a request or two
        are admitted, and the loads that finished land (``loading_check``) -- each as often as not."""
        self.step(data, first=False)

    def step(self, data: st.DataObject, first: bool = True) -> None:
        """Also drawn inside every other rule (``first``), so that swarm testing never leaves an example without
        requests: there, as often as not, a scheduler step comes first."""
        before_the_rule, requests, writes_land, loads_land = data.draw(STEPS, label="scheduler step")
        if first and not before_the_rule:
            return
        requests = 1 if first else requests
        if writes_land:
            self.call("finish_writes")
        for _ in range(requests):
            self.admit(data)
        if loads_land:
            self.call("finish_loads")

    def admit(self, data: st.DataObject) -> None:
        """Match the prompt, load its host hit back, make room on the device, cache it, maybe write it through."""
        key, write_through = self.drawn_request(data)
        if not key:
            return  # a prompt has a token at least
        self.prompts.append(tuple(key))
        values, host_hit = self.match(key)
        if host_hit:
            self.call("load_back", key, self.fresh_values(host_hit))
            event("request: host hit loaded back")
        on_device = sum(copies.device is not None for copies in self.state.copies.values())
        over = on_device + len(key) - len(values) - host_hit - DEVICE_BUDGET
        if over > 0:
            self.evict_device(over)
        stored = self.fresh_values(len(key))
        self.computed_for.update({value: tuple(key[: i + 1]) for i, value in enumerate(stored)})
        self.call("insert", key, stored)
        if write_through:
            self.call("write_through", key)

    @rule(data=st.data())
    def match_prefix(self, data: st.DataObject) -> None:
        self.step(data)
        self.match(self.drawn_key(data))

    @rule(data=st.data())
    def write_through(self, data: st.DataObject) -> None:
        self.step(data)
        self.call("write_through", self.drawn_key(data))

    @rule(data=st.data(), extra=st.integers(-1, 1))
    def load_back(self, data: st.DataObject, extra: int) -> None:
        """A load of a key's host hit; with ``extra`` other than 0 the wrong number of slots (out of contract)."""
        self.step(data)
        key = self.drawn_key(data)
        host_hit = model.state_runs(self.state, tuple(key))[1]
        self.call("load_back", key, self.fresh_values(max(0, host_hit + extra)))

    @rule(n=st.integers(-1, 6), data=st.data())
    def evict(self, n: int, data: st.DataObject) -> None:
        self.step(data)
        self.evict_device(n)

    def evict_device(self, n: int) -> None:
        answer, before, after = self.call("evict", n)
        if answer is None or not answer.actual:
            return
        if any(copies.writing for copies in before.copies.values()):
            event("evict: device eviction while a write-through is in flight")
        demoted = [t for t, copies in before.copies.items() if copies.device is not None and t in after.copies]
        if any(after.copies[token].device is None for token in demoted):
            event("evict: a token demoted to its host copy")

    @rule(n=st.integers(-1, 6), data=st.data())
    def evict_host(self, n: int, data: st.DataObject) -> None:
        self.step(data)
        answer, before, _ = self.call("evict_host", n)
        if answer is None or not answer.actual:
            return
        if any(copies.loading for copies in before.copies.values()):
            event("evict_host: while a load is in flight")

    # -- after every step --------------------------------------------------------------

    @invariant()
    def matches_spec(self) -> None:
        state = self.state
        self.check(model.invariant_hicache_every_token_readable, state)
        self.check(model.invariant_hicache_copies_hold_their_kv, state, self.computed_for)
        self.check(radix_cache.invariant_radix_prefix_closed, model.as_radix_state(state))
        self.check(model.invariant_hicache_refines_spec, state, model.abstract(self.cache.model))


def note_cut(state: HierState, key: tuple[int, ...]) -> None:
    """Record a walk that ends between two tokens of one in-flight transfer: a node there splits."""
    end = 0
    while end < len(key) and key[: end + 1] in state.copies:
        end += 1
    last = state.copies.get(key[:end])
    if last is None or not (last.writing or last.loading):
        return
    below = [copies for token, copies in state.copies.items() if len(token) == end + 1 and token[:end] == key[:end]]
    if any(copies.writing for copies in below) and last.writing:
        event("walk: ended inside a run whose write-through is in flight")
    if any(copies.loading for copies in below) and last.loading:
        event("walk: ended inside a run whose load is in flight")


TestHierarchicalRadix = conformance_test(HierarchicalRadixMachine, "hierarchical radix cache (HiCache)", examples=0.3)


def test_a_demoted_prefix_is_a_host_hit_loaded_back(kv_implementation: Implementation) -> None:
    """A prompt written through and landed is demoted by eviction; met again it is a host hit, loaded back into
    new device slots, whose KV is the host copy's once the load lands."""
    if KIND not in kv_implementation.components:
        pytest.skip(f"{kv_implementation.name} offers no {KIND}")
    cache: HierarchicalRadixCache = kv_implementation.component(KIND)(4)
    assert cache.insert([1, 2, 3], [10, 20, 30]) == 0
    assert cache.write_through([1, 2, 3]) == 3
    assert cache.evict(3) == ()  # pinned while the write is in flight
    assert cache.finish_writes() == 3
    assert cache.evict(2) == (30, 20)  # demoted: the host copies stay
    assert cache.match_prefix([1, 2, 3]) == ((10,), 2)
    assert cache.load_back([1, 2, 3], [40, 50]) == 2
    assert cache.evict_host(2) == 0  # the host copies are being read
    assert cache.finish_loads() == 2
    loaded = cache.snapshot().copies[(1, 2, 3)]
    assert (loaded.device, loaded.device_kv, loaded.host_kv) == (50, 30, 30)
