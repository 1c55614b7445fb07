"""Broken paged KV caches: each breaks one rule of ``spec.paged_attention`` and must be caught.

Each keeps the reference block manager -- so every manager invariant still
holds -- and breaks only what the KV storage or the attention does with it.
"""

from __future__ import annotations

import attrs
import numpy as np

from impl import reference
from impl.attention import OnlineState, PagedLayerKV, merge_block
from impl.block_manager import BlockManager
from impl.paged_kv import PagedKVCache
from spec.block_manager import SeqId
from spec.implementation import Implementation
from spec.paged_attention import KVShape


class CopyOnWriteSkipsKV(PagedKVCache):
    """The manager copies the block, the KV store does not: the copy holds stale K and V."""

    def _copy_blocks(self, copies: object) -> None:
        return None


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


def merge_without_rescale(state: OnlineState, scores: np.ndarray, values: np.ndarray) -> OnlineState:
    """Online softmax that forgets to rescale earlier blocks by e^(m - m') when the maximum grows."""
    running_max, running_sum, output = state
    pretended_max = np.maximum(running_max, scores.max(axis=-1))
    return merge_block((pretended_max, running_sum, output), scores, values)


class SoftmaxWithoutRescale(PagedKVCache):
    merge = staticmethod(merge_without_rescale)


def _with_cache(name: str, cache: type[PagedKVCache]) -> Implementation:
    return attrs.evolve(reference(), name=name, paged_kv_cache=cache)


def cow_skips_kv_copy() -> Implementation:
    return _with_cache("broken: copy-on-write skips the KV copy", CopyOnWriteSkipsKV)


def reads_stale_block_table() -> Implementation:
    return _with_cache("broken: attention reads a stale block table", ReadsStaleBlockTable)


def softmax_without_rescale() -> Implementation:
    return _with_cache("broken: online softmax without the rescale", SoftmaxWithoutRescale)
