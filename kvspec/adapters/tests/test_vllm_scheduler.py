"""vLLM's v1 ``Scheduler`` driven without a model (``kvspec.adapters.vllm_scheduler``).

Skipped unless vLLM imports.  Pins what the adapter reads off the engine (the order served, victims,
admissions and their cached tokens, the finished), and that vLLM's decisions are the ones
``kvspec.spec.scheduler_v1_model`` makes, on scenarios that chunk prefills, hit the cache and preempt.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (kvspec/adapters/install-engines.sh)")

from kvspec.adapters import vllm_scheduler as adapter  # noqa: E402
from kvspec.impl.block_pool import BlockPool  # noqa: E402
from kvspec.impl.prefix_caching import PrefixCachingBlockManager  # noqa: E402
from kvspec.impl.scheduler_v1 import BudgetScheduler  # noqa: E402
from kvspec.spec.scheduler import QueuePolicy, Request  # noqa: E402
from kvspec.spec.scheduler_v1 import BudgetConfig, view  # noqa: E402


def both(capacity: int, block_size: int, config: BudgetConfig) -> tuple[Any, BudgetScheduler]:
    """vLLM's scheduler and the reference's, each over a device of ``capacity`` blocks."""

    def manager() -> PrefixCachingBlockManager:
        return PrefixCachingBlockManager(BlockPool(capacity, "lru"), block_size)

    return adapter.VllmBudgetScheduler(manager(), config), BudgetScheduler(manager(), config)


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    engine, _ = both(8, 4, BudgetConfig(token_budget=4, max_running=2))
    engine.arrive(Request(1, range(9), max_new_tokens=2))
    assert [engine.step().served for _ in range(4)] == [((1, 4),), ((1, 4),), ((1, 1),), ((1, 1),)]
    assert engine.snapshot().finished == (1,) and engine.snapshot().memory.pool.num_free == 8


def test_an_admission_reports_the_tokens_the_cache_supplied() -> None:
    engine, _ = both(8, 2, BudgetConfig(token_budget=16, max_running=2))
    engine.arrive(Request(1, (1, 2, 3, 4, 5), max_new_tokens=1))
    engine.step()
    engine.arrive(Request(2, (1, 2, 3, 4, 9), max_new_tokens=1))
    report = engine.step()
    assert report.admitted == (2,) and report.cached_tokens == ((2, 4),) and report.served == ((2, 1),)


def test_the_last_admitted_is_preempted_by_recompute_and_nobody_is_admitted() -> None:
    engine, _ = both(4, 2, BudgetConfig(token_budget=8, max_running=3, reserve_full_sequence=False))
    for rid in (1, 2, 3):
        engine.arrive(Request(rid, (rid, rid, rid), max_new_tokens=4))
    assert engine.step().admitted == (1, 2)  # 2 + 2 blocks: request 3 waits
    assert engine.step().served == ((1, 1), (2, 1))  # token 3 of each fits its second block
    report = engine.step()  # token 4 of each needs a third block: the last admitted gives way
    assert report.preempted == (2,) and report.admitted == () and report.served == ((1, 1),)
    state = engine.snapshot()
    assert state.running == (1,) and state.waiting == (2, 3)  # the victim at the head of the queue
    assert {e.request_id: e.computed for e in state.entries}[2] == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_vllm_decides_as_the_model_does(policy: QueuePolicy) -> None:
    """Chunked prefills, hits and preemptions on a small device: vLLM's state is the reference's, step by step."""
    config = BudgetConfig(token_budget=5, max_running=3, policy=policy)
    engine, reference = both(6, 2, config)
    shared = (1, 2, 3, 4)
    for rid in range(1, 6):
        arrival = Request(rid, shared + (rid,) * (rid % 3), max_new_tokens=2 + rid % 4, priority=rid % 2)
        engine.arrive(arrival)
        reference.arrive(arrival)
    for _ in range(40):
        assert engine.step() == reference.step()
        assert view(engine.snapshot()) == view(reference.snapshot())
    assert engine.snapshot().finished == reference.snapshot().finished and not engine.snapshot().entries


def test_abort_frees_the_blocks_of_a_running_request() -> None:
    engine, _ = both(4, 2, BudgetConfig(token_budget=8, max_running=2))
    engine.arrive(Request(1, (1, 2, 3), max_new_tokens=4))
    engine.step()
    engine.abort(1)
    state = engine.snapshot()
    assert state.entries == () and state.memory.tables == {} and state.memory.pool.num_free == 4
