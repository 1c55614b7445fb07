"""The lecture's prefix-cache figures (``experiments/prefix_cache.py``), asserted as computed."""

from __future__ import annotations

from kvspec.experiments.prefix_cache import few_shot
from kvspec.spec.implementation import Implementation
from kvspec.spec.prefix_cache import PrefixCachingManager


def test_lecture_exercise_7_few_shot_savings(kv_implementation: Implementation) -> None:
    """Lecture §14 exercise 7 (exact): 8 requests, 5-shot prefix of 341 tokens, 20-token questions, B = 16:
    536 of 2,888 prefill tokens computed (81 % saved).  A partial tail block is never a hit.

    Run on the implementation under test's prefix-caching manager: the figure holds for any conforming cache.
    """

    def manager(capacity: int, block_size: int) -> PrefixCachingManager:
        return kv_implementation.prefix_caching_manager(kv_implementation.block_pool(capacity, "lru"), block_size)

    result = few_shot("exercise 7", 341, [20] * 8, 16, manager)
    assert (result.computed, result.without_cache) == (536, 2888)
    assert round(100 * result.saved) == 81
