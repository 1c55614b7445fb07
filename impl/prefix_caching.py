"""The reference prefix-caching block manager (spec.prefix_cache).

A subclass of the reference ``BlockManager``: admission looks the prompt's
chained hashes up in the pool's hash map and shares the leading run of hits;
``_block_filled`` registers each block under its hash the moment it fills.
Each sequence keeps the hashes of its full blocks, so a fill hashes one block
(chained on the previous hash) instead of the whole prefix.  Under
``commit="after_forward"`` a filled block's (block, hash) waits in its
sequence's pending list until ``commit``; ``free`` drops the list (an abort).
``rollback`` forgets the hashes and pending entries of the blocks no longer
full; a partial last block that still carries a hash is copied before the
next write (spec.speculative).  Whether a block is cached is read off the
pool's snapshot, never off ``lookup``: a pool that keeps duplicate hashes
(``duplicate_hash="keep"``, vLLM's) caches a block ``lookup`` does not name.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvspec.impl.block_manager import BlockManager, checked_tokens
from kvspec.impl.hashing import ROOT, BlockHash, hash_block
from kvspec.spec.block_manager import SeqId, WritePlan, blocks_for
from kvspec.spec.block_pool import BlockPool as BlockPoolProtocol
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.prefix_cache import COMMITS, Commit, ExtraKey, check_extra_key, max_hit_blocks


class PrefixCachingBlockManager(BlockManager):
    """Block tables whose full blocks are cached in the pool under chained hashes."""

    def __init__(self, pool: BlockPoolProtocol, block_size: int, commit: Commit = "on_fill") -> None:
        super().__init__(pool, block_size)
        if commit not in COMMITS:
            raise InvalidOperation(f"unknown commit point {commit!r}; choose from {COMMITS}")
        self._commit_on_fill = commit == "on_fill"
        self._extra_keys: dict[SeqId, ExtraKey] = {}
        self._chains: dict[SeqId, list[BlockHash]] = {}
        self._pending: dict[SeqId, list[tuple[int, BlockHash]]] = {}
        # the last prompt hashed: admission hashes its prompt for the chain and again for the hits (``_hits``, a
        # hook), and a scheduler probes ``cached_prefix`` before it admits the same prompt
        self._last_hashed: tuple[tuple[int, ...], ExtraKey, tuple[BlockHash, ...]] = ((), None, ())
        self._admitted: tuple[SeqId, tuple[BlockHash, ...]] | None = None  # the sequence whose prompt is written

    def block_hashes(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[BlockHash, ...]:
        tokens, extra_key = checked_tokens(tokens, allow_empty=True), check_extra_key(extra_key)
        last_tokens, last_key, last_hashes = self._last_hashed
        if tokens == last_tokens and extra_key == last_key:
            return last_hashes
        size, parent, hashes, hash_ = self._block_size, ROOT, [], self._hash
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash_(parent, tokens[start : start + size], extra_key)
            hashes.append(parent)
        self._last_hashed = (tokens, extra_key, tuple(hashes))
        return self._last_hashed[2]

    def cached_prefix(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        hits, lookup = [], self._pool.lookup
        for block_hash in self.block_hashes(tokens, extra_key):
            block = lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return tuple(hits)

    def evict(self, n: int) -> list[int]:
        return self._pool.evict(n)

    def add_sequence(self, seq: SeqId, prompt: Sequence[int], extra_key: ExtraKey = None) -> WritePlan:
        prompt, extra_key = checked_tokens(prompt, allow_empty=False), check_extra_key(extra_key)
        self._require_new(seq)
        hashes = self.block_hashes(prompt, extra_key)
        hits = self._hits(prompt, extra_key)
        refcount = self._pool.refcount
        revived = sum(1 for block in hits if refcount(block) == 0)
        needed, room = blocks_for(len(prompt), self._block_size) - len(hits), self._pool.num_free() - revived
        if needed > room:
            raise OutOfBlocks(needed, room)
        self._pool.share(hits)
        cached = len(hits) * self._block_size
        self._tables[seq], self._tokens[seq] = list(hits), list(prompt[:cached])
        self._extra_keys[seq], self._chains[seq] = extra_key, list(hashes[: len(hits)])
        self._admitted = (seq, hashes)
        try:
            plan = self._write(seq, prompt[cached:])
        finally:
            self._admitted = None
        return attrs.evolve(plan, cached_tokens=self._cached_tokens(prompt, extra_key, hits))

    def fork(self, parent: SeqId, child: SeqId) -> None:
        super().fork(parent, child)
        self._extra_keys[child], self._chains[child] = self._extra_keys[parent], list(self._chains[parent])
        self._pending[child] = list(self._pending.get(parent, ()))

    def free(self, seq: SeqId) -> None:
        super().free(seq)
        del self._extra_keys[seq], self._chains[seq]
        self._pending.pop(seq, None)

    def commit(self, seq: SeqId) -> None:
        self._table(seq)
        pending = self._pending.pop(seq, ())
        if pending:
            carried = self._pool.snapshot().block_hashes  # a fork's sibling may have committed a block already
            for block, block_hash in pending:
                if carried[block] is None:
                    self._pool.register(block, block_hash)

    def rollback(self, seq: SeqId, n: int) -> None:
        super().rollback(seq, n)
        table, full = self._tables[seq], len(self._tokens[seq]) // self._block_size
        del self._chains[seq][full:]
        if seq in self._pending:
            verified = set(table[:full])
            self._pending[seq] = [(block, block_hash) for block, block_hash in self._pending[seq] if block in verified]

    def move_sequences(self, dst: BlockManager, seqs: Sequence[SeqId]) -> tuple[tuple[int, int], ...]:
        keys = {seq: (self._extra_keys.get(seq), list(self._chains.get(seq, []))) for seq in seqs}
        copies = super().move_sequences(dst, seqs)
        if isinstance(dst, PrefixCachingBlockManager):
            for seq, (extra_key, chain) in keys.items():
                dst._extra_keys[seq], dst._chains[seq] = extra_key, chain
        return copies

    # -- hooks for the zoo's variations ----------------------------------------------

    def _hash(self, parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey) -> BlockHash:
        return hash_block(parent, tokens, extra_key)

    def _hits(self, prompt: Sequence[int], extra_key: ExtraKey) -> tuple[int, ...]:
        return self.cached_prefix(prompt, extra_key)[: max_hit_blocks(len(prompt), self._block_size)]

    def _cached_tokens(self, prompt: Sequence[int], extra_key: ExtraKey, hits: Sequence[int]) -> int:
        return len(hits) * self._block_size

    def _last_block_cached(self, seq: SeqId) -> bool:
        """Whether the partial last block carries a hash, whatever ``lookup`` names for it (a pool that keeps
        duplicate hashes names the first block registered).  Only a block that filled was ever registered, and
        a registered one is never written: one whose slots hold less than a block is not, and needs no look."""
        last = self._tables[seq][-1]
        if len(self._contents[last]) < self._block_size:
            return False
        return self._pool.snapshot().block_hashes[last] is not None

    def _block_filled(self, seq: SeqId, index: int) -> None:
        chain, size, admitted = self._chains[seq], self._block_size, self._admitted
        if admitted is not None and admitted[0] == seq and index < len(admitted[1]):
            block_hash = admitted[1][index]  # a block of the prompt being admitted: hashed already
        else:
            parent = chain[index - 1] if index else ROOT
            tokens = self._tokens[seq][index * size : (index + 1) * size]
            block_hash = self._hash(parent, tokens, self._extra_keys[seq])
        chain.append(block_hash)
        if self._commit_on_fill:
            self._pool.register(self._tables[seq][index], block_hash)
        else:
            self._pending.setdefault(seq, []).append((self._tables[seq][index], block_hash))
