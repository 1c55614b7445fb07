"""Broken prefix caches: each breaks a rule of ``kvspec.spec.prefix_cache`` and declares what catches it.

Every member is an ``Implementation`` whose pool or prefix-caching
manager is a small subclass of the reference.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.broken import members
from kvspec.impl.hashing import ROOT, BlockHash, hash_block
from kvspec.impl.prefix_caching import PrefixCachingBlockManager
from kvspec.spec import admission, block_manager, block_pool, speculative
from kvspec.spec import prefix_cache as spec
from kvspec.spec.block_manager import SeqId, WritePlan
from kvspec.spec.block_pool import Policy, PoolState
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.prefix_cache import Commit, ExtraKey, max_hit_blocks

# A member: its pool or its prefix-caching manager (over the reference's pool), and the rules that catch it.
pool = members("block_pool", "prefix cache")
cache = members("prefix_caching_manager", "prefix cache", block_pool=BlockPool)
deferred = members("prefix_caching_manager", "prefix cache (deferred commit)", block_pool=BlockPool)


class StaleEntryAfterReallocation(BlockPool):
    """Handing out a cached block clears the block's hash but leaves the map naming it."""

    def _forget(self, block: int) -> None:
        self._hashes[block] = None


stale_entry_after_reallocation = pool(
    "stale hash-map entry after reallocation",
    StaleEntryAfterReallocation,
    block_pool.invariant_hash_map_consistent,
    spec.invariant_hit_is_exact_prefix,
)


class EvictsEagerly(BlockPool):
    """Every allocation first forgets all free cached blocks, needed or not."""

    def allocate(self, n: int) -> list[int]:
        if isinstance(n, int) and 0 < n <= len(self._free):
            self.evict(len(self._free))
        return super().allocate(n)


evicts_eagerly = pool(
    "evicts cached blocks before they are needed", EvictsEagerly, spec.invariant_evicts_only_what_is_needed
)


class UnchainedHash(PrefixCachingBlockManager):
    """Hashes each block on its own: equal blocks after different prefixes collide."""

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(ROOT, tokens, extra_key)


unchained_hash = cache(
    "unchained block hash", UnchainedHash, spec.invariant_hash_iff_prefix, spec.invariant_hash_change_propagates
)


class IgnoresExtraKeys(PrefixCachingBlockManager):
    """Leaves the extra key out of the hash: another adapter's KV is reused."""

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(parent, tokens, None)


ignores_extra_keys = cache("extra keys ignored", IgnoresExtraKeys, spec.invariant_hash_iff_prefix)


class ExtraKeyAsText(PrefixCachingBlockManager):
    """Hashes the extra key as its fields' text run together: ("a", 1) and ("a1",), 1 and "1", encode alike."""

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(parent, tokens, _text(extra_key))


extra_key_as_text = cache("extra key hashed as its fields' text", ExtraKeyAsText, spec.invariant_hash_iff_prefix)


def _text(key: ExtraKey) -> str:
    if isinstance(key, tuple):
        return "".join(map(_text, key))
    return key.decode("latin-1") if isinstance(key, bytes) else str(key)


class TokensAsUint16(PrefixCachingBlockManager):
    """Packs token ids into 16 bits (``astype(uint16)`` wraps silently): fine for a 32k vocabulary, not a 128k one."""

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(parent, [token & 0xFFFF for token in tokens], extra_key)


tokens_as_uint16 = cache("token ids packed into 16 bits", TokensAsUint16, spec.invariant_hash_change_propagates)


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


chain_cached_on_the_buffer = cache(
    "hash chain remembered by the prompt buffer", ChainCachedOnTheBuffer, spec.invariant_hit_is_exact_prefix
)


class CommitSurvivesAbort(PrefixCachingBlockManager):
    """Keeps an aborted request's pending registrations: the next request in its slot commits them too,
    naming blocks that were freed and handed out again."""

    def free(self, seq: SeqId) -> None:
        pending = self._pending.get(seq)
        super().free(seq)
        if pending:
            self._pending[seq] = pending


commit_survives_abort = deferred(
    "a commit survives its request's abort", CommitSurvivesAbort, spec.invariant_cached_block_holds_its_prefix
)


