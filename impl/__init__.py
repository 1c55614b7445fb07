"""The reference implementation of kvspec (imports only ``spec``'s protocols and errors)."""

from __future__ import annotations

from impl.block_manager import BlockManager
from impl.block_pool import BlockPool
from impl.paged_kv import PagedKVCache
from impl.prefix_caching import PrefixCachingBlockManager
from impl.radix_cache import RadixCache
from impl.scheduler import Scheduler
from spec.implementation import Implementation


def reference() -> Implementation:
    """The reference implementation: the default under test."""
    return Implementation(
        name="kvspec reference",
        block_pool=BlockPool,
        block_manager=BlockManager,
        paged_kv_cache=PagedKVCache,
        prefix_caching_manager=PrefixCachingBlockManager,
        radix_cache=RadixCache,
        scheduler=Scheduler,
    )
