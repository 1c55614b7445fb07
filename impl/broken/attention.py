"""Broken paged KV caches: each breaks one rule of ``kvspec.spec.paged_attention`` and must be caught.

Each keeps the reference block manager -- so every manager invariant still
holds -- and breaks only what the KV storage or the attention does with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from kvspec.impl.attention import OnlineState, PagedLayerKV, merge_block
from kvspec.impl.block_manager import BlockManager
from kvspec.impl.broken import members
from kvspec.impl.paged_kv import PagedKVCache
from kvspec.spec.block_manager import SeqId
from kvspec.spec.paged_attention import KVShape, invariant_paged_equals_contiguous

cache = members("paged_kv_cache", "paged attention logits")  # a member: its paged KV cache, and what catches it


class CopyOnWriteSkipsKV(PagedKVCache):
    """The manager copies the block, the KV store does not: the copy holds stale K and V."""

    def _copy_blocks(self, copies: object) -> None:
        return None


cow_skips_kv_copy = cache(
    "copy-on-write skips the KV copy",
    CopyOnWriteSkipsKV,
    invariant_paged_equals_contiguous,
    also=[(invariant_paged_equals_contiguous, "paged attention: hits, swap, recompute")],
)


class ReadsStaleBlockTable(PagedKVCache):
    """Remembers each sequence's table from its first read and only ever appends to it."""

    def __init__(self, manager: BlockManager, shape: KVShape) -> None:
        super().__init__(manager, shape)
        self._remembered: dict[SeqId, tuple[int, ...]] = {}

    def read(self, seq: SeqId, layer: int) -> PagedLayerKV:
        view = super().read(seq, layer)
        known = self._remembered.get(seq, ())
        self._remembered[seq] = known + view.table[len(known) :]
        return attrs.evolve(view, table=self._remembered[seq])


reads_stale_block_table = cache(
    "attention reads a stale block table", ReadsStaleBlockTable, invariant_paged_equals_contiguous
)


def merge_without_rescale(state: OnlineState, scores: np.ndarray, values: np.ndarray) -> OnlineState:
    """Online softmax that forgets to rescale earlier blocks by e^(m - m') when the maximum grows."""
    running_max, running_sum, output = state
    pretended_max = np.maximum(running_max, scores.max(axis=-1))
    return merge_block((pretended_max, running_sum, output), scores, values)


class SoftmaxWithoutRescale(PagedKVCache):
    merge = staticmethod(merge_without_rescale)


softmax_without_rescale = cache(
    "online softmax without the rescale", SoftmaxWithoutRescale, invariant_paged_equals_contiguous
)


class SwapPairsSortedBlocks(PagedKVCache):
    """Swap batches its copies as two sorted index lists, losing which source block goes to which destination.

    The manager's mapping pairs blocks in order of first use; sorting each side is right only while that order
    is ascending on both devices -- true for a fresh pool, false once frees and evictions have shuffled them.
    """

    def move_sequences(self, dst: PagedKVCache, seqs: Sequence[SeqId]) -> tuple[tuple[int, int], ...]:
        mapping = self.manager.move_sequences(dst.manager, seqs)
        sources, destinations = sorted(s for s, _ in mapping), sorted(d for _, d in mapping)
        for layer in range(self.shape.num_layers):
            dst._keys[layer][destinations] = self._keys[layer][sources]
            dst._values[layer][destinations] = self._values[layer][sources]
        return mapping


swap_pairs_sorted_blocks = cache(
    "swap pairs sorted source and destination blocks",
    SwapPairsSortedBlocks,
    also=[
        (invariant_paged_equals_contiguous, "paged attention: hits, swap, recompute"),
        (invariant_paged_equals_contiguous, "scheduler: paged = contiguous logits"),
    ],
)
