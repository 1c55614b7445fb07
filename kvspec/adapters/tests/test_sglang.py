"""SGLang's ``RadixCache`` through ``kvspec.adapters.sglang``: what the adapter maps, and SGLang's verdict.

Skipped unless SGLang imports (``kvspec/adapters/install-engines.sh``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (kvspec/adapters/install-engines.sh)")

from kvspec.adapters import sglang  # noqa: E402  (after the skip)
from kvspec.adapters.tests.verdicts import caller_contract_operations, held_safety_rules  # noqa: E402
from kvspec.conformance import run_conformance  # noqa: E402
from kvspec.spec.implementation import Implementation  # noqa: E402


@pytest.fixture(scope="module")
def sglang_implementation() -> Implementation:
    return sglang.factory()


def test_sglang_evicts_whole_leaves(sglang_implementation: Implementation) -> None:
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2, 3, 4, 5], [10, 20, 30, 40, 50])
    cache.insert([1, 2, 3, 7, 8], [10, 20, 30, 70, 80])
    assert cache.evict(1) == (50, 40)  # the least recently used leaf, whole, deepest token first
    assert cache.total_size() == 5


def test_sglang_locks_handles_and_the_root_is_a_no_op(sglang_implementation: Implementation) -> None:
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2, 3], [10, 20, 30])
    cache.lock([9])  # nothing cached: the handle is the root
    assert cache.protected_size() == 0
    cache.lock([1, 2, 5])  # the node where the longest cached prefix [1, 2] ends, split off
    assert (cache.protected_size(), cache.snapshot().locks) == (2, {(1, 2): 1})
    assert cache.evict(3) == (30,)


def test_sglang_page_size_is_passed_through() -> None:

    implementation = sglang.factory_with_page_size(4)()
    assert implementation.conventions.radix.page_size == 4
    cache: Any = implementation.radix_cache()  # the adapter's own cache: its engine shows
    assert cache.engine.page_size == 4
    cache.insert(list(range(6)), list(range(100, 106)))  # whole pages only
    assert cache.match_prefix(list(range(6))) == (100, 101, 102, 103)


def test_sglang_stamps_a_new_leaf_after_the_walk(sglang_implementation: Implementation) -> None:
    """The sequence that showed the model stamping a new leaf with its walk (spec.radix_cache, insert)."""
    cache = sglang_implementation.radix_cache()
    cache.insert([0, 0], [0, 1])
    cache.lock([0, 0])
    cache.insert([0, 1, 1, 0, 0, 0], [2, 3, 4, 5, 6, 7])
    cache.insert([0, 1, 0, 0], [8, 9, 10, 11])  # splits [1, 1, 0, 0, 0] and adds the newer leaf [0, 0] beside it
    cache.match_prefix([0])
    assert cache.evict(1) == (7, 6, 5, 4)


def test_sglang_extra_keys_keep_equal_tokens_apart(sglang_implementation: Implementation) -> None:
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2], [10, 20], "lora-a")
    assert cache.match_prefix([1, 2]) == () and cache.match_prefix([1, 2], "lora-b") == ()
    assert cache.match_prefix([1, 2], "lora-a") == (10, 20)
    assert cache.snapshot().values == {(("lora-a", 1),): 10, (("lora-a", 1), ("lora-a", 2)): 20}


def test_sglang_trusts_its_caller_with_an_unlock_underflow(sglang_implementation: Implementation) -> None:
    """What the caller-contract tier reports: an unmatched unlock makes the next lock protect nothing."""
    assert sglang_implementation.conventions.trusts_caller
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2], [10, 20])
    cache.unlock([1, 2])
    cache.lock([1, 2])
    assert cache.protected_size() == 0
    assert cache.evict(2) == (20, 10)  # a locked request's KV, freed


def test_sglang_verdict_safety_held_three_caller_contract_findings() -> None:
    verdict = run_conformance("kvspec.adapters.sglang:factory", titled=["radix"], profile="ci")
    assert verdict.conforms, str(verdict)
    assert not [v for v in verdict.violations if v.tier != "caller contract"], str(verdict)
    assert caller_contract_operations(verdict) == {"evict", "insert", "unlock"}
    assert all(v.leads_to for v in verdict.violations), "each finding says what it leads to, measured"
    radix_safety = {r.invariant for r in verdict.rules if r.tier == "safety" and r.layer == "radix_cache"}
    assert held_safety_rules(verdict, "radix_cache") == radix_safety and radix_safety


def test_sglang_verdict_with_pages_of_two_tokens() -> None:
    """Pages drawn from the declared page size: keys cut to whole pages, matched and evicted page by page."""
    verdict = run_conformance(sglang.factory_with_page_size(2), titled=["radix cache"], profile="ci")
    assert verdict.conventions.radix.page_size == 2
    assert verdict.conforms, str(verdict)
    assert not [v for v in verdict.violations if v.tier != "caller contract"], str(verdict)
    assert caller_contract_operations(verdict) <= {"evict", "insert", "unlock"}


def test_sglang_lock_is_its_schedulers_match_then_inc_lock_ref(sglang_implementation: Implementation) -> None:
    """The adapter calls what SGLang's scheduler calls: a lock matches (splitting where the match ends, inside
    ``match_prefix``) and locks the node returned; an unlock only decrements.  Neither splits on its own."""
    cache: Any = sglang_implementation.radix_cache()
    cache.insert([1, 2, 3], [10, 20, 30])
    calls: list[str] = []
    for name in ("match_prefix", "_split_node", "inc_lock_ref", "dec_lock_ref"):
        setattr(cache.engine, name, noting(calls, name, getattr(cache.engine, name)))
    cache.lock([1, 2])
    cache.unlock([1, 2])
    assert calls == ["match_prefix", "_split_node", "inc_lock_ref", "dec_lock_ref"]


def test_sglang_lock_marks_the_path_as_a_match_does(sglang_implementation: Implementation) -> None:
    """A lock is a match first: locking (and unlocking) [1, 2] makes it newer than [3, 4], inserted after it."""
    cache = sglang_implementation.radix_cache()
    cache.insert([1, 2], [10, 20])
    cache.insert([3, 4], [30, 40])
    cache.lock([1, 2])
    cache.unlock([1, 2])
    assert cache.evict(1) == (40, 30)


def noting(calls: list[str], name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, noting its ``name`` in ``calls`` at each call."""

    def call(*args: Any) -> Any:
        calls.append(name)
        return method(*args)

    return call
