"""The conformance suite: every machine, by layer, in the order a report lists them.

Machines are named by ``module:class`` and imported only when run, after the
implementation under test has been selected.
"""

from __future__ import annotations

import importlib

from kvspec.properties.harness import LockstepMachine

MACHINES: tuple[tuple[str, str], ...] = (
    ("block pool", "kvspec.properties.test_block_pool:BlockPoolMachine"),
    ("block pool (1,024 blocks)", "kvspec.properties.test_block_pool:RealisticBlockPoolMachine"),
    ("block manager", "kvspec.properties.test_block_manager:BlockManagerMachine"),
    ("block manager (512 blocks of 16)", "kvspec.properties.test_block_manager:RealisticBlockManagerMachine"),
    ("prefix cache", "kvspec.properties.test_prefix_cache:PrefixCacheMachine"),
    ("prefix cache (realistic)", "kvspec.properties.test_prefix_cache:RealisticPrefixCacheMachine"),
    ("prefix cache (deferred commit)", "kvspec.properties.test_prefix_cache:DeferredCommitMachine"),
    ("radix cache", "kvspec.properties.test_radix_cache:RadixCacheMachine"),
    ("sliding-window tables", "kvspec.properties.test_sliding_window:SlidingWindowMachine"),
    ("radix = chained hash", "kvspec.properties.test_radix_cache:RadixAgreesWithChainedHashMachine"),
    ("radix pages (SGLang's page manager)", "kvspec.properties.test_radix_pages:RadixPagesMachine"),
    ("paged attention logits", "kvspec.properties.test_paged_attention:PagedAttentionMachine"),
    (
        "paged attention: hits, swap, recompute",
        "kvspec.properties.test_paged_attention_lifecycle:PagedLifecycleMachine",
    ),
    ("scheduler (recompute)", "kvspec.properties.test_scheduler:SchedulerMachine"),
    ("scheduler (swap)", "kvspec.properties.test_scheduler:SwapSchedulerMachine"),
    ("scheduler deadlock freedom", "kvspec.properties.test_scheduler:DeadlockFreedomMachine"),
    ("scheduler over the prefix cache", "kvspec.properties.test_scheduler:CachedSchedulerMachine"),
    ("scheduler (priority)", "kvspec.properties.test_scheduler:PrioritySchedulerMachine"),
    ("scheduler: paged = contiguous logits", "kvspec.properties.test_scheduler_logits:PagedLogitsSchedulerMachine"),
    ("token-budget scheduler (vLLM v1's shape)", "kvspec.properties.test_scheduler_v1:TokenBudgetMachine"),
    ("token-budget scheduler (priority)", "kvspec.properties.test_scheduler_v1:PriorityTokenBudgetMachine"),
    ("contiguous allocators", "kvspec.properties.test_contiguous:ContiguousMachine"),
    ("contiguous allocators (A100, 12,596 slots)", "kvspec.properties.test_contiguous:A100ContiguousMachine"),
    ("tiered KV store (node faults)", "kvspec.properties.test_kv_store:KVStoreMachine"),
    ("tiered swap (partial swap-in)", "kvspec.properties.test_tiered_swap:TieredSwapMachine"),
    ("hierarchical radix cache (HiCache)", "kvspec.properties.test_hierarchical_radix:HierarchicalRadixMachine"),
)


def load_machine(path: str) -> type[LockstepMachine]:
    module_name, _, attribute = path.partition(":")
    machine: type[LockstepMachine] = getattr(importlib.import_module(module_name), attribute)
    return machine


def machine_titled(title: str) -> type[LockstepMachine]:
    """The machine listed under ``title``."""
    paths = dict(MACHINES)
    if title not in paths:
        raise KeyError(f"no machine titled {title!r}; the suite has {sorted(paths)}")
    return load_machine(paths[title])