class CountsHitsPastFirstMiss(PrefixCachingBlockManager):
    """Reports every cached block of the prompt as a hit, even after a miss."""

    def _cached_tokens(self, prompt: Sequence[int], extra_key: ExtraKey, hits: Sequence[int]) -> int:
        hashes = self.block_hashes(prompt, extra_key)[: max_hit_blocks(len(prompt), self._block_size)]
        return sum(self._block_size for h in hashes if self._pool.lookup(h) is not None)


counts_hits_past_first_miss = cache(
    "hits counted past the first miss", CountsHitsPastFirstMiss, spec.invariant_hits_stop_at_first_miss
)


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


lookup_touches_lru = cache("LRU touched by a lookup", LookupTouchesLRU, block_pool.invariant_eviction_order)


class ReadsWholeBlocksOnly(PrefixCachingBlockManager):
    """``read`` answers what the cache knows of a sequence -- its full blocks -- and drops the partial tail."""

    def read(self, seq: SeqId) -> tuple[int, ...]:
        tokens = super().read(seq)
        return tokens[: len(tokens) // self._block_size * self._block_size]


reads_whole_blocks_only = cache(
    "read drops the partial last block", ReadsWholeBlocksOnly, spec.invariant_reuse_preserves_read_back
)


class ReusesHitsOfRefusedWrite(PrefixCachingBlockManager):
    """Keeps the hits it found for an admission it refused for want of room, and shares them when the same
    sequence asks again with the same prompt and key, as a waiting request that keeps its computed blocks: if
    the cache evicted them in between, the sequence shares blocks that hold other tokens, or nothing."""

    def __init__(self, pool: Any, block_size: int, commit: Commit = "on_fill") -> None:
        super().__init__(pool, block_size, commit)
        self._hits_kept: dict[tuple[SeqId, tuple[int, ...], ExtraKey], tuple[int, ...]] = {}
        self._asking: SeqId = None  # the sequence the admission under way is for
        self._found: tuple[int, ...] = ()  # the hits it shares

    def add_sequence(self, seq: SeqId, prompt: Sequence[int], extra_key: ExtraKey = None) -> WritePlan:
        self._asking = seq
        request = (seq, tuple(prompt) if isinstance(prompt, list | tuple) else (), extra_key)
        try:
            plan = super().add_sequence(seq, prompt, extra_key)
        except OutOfBlocks:
            self._hits_kept[request] = self._found
            raise
        self._hits_kept.pop(request, None)
        return plan

    def _hits(self, prompt: Sequence[int], extra_key: ExtraKey) -> tuple[int, ...]:
        kept = self._hits_kept.get((self._asking, tuple(prompt), extra_key))
        self._found = kept if kept is not None else super()._hits(prompt, extra_key)
        return self._found


reuses_hits_of_refused_write = cache(
    "shares the hits an admission it refused found",
    ReusesHitsOfRefusedWrite,
    spec.invariant_hit_is_exact_prefix,
    block_manager.invariant_read_back_exact,
)


class ReportsFirstProbeHits(PrefixCachingBlockManager):
    """Remembers the tokens the first probe of a prompt and key found cached, and reports them in the plan of the
    admission that follows, however many attempts later -- as a request that records its cached tokens once,
    when first scheduled: a cache that changed in between makes the report stale (its tables are right)."""

    def __init__(self, pool: Any, block_size: int, commit: Commit = "on_fill") -> None:
        super().__init__(pool, block_size, commit)
        self._first_probe: dict[tuple[tuple[int, ...], ExtraKey], int] = {}

    def cached_prefix(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        hits = super().cached_prefix(tokens, extra_key)
        usable = hits[: max_hit_blocks(len(tokens), self._block_size)]
        self._first_probe.setdefault((tuple(tokens), extra_key), len(usable) * self._block_size)
        return hits

    def _cached_tokens(self, prompt: Sequence[int], extra_key: ExtraKey, hits: Sequence[int]) -> int:
        return self._first_probe.pop((tuple(prompt), extra_key), len(hits) * self._block_size)


reports_first_probe_hits = cache(
    "reports the hits of a prompt's first probe",
    ReportsFirstProbeHits,
    spec.invariant_hits_stop_at_first_miss,
    also=[(admission.invariant_hits_probed_at_admission, "scheduler over the prefix cache")],
)


class WritesIntoRolledBackBlock(PrefixCachingBlockManager):
    """After a rollback into a block the draft had filled -- registered under its hash when it filled -- the
    target's token is written into that block in place, as into any private partial block: the cached block now
    holds a token its hash does not name, and the next prompt that hits it reads that token's KV.  (vLLM v1 keeps
    draft tokens out of the blocks it caches -- ``KVCacheManager.allocate_slots`` caches up to the tokens less
    ``num_draft_tokens``, PR #18668 -- because a cached block must never be written again.)"""

    def _last_block_cached(self, seq: SeqId) -> bool:
        return False


writes_into_rolled_back_block = cache(
    "the target's token written into the cached block a rollback reached",
    WritesIntoRolledBackBlock,
    speculative.invariant_no_write_into_cached_or_shared_block,
)


class KeepsRolledBackBlockPending(PrefixCachingBlockManager):
    """A rollback truncates the tokens and the hash chain but leaves the pending list as it was: the commit after
    the verification registers a block the draft filled under the draft's hash, though it now holds the target's
    token in place of the rejected ones."""

    def rollback(self, seq: SeqId, n: int) -> None:
        pending = list(self._pending.get(seq, ()))
        super().rollback(seq, n)
        if pending:
            self._pending[seq] = pending


keeps_rolled_back_block_pending = deferred(
    "a rolled-back block stays pending", KeepsRolledBackBlockPending, spec.invariant_cached_block_holds_its_prefix
)


class KeepsDuplicateHashes(BlockPool):
    """The reference pool keeping duplicate hashes, as vLLM's ``BlockHashToBlockMap`` does: a block registered under
    a hash another block carries carries it too (``register`` answers True) and ``lookup`` names the first one
    registered.  A legal choice, which kvspec models as ``duplicate_hash="keep"``; declared as the reference's
    ``refuse``, only its answers and its hash map differ from the model's (convention findings).  Under the
    reference managers a rollback into a duplicate -- a block ``lookup`` does not name -- must still copy it
    before writing: declared, it conforms."""

    def __init__(self, capacity: int, policy: Policy = "lru") -> None:
        super().__init__(capacity, policy)
        self._later: dict[Hashable, list[int]] = {}  # hash -> the blocks carrying it after the one lookup names

    def allocate(self, n: int) -> list[int]:
        if type(n) is int and 1 < n <= self.num_free():  # one at a time: each cached block leaves through _forget
            return [block for _ in range(n) for block in super().allocate(1)]
        return super().allocate(n)

    def register_blocks(self, blocks: Sequence[int], block_hashes: Sequence[Hashable]) -> list[bool]:
        if len(blocks) != len(block_hashes):
            raise InvalidOperation(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        for done, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            refused = self._refusal(block, block_hash)
            if refused:
                for earlier in blocks[:done][::-1]:  # all or nothing
                    self._forget(earlier)
                raise InvalidOperation(refused)
            self._hashes[block] = block_hash
            if block_hash in self._cached:
                self._later.setdefault(block_hash, []).append(block)
            else:
                self._cached[block_hash] = block
        return [True] * len(blocks)

    def _refusal(self, block: int, block_hash: Hashable) -> str:
        """Why ``register(block, block_hash)`` is refused ("" when it is not)."""
        if type(block) is not int or not 0 <= block < self._capacity:
            return f"block {block!r} is not a block of this pool (0..{self._capacity - 1})"
        if block_hash is None:
            return "None is not a block hash"
        if not self._refcounts[block]:
            return f"block {block} is free: only a block in use can be registered"
        return f"block {block} is already registered" if self._hashes[block] is not None else ""

    def _forget(self, block: int) -> None:
        block_hash = self._hashes[block]
        if block_hash is None:
            return
        later = self._later.pop(block_hash, [])
        if self._cached[block_hash] != block:
            later.remove(block)
        elif later:
            self._cached[block_hash] = later.pop(0)
        else:
            del self._cached[block_hash]
        if later:
            self._later[block_hash] = later
        self._hashes[block] = None

    def snapshot(self) -> PoolState:
        cached = {block_hash: (block, *self._later.get(block_hash, ())) for block_hash, block in self._cached.items()}
        return attrs.evolve(super().snapshot(), cached=cached)


keeps_duplicate_hashes = pool(
    "a legal choice, undeclared: a pool that keeps duplicate hashes",
    KeepsDuplicateHashes,
    block_manager.invariant_manager_refines_spec,
)
