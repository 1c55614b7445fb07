"""Broken paged KV caches the lifecycle machine must catch: what goes wrong across hits, swaps and recompute."""

from __future__ import annotations

import pytest

from kvspec.properties.meta.teeth import assert_caught
from kvspec.properties.test_paged_attention_lifecycle import PagedLifecycleMachine

LIFECYCLE_ZOO = {
    "kvspec.impl.broken.attention:cow_skips_kv_copy": "invariant_paged_equals_contiguous",
    "kvspec.impl.broken.attention:swap_pairs_sorted_blocks": "invariant_paged_equals_contiguous",
}


@pytest.mark.parametrize(("factory", "invariant"), sorted(LIFECYCLE_ZOO.items()))
def test_broken_lifecycle_is_caught(factory: str, invariant: str) -> None:
    assert_caught(PagedLifecycleMachine, factory, invariant)
