"""Every broken pool and manager of the zoo is caught, each by the invariant named here."""

from __future__ import annotations

import pytest

from kvspec.properties.meta.teeth import assert_caught
from kvspec.properties.test_block_manager import BlockManagerMachine
from kvspec.properties.test_block_pool import BlockPoolMachine

POOL_ZOO = {
    "kvspec.impl.broken.block_pool:leaks_on_free": "invariant_no_leak",
    "kvspec.impl.broken.block_pool:accepts_double_free": "invariant_verdict_matches_spec",
    "kvspec.impl.broken.block_pool:hit_leaves_block_queued": "invariant_free_queue_exact",
    "kvspec.impl.broken.block_pool:allocate_not_atomic": "invariant_failed_operation_changes_nothing",
    "kvspec.impl.broken.block_pool:evicts_most_recent_first": "invariant_eviction_order",
    "kvspec.impl.broken.block_pool:evicts_in_use_blocks": "invariant_in_use_never_reclaimed",
}
MANAGER_ZOO = {
    "kvspec.impl.broken.block_manager:no_copy_on_write": "invariant_verdict_matches_spec",  # it writes where the spec needs a block for the copy
    "kvspec.impl.broken.block_manager:copies_wrong_block": "invariant_read_back_exact",
    "kvspec.impl.broken.block_manager:fork_without_share": "invariant_refcount_matches_holders",
    "kvspec.impl.broken.block_manager:reserves_ahead_block": "invariant_waste_bounded",
    "kvspec.impl.broken.block_manager:frees_first_block_first": "invariant_manager_refines_spec",
    "kvspec.impl.broken.block_manager:append_not_atomic": "invariant_failed_operation_changes_nothing",
}


@pytest.mark.parametrize(("factory", "invariant"), sorted(POOL_ZOO.items()))
def test_broken_pool_is_caught(factory: str, invariant: str) -> None:
    assert_caught(BlockPoolMachine, factory, invariant)


@pytest.mark.parametrize(("factory", "invariant"), sorted(MANAGER_ZOO.items()))
def test_broken_manager_is_caught(factory: str, invariant: str) -> None:
    assert_caught(BlockManagerMachine, factory, invariant)
