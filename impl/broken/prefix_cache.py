"""Broken prefix caches: each breaks one rule of ``kvspec.spec.prefix_cache`` or ``kvspec.spec.radix_cache``.

Every factory returns an ``Implementation`` whose pool, prefix-caching manager
or radix cache is a small subclass of the reference; the meta-tests name the
invariant that catches each one.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.impl import reference
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import ROOT, BlockHash, hash_block
from kvspec.impl.prefix_caching import PrefixCachingBlockManager
from kvspec.impl.radix_cache import Node, RadixCache
from kvspec.spec.block_manager import check_tokens
from kvspec.spec.implementation import Implementation
from kvspec.spec.prefix_cache import ExtraKey, max_hit_blocks


class StaleEntryAfterReallocation(BlockPool):
    """Handing out a cached block clears the block's hash but leaves the map naming it."""

    def _forget(self, block: int) -> None:
        self._hashes[block] = None


class EvictsEagerly(BlockPool):
    """Every allocation first forgets all free cached blocks, needed or not."""

    def allocate(self, n: int) -> list[int]:
        if isinstance(n, int) and 0 < n <= len(self._free):
            self.evict(len(self._free))
        return super().allocate(n)


class UnchainedHash(PrefixCachingBlockManager):
    """Hashes each block on its own: equal blocks after different prefixes collide."""

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(ROOT, tokens, extra_key)


class IgnoresExtraKeys(PrefixCachingBlockManager):
    """Leaves the extra key out of the hash: another adapter's KV is reused."""

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(parent, tokens, None)


class CountsHitsPastFirstMiss(PrefixCachingBlockManager):
    """Reports every cached block of the prompt as a hit, even after a miss."""

    def _cached_tokens(self, prompt: Sequence[int], extra_key: ExtraKey, hits: Sequence[int]) -> int:
        hashes = self.block_hashes(prompt, extra_key)[: max_hit_blocks(len(prompt), self._block_size)]
        return sum(self._block_size for h in hashes if self._pool.lookup(h) is not None)


class LookupTouchesLRU(PrefixCachingBlockManager):
    """A read-only lookup touches what it finds: a use for LFU, the MRU end for LRU if free."""

    def cached_prefix(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        hits = super().cached_prefix(tokens, extra_key)
        self._pool.share(hits)
        self._pool.release(hits)
        return hits

    def _hits(self, prompt: Sequence[int], extra_key: ExtraKey) -> tuple[int, ...]:
        untouched = super().cached_prefix(prompt, extra_key)
        return untouched[: max_hit_blocks(len(prompt), self._block_size)]


class RadixEvictsLockedPaths(RadixCache):
    """Ignores lock counts when choosing leaves to evict (SGLang's ``lock_ref`` skipped)."""

    def _evictable(self, node: Node) -> bool:
        return True


class RadixMatchIsNotAUse(RadixCache):
    """A match does not refresh last use, so eviction order follows inserts only."""

    def match_prefix(self, key: Sequence[int]) -> tuple[int, ...]:
        path = self._walk(check_tokens(key, allow_empty=True))
        return tuple(v for node in path for v in node.values)


def _with(name: str, **components: object) -> Implementation:
    return Implementation(name=name, block_pool=components.pop("block_pool", reference().block_pool), **components)


def stale_entry_after_reallocation() -> Implementation:
    return _with("broken: stale hash-map entry after reallocation", block_pool=StaleEntryAfterReallocation)


def evicts_eagerly() -> Implementation:
    return _with("broken: evicts cached blocks before they are needed", block_pool=EvictsEagerly)


def unchained_hash() -> Implementation:
    return _with("broken: unchained block hash", prefix_caching_manager=UnchainedHash)


def ignores_extra_keys() -> Implementation:
    return _with("broken: extra keys ignored", prefix_caching_manager=IgnoresExtraKeys)


def counts_hits_past_first_miss() -> Implementation:
    return _with("broken: hits counted past the first miss", prefix_caching_manager=CountsHitsPastFirstMiss)


def lookup_touches_lru() -> Implementation:
    return _with("broken: LRU touched by a lookup", prefix_caching_manager=LookupTouchesLRU)


def radix_evicts_locked_paths() -> Implementation:
    return _with("broken: radix cache evicts locked paths", radix_cache=RadixEvictsLockedPaths)


def radix_match_is_not_a_use() -> Implementation:
    return _with("broken: radix match does not refresh LRU", radix_cache=RadixMatchIsNotAUse)
