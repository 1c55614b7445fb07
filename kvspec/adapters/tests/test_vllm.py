"""vLLM's v1 ``BlockPool`` through ``kvspec.adapters.vllm``: what the adapter maps, and vLLM's verdict.

Skipped unless vLLM imports (``kvspec/adapters/install-engines.sh``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (kvspec/adapters/install-engines.sh)")

from kvspec.adapters import vllm  # noqa: E402  (after the skip)
from kvspec.adapters.tests.verdicts import caller_contract_operations, held_safety_rules  # noqa: E402
from kvspec.conformance import run_conformance  # noqa: E402
from kvspec.spec.errors import InvalidOperation, OutOfBlocks  # noqa: E402
from kvspec.spec.implementation import Implementation  # noqa: E402


@pytest.fixture(scope="module")
def vllm_implementation() -> Implementation:
    return vllm.factory()


def test_vllm_null_block_is_hidden_and_renumbered(vllm_implementation: Implementation) -> None:
    pool: Any = vllm_implementation.block_pool(4, "lru")  # the adapter's own pool: its engine shows
    assert pool.engine.num_gpu_blocks == 5 and pool.engine.null_block.block_id == 0
    assert (pool.capacity, pool.num_free()) == (4, 4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.snapshot().refcounts == (1, 1, 1, 1)


def test_vllm_value_error_becomes_out_of_blocks_and_nothing_changes(vllm_implementation: Implementation) -> None:
    pool = vllm_implementation.block_pool(2, "lru")
    before = pool.snapshot()
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    assert pool.snapshot() == before


def test_vllm_lfu_is_declared_unsupported(vllm_implementation: Implementation) -> None:
    assert vllm_implementation.conventions.pool.policies == ("lru",)
    with pytest.raises(InvalidOperation):
        vllm_implementation.block_pool(4, "lfu")


def test_vllm_unhashed_blocks_are_freed_to_the_head_hashed_to_the_tail(vllm_implementation: Implementation) -> None:
    pool = vllm_implementation.block_pool(5, "lru")
    a, b, c = pool.allocate(3)
    assert pool.register(b, "h") is True
    pool.release([c, b, a])
    assert pool.snapshot().free_queue == (c, a, 3, 4, b)


def test_vllm_keeps_a_second_block_under_a_cached_hash(vllm_implementation: Implementation) -> None:
    pool = vllm_implementation.block_pool(4, "lru")
    a, b = pool.allocate(2)
    assert pool.register(a, "h") is True and pool.register(b, "h") is True
    assert pool.snapshot().cached == {"h": (a, b)}
    assert pool.lookup("h") == a


def test_vllm_eviction_is_lazy_and_evict_forgets_the_first_cached_free_blocks(
    vllm_implementation: Implementation,
) -> None:
    pool = vllm_implementation.block_pool(4, "lru")
    a, b, c = pool.allocate(3)
    pool.register(a, "ha")
    pool.register(c, "hc")
    pool.release([a, b, c])
    assert pool.snapshot().free_queue == (b, 3, a, c)
    assert pool.lookup("ha") == a  # free, still cached: vLLM evicts only when it hands the block out
    assert pool.evict(1) == [a]
    assert (pool.lookup("ha"), pool.lookup("hc")) == (None, c)


def test_vllm_trusts_its_caller_with_a_double_free(vllm_implementation: Implementation) -> None:
    """What the caller-contract tier reports: vLLM does not check a release against the count."""
    assert vllm_implementation.conventions.trusts_caller
    pool = vllm_implementation.block_pool(2, "lru")
    [block] = pool.allocate(1)
    pool.release([block])
    pool.release([block])
    assert pool.refcount(block) == -1


def test_vllm_verdict_safety_held_five_caller_contract_findings() -> None:
    verdict = run_conformance("kvspec.adapters.vllm:factory", titled=["block pool"], profile="ci")
    assert verdict.conforms, str(verdict)
    assert not [v for v in verdict.violations if v.tier != "caller contract"], str(verdict)
    assert caller_contract_operations(verdict) == {"allocate", "evict", "register", "release", "share"}
    assert all(v.leads_to for v in verdict.violations), "each finding says what it leads to, measured"
    pool_safety = {r.invariant for r in verdict.rules if r.tier == "safety" and r.layer == "block_pool"}
    assert held_safety_rules(verdict, "block_pool") == pool_safety and pool_safety
