"""The adapters to real engines (``kvspec.adapters``): their mapping, and the engines' verdicts.

Skipped unless the engine is importable, so kvspec's own CI stays small; with the engines
installed as the README says (``kvspec/adapters/install-engines.sh``), these tests pin
what each adapter maps and what kvspec finds in each engine.
"""

from __future__ import annotations

import pytest

from kvspec.adapters import importable
from kvspec.spec.errors import InvalidOperation, OutOfBlocks

needs_vllm = pytest.mark.skipif(
    not importable("vllm"), reason="vLLM is not installed (kvspec/adapters/install-engines.sh)"
)
needs_sglang = pytest.mark.skipif(
    not importable("sglang"), reason="SGLang is not installed (kvspec/adapters/install-engines.sh)"
)


# -- vLLM's v1 BlockPool ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_implementation():
    from kvspec.adapters import vllm

    return vllm.factory()


@needs_vllm
def test_vllm_null_block_is_hidden_and_renumbered(vllm_implementation):
    pool = vllm_implementation.block_pool(4, "lru")
    assert pool.engine.num_gpu_blocks == 5 and pool.engine.null_block.block_id == 0
    assert (pool.capacity, pool.num_free()) == (4, 4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.snapshot().refcounts == (1, 1, 1, 1)


@needs_vllm
def test_vllm_value_error_becomes_out_of_blocks_and_nothing_changes(vllm_implementation):
    pool = vllm_implementation.block_pool(2, "lru")
    before = pool.snapshot()
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    assert pool.snapshot() == before


@needs_vllm
def test_vllm_lfu_is_declared_unsupported(vllm_implementation):
    assert vllm_implementation.conventions.pool.policies == ("lru",)
    with pytest.raises(InvalidOperation):
        vllm_implementation.block_pool(4, "lfu")


@needs_vllm
def test_vllm_unhashed_blocks_are_freed_to_the_head_hashed_to_the_tail(vllm_implementation):
    pool = vllm_implementation.block_pool(5, "lru")
    a, b, c = pool.allocate(3)
    assert pool.register(b, "h") is True
    pool.release([c, b, a])
    assert pool.snapshot().free_queue == (c, a, 3, 4, b)


@needs_vllm
def test_vllm_keeps_a_second_block_under_a_cached_hash(vllm_implementation):
    pool = vllm_implementation.block_pool(4, "lru")
    a, b = pool.allocate(2)
    assert pool.register(a, "h") is True and pool.register(b, "h") is True
    assert pool.snapshot().cached == {"h": (a, b)}
    assert pool.lookup("h") == a


@needs_vllm
def test_vllm_eviction_is_lazy_and_evict_forgets_the_first_cached_free_blocks(vllm_implementation):
    pool = vllm_implementation.block_pool(4, "lru")
    a, b, c = pool.allocate(3)
    pool.register(a, "ha")
    pool.register(c, "hc")
    pool.release([a, b, c])
    assert pool.snapshot().free_queue == (b, 3, a, c)
    assert pool.lookup("ha") == a  # free, still cached: vLLM evicts only when it hands the block out
    assert pool.evict(1) == [a]
    assert (pool.lookup("ha"), pool.lookup("hc")) == (None, c)


@needs_vllm
def test_vllm_trusts_its_caller_with_a_double_free(vllm_implementation):
    """What the caller-contract tier reports: vLLM does not check a release against the count."""
    assert vllm_implementation.conventions.trusts_caller
    pool = vllm_implementation.block_pool(2, "lru")
    [block] = pool.allocate(1)
    pool.release([block])
    pool.release([block])
    assert pool.refcount(block) == -1


# -- SGLang's RadixCache ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_implementation():
    from kvspec.adapters import sglang

    return sglang.factory()


@needs_sglang
def test_sglang_evicts_whole_leaves(sglang_implementation):
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2, 3, 4, 5], [10, 20, 30, 40, 50])
    cache.insert([1, 2, 3, 7, 8], [10, 20, 30, 70, 80])
    assert cache.evict(1) == (50, 40)  # the least recently used leaf, whole, deepest token first
    assert cache.total_size() == 5


@needs_sglang
def test_sglang_locks_handles_and_the_root_is_a_no_op(sglang_implementation):
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2, 3], [10, 20, 30])
    cache.lock([9])  # nothing cached: the handle is the root
    assert cache.protected_size() == 0
    cache.lock([1, 2, 5])  # the node where the longest cached prefix [1, 2] ends, split off
    assert (cache.protected_size(), cache.snapshot().locks) == (2, {(1, 2): 1})
    assert cache.evict(3) == (30,)


