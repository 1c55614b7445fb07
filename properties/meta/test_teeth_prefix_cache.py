"""Every broken prefix cache and radix cache of the zoo is caught, each by the invariant named here."""

from __future__ import annotations

import pytest

from kvspec.properties.meta.teeth import assert_caught
from kvspec.properties.test_prefix_cache import PrefixCacheMachine
from kvspec.properties.test_radix_cache import RadixCacheMachine

PREFIX_CACHE_ZOO = {
    "kvspec.impl.broken.prefix_cache:stale_entry_after_reallocation": "invariant_hash_map_consistent",
    "kvspec.impl.broken.prefix_cache:evicts_eagerly": "invariant_evicts_only_what_is_needed",
    "kvspec.impl.broken.prefix_cache:unchained_hash": "invariant_hash_iff_prefix",
    "kvspec.impl.broken.prefix_cache:ignores_extra_keys": "invariant_hash_iff_prefix",
    "kvspec.impl.broken.prefix_cache:counts_hits_past_first_miss": "invariant_hits_stop_at_first_miss",
    "kvspec.impl.broken.prefix_cache:lookup_touches_lru": "invariant_eviction_order",
}
# Each is found within a few examples and shrunk (run_machine always shrinks) to a handful of steps: the machines
# draw sequence ids, prompts and keys without looking at the state, so deleting a step leaves the others' meaning.
RADIX_ZOO = {
    "kvspec.impl.broken.prefix_cache:radix_evicts_locked_paths": "invariant_radix_locked_never_evicted",
    "kvspec.impl.broken.prefix_cache:radix_match_is_not_a_use": "invariant_eviction_order",
}


@pytest.mark.parametrize(("factory", "invariant"), sorted(PREFIX_CACHE_ZOO.items()))
def test_broken_prefix_cache_is_caught(factory: str, invariant: str) -> None:
    assert_caught(PrefixCacheMachine, factory, invariant)


@pytest.mark.parametrize(("factory", "invariant"), sorted(RADIX_ZOO.items()))
def test_broken_radix_cache_is_caught(factory: str, invariant: str) -> None:
    assert_caught(RadixCacheMachine, factory, invariant)
