"""Broken prefix caches: each breaks a rule of ``kvspec.spec.prefix_cache`` and declares what catches it.

Every factory returns an ``Implementation`` whose pool or prefix-caching
manager is a small subclass of the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.broken import caught_by, member
from kvspec.impl.hashing import ROOT, BlockHash, hash_block
from kvspec.impl.prefix_caching import PrefixCachingBlockManager
from kvspec.spec import block_pool
from kvspec.spec import prefix_cache as spec
from kvspec.spec.block_manager import SeqId
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


class ExtraKeyAsText(PrefixCachingBlockManager):
    """Hashes the extra key as its fields' text run together: ("a", 1) and ("a1",), 1 and "1", encode alike."""

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(parent, tokens, _text(extra_key))


def _text(key: ExtraKey) -> str:
    if isinstance(key, tuple):
        return "".join(map(_text, key))
    return key.decode("latin-1") if isinstance(key, bytes) else str(key)


class TokensAsUint16(PrefixCachingBlockManager):
    """Packs token ids into 16 bits (``astype(uint16)`` wraps silently): fine for a 32k vocabulary, not a 128k one."""

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(parent, [token & 0xFFFF for token in tokens], extra_key)


class ChainCachedOnTheBuffer(PrefixCachingBlockManager):
    """Remembers a prompt's hash chain by the identity of the list it came in, as if it were the request:
    a caller that recycles the list for the next request gets the last request's hashes."""

    def __init__(self, pool: Any, block_size: int) -> None:
        super().__init__(pool, block_size)
        self._chain_of: dict[int, tuple[object, tuple[BlockHash, ...]]] = {}

    def block_hashes(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[BlockHash, ...]:
        remembered = self._chain_of.get(id(tokens))
        if remembered is not None and remembered[0] is tokens:
            return remembered[1]
        hashes = super().block_hashes(tokens, extra_key)
        if isinstance(tokens, list):
            self._chain_of[id(tokens)] = (tokens, hashes)
        return hashes


class CommitSurvivesAbort(PrefixCachingBlockManager):
    """Keeps an aborted request's pending registrations: the next request in its slot commits them too,
    naming blocks that were freed and handed out again."""

    def free(self, seq: SeqId) -> None:
        pending = self._pending.get(seq)
        super().free(seq)
        if pending:
            self._pending[seq] = pending


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


class ReadsWholeBlocksOnly(PrefixCachingBlockManager):
    """``read`` answers what the cache knows of a sequence -- its full blocks -- and drops the partial tail."""

    def read(self, seq: SeqId) -> tuple[int, ...]:
        tokens = super().read(seq)
        return tokens[: len(tokens) // self._block_size * self._block_size]


def _with(name: str, block_pool: Any = None, prefix_caching_manager: Any = None) -> Implementation:
    return member(name, block_pool=block_pool or BlockPool, prefix_caching_manager=prefix_caching_manager)


@caught_by(spec.invariant_hit_is_exact_prefix, "prefix cache")
@caught_by(block_pool.invariant_hash_map_consistent, "prefix cache")
def stale_entry_after_reallocation() -> Implementation:
    return _with("broken: stale hash-map entry after reallocation", block_pool=StaleEntryAfterReallocation)


@caught_by(spec.invariant_evicts_only_what_is_needed, "prefix cache")
def evicts_eagerly() -> Implementation:
    return _with("broken: evicts cached blocks before they are needed", block_pool=EvictsEagerly)


@caught_by(spec.invariant_hash_change_propagates, "prefix cache")
@caught_by(spec.invariant_hash_iff_prefix, "prefix cache")
def unchained_hash() -> Implementation:
    return _with("broken: unchained block hash", prefix_caching_manager=UnchainedHash)


@caught_by(spec.invariant_hash_iff_prefix, "prefix cache")
def ignores_extra_keys() -> Implementation:
    return _with("broken: extra keys ignored", prefix_caching_manager=IgnoresExtraKeys)


@caught_by(spec.invariant_hash_iff_prefix, "prefix cache")
def extra_key_as_text() -> Implementation:
    return _with("broken: extra key hashed as its fields' text", prefix_caching_manager=ExtraKeyAsText)


@caught_by(spec.invariant_hash_change_propagates, "prefix cache")
def tokens_as_uint16() -> Implementation:
    return _with("broken: token ids packed into 16 bits", prefix_caching_manager=TokensAsUint16)


@caught_by(spec.invariant_hit_is_exact_prefix, "prefix cache")
def chain_cached_on_the_buffer() -> Implementation:
    return _with("broken: hash chain remembered by the prompt buffer", prefix_caching_manager=ChainCachedOnTheBuffer)


@caught_by(spec.invariant_cached_block_holds_its_prefix, "prefix cache (deferred commit)")
def commit_survives_abort() -> Implementation:
    return _with("broken: a commit survives its request's abort", prefix_caching_manager=CommitSurvivesAbort)


@caught_by(spec.invariant_hits_stop_at_first_miss, "prefix cache")
def counts_hits_past_first_miss() -> Implementation:
    return _with("broken: hits counted past the first miss", prefix_caching_manager=CountsHitsPastFirstMiss)


@caught_by(block_pool.invariant_eviction_order, "prefix cache")
def lookup_touches_lru() -> Implementation:
    return _with("broken: LRU touched by a lookup", prefix_caching_manager=LookupTouchesLRU)


@caught_by(spec.invariant_reuse_preserves_read_back, "prefix cache")
def reads_whole_blocks_only() -> Implementation:
    return _with("broken: read drops the partial last block", prefix_caching_manager=ReadsWholeBlocksOnly)