@needs_sglang
def test_sglang_page_size_is_passed_through():
    from kvspec.adapters import sglang

    implementation = sglang.factory_with_page_size(4)()
    assert implementation.conventions.radix.page_size == 4
    cache = implementation.radix_cache()
    assert cache.engine.page_size == 4
    cache.insert(list(range(6)), list(range(100, 106)))  # whole pages only
    assert cache.match_prefix(list(range(6))) == (100, 101, 102, 103)


@needs_sglang
def test_sglang_stamps_a_new_leaf_after_the_walk(sglang_implementation):
    """The sequence that showed the model stamping a new leaf with its walk (spec.radix_cache, insert)."""
    cache = sglang_implementation.radix_cache()
    cache.insert([0, 0], [0, 1])
    cache.lock([0, 0])
    cache.insert([0, 1, 1, 0, 0, 0], [2, 3, 4, 5, 6, 7])
    cache.insert([0, 1, 0, 0], [8, 9, 10, 11])  # splits [1, 1, 0, 0, 0] and adds the newer leaf [0, 0] beside it
    cache.match_prefix([0])
    assert cache.evict(1) == (7, 6, 5, 4)


@needs_sglang
def test_sglang_extra_keys_keep_equal_tokens_apart(sglang_implementation):
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2], [10, 20], "lora-a")
    assert cache.match_prefix([1, 2]) == () and cache.match_prefix([1, 2], "lora-b") == ()
    assert cache.match_prefix([1, 2], "lora-a") == (10, 20)
    assert cache.snapshot().values == {(("lora-a", 1),): 10, (("lora-a", 1), ("lora-a", 2)): 20}


@needs_sglang
def test_sglang_trusts_its_caller_with_an_unlock_underflow(sglang_implementation):
    """What the caller-contract tier reports: an unmatched unlock makes the next lock protect nothing."""
    assert sglang_implementation.conventions.trusts_caller
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2], [10, 20])
    cache.unlock([1, 2])
    cache.lock([1, 2])
    assert cache.protected_size() == 0
    assert cache.evict(2) == (20, 10)  # a locked request's KV, freed


# -- the published verdicts (docs/engines.md: kvspec engines kvspec.adapters.vllm:factory kvspec.adapters.sglang:factory)


def caller_contract_operations(verdict) -> set[str]:
    return {v.operation for v in verdict.violations if v.tier == "caller contract"}


def held_safety_rules(verdict, layer: str) -> set[str]:
    return {r.invariant for r in verdict.rules if r.tier == "safety" and r.layer == layer and r.verdict == "held"}


@needs_vllm
def test_vllm_verdict_safety_held_five_caller_contract_findings():
    from kvspec.conformance import run_conformance

    verdict = run_conformance("kvspec.adapters.vllm:factory", layers=["block pool"], profile="ci")
    assert verdict.conforms, str(verdict)
    assert not [v for v in verdict.violations if v.tier != "caller contract"], str(verdict)
    assert caller_contract_operations(verdict) == {"allocate", "evict", "register", "release", "share"}
    assert all(v.leads_to for v in verdict.violations), "each finding says what it leads to, measured"
    pool_safety = {r.invariant for r in verdict.rules if r.tier == "safety" and r.layer == "block_pool"}
    assert held_safety_rules(verdict, "block_pool") == pool_safety and pool_safety


@needs_sglang
def test_sglang_verdict_safety_held_three_caller_contract_findings():
    from kvspec.conformance import run_conformance

    verdict = run_conformance("kvspec.adapters.sglang:factory", layers=["radix"], profile="ci")
    assert verdict.conforms, str(verdict)
    assert not [v for v in verdict.violations if v.tier != "caller contract"], str(verdict)
    assert caller_contract_operations(verdict) == {"evict", "insert", "unlock"}
    assert all(v.leads_to for v in verdict.violations), "each finding says what it leads to, measured"
    radix_safety = {r.invariant for r in verdict.rules if r.tier == "safety" and r.layer == "radix_cache"}
    assert held_safety_rules(verdict, "radix_cache") == radix_safety and radix_safety


@needs_sglang
def test_sglang_verdict_with_pages_of_two_tokens():
    """Pages drawn from the declared page size: keys cut to whole pages, matched and evicted page by page."""
    from kvspec.adapters import sglang
    from kvspec.conformance import run_conformance

    verdict = run_conformance(sglang.factory_with_page_size(2), layers=["radix cache"], profile="ci")
    assert verdict.conventions.radix.page_size == 2
    assert verdict.conforms, str(verdict)
    assert not [v for v in verdict.violations if v.tier != "caller contract"], str(verdict)
    assert caller_contract_operations(verdict) <= {"evict", "insert", "unlock"}
