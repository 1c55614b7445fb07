"""The reference implementation: a class per layer, and ``reference()``, the record that offers them all.

It imports nothing of kvspec but ``kvspec.spec`` (protocols, errors, and the declaration records).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvspec.impl.attention import paged_decode_attention
from kvspec.impl.block_manager import BlockManager
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.contiguous import ContiguousAllocator
from kvspec.impl.hierarchical_radix import HierarchicalRadixCache
from kvspec.impl.kv_store import KVStore
from kvspec.impl.paged_kv import ContiguousKVCache, PagedKVCache
from kvspec.impl.prefix_caching import PrefixCachingBlockManager
from kvspec.impl.radix_cache import RadixCache
from kvspec.impl.radix_pages import RadixPageManager
from kvspec.impl.scheduler import Scheduler
from kvspec.impl.scheduler_v1 import BudgetScheduler
from kvspec.impl.sliding_window import SlidingWindowManager
from kvspec.impl.tiny_model import ModelConfig, TinyModel
from kvspec.spec.components import Offer, every_operation
from kvspec.spec.implementation import Implementation


def tiny_model(**sizes: int) -> TinyModel:
    return TinyModel(ModelConfig(**sizes))


COMPONENTS: dict[str, Callable[..., Any]] = {  # every kind kvspec's layers declare
    "block_pool": BlockPool,
    "block_manager": BlockManager,
    "paged_kv_cache": PagedKVCache,
    "tiny_model": tiny_model,
    "contiguous_kv_cache": ContiguousKVCache,
    "decode_attention": paged_decode_attention,
    "contiguous_allocator": ContiguousAllocator,
    "prefix_caching_manager": PrefixCachingBlockManager,
    "radix_cache": RadixCache,
    "scheduler": Scheduler,
    "kv_store": KVStore,
    "sliding_window_manager": SlidingWindowManager,
    "radix_page_manager": RadixPageManager,
    "hierarchical_radix_cache": HierarchicalRadixCache,
    "token_budget_scheduler": BudgetScheduler,
}


def reference() -> Implementation:
    """The reference implementation: the default under test; it offers every optional operation."""
    offers = {kind: Offer(factory, every_operation(kind)) for kind, factory in COMPONENTS.items()}
    return Implementation(name="kvspec reference", components=offers)
