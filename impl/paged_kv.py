"""Paged KV storage driven by a block manager, and the contiguous twin it must agree with.

``PagedKVCache`` keeps, per layer, one key and one value array of shape
``[num_blocks, B, kv_heads, head_dim]`` indexed by the pool's physical block
numbers.  It never decides where anything goes: it asks its block manager and
mirrors the copy-on-write copies of each ``WritePlan`` before any new K or V is
written.  ``ContiguousKVCache`` keeps each sequence's K and V in arrays of its
own, the layout paging replaces, and is the oracle of
``invariant_paged_equals_contiguous``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from kvspec.impl.attention import ContiguousLayerKV, Merge, PagedLayerKV, merge_block
from kvspec.spec.block_manager import BlockManager, SeqId, WritePlan, check_tokens
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.paged_attention import KVShape, slot_of

# Attention reads tiles of about TILE_TOKENS positions of TILE_SEQUENCES sequences.  Sized for the checks,
# not for speed: with small blocks a tile folds several blocks at once, the conformance machines' sequences
# (tens of positions) span several tiles and their batches (up to a beam and its children) several groups
# of sequences, so they check all three of ``online_softmax_attention``'s steps: the fold within a tile,
# the rescale across tiles (formula (4)), and the groups the decode kernel splits a batch into.
TILE_TOKENS = 8
TILE_SEQUENCES = 2


def _check_kv(shape: KVShape, layer: int, keys: np.ndarray, values: np.ndarray, length: int) -> None:
    if not 0 <= layer < shape.num_layers:
        raise InvalidOperation(f"layer {layer} does not exist (0..{shape.num_layers - 1})")
    expected = (len(keys), shape.kv_heads, shape.head_dim)
    if keys.shape != expected or values.shape != expected or len(keys) > length:
        raise InvalidOperation(f"K {keys.shape} / V {values.shape} do not fit {expected} within {length} positions")


class PagedKVCache:
    """K and V in physical blocks, addressed through ``manager``'s block tables."""

    merge: Merge = staticmethod(merge_block)

    def __init__(self, manager: BlockManager, shape: KVShape) -> None:
        self._manager = manager
        self._shape = shape
        blocks = (manager.pool.capacity, manager.block_size, shape.kv_heads, shape.head_dim)
        self._keys = [np.zeros(blocks) for _ in range(shape.num_layers)]
        self._values = [np.zeros(blocks) for _ in range(shape.num_layers)]
        # Kept here rather than read back through the manager: a decode step asks for lengths often.
        self._lengths: dict[SeqId, int] = {}
        self._tile_blocks = max(1, TILE_TOKENS // manager.block_size)

    @property
    def manager(self) -> BlockManager:
        return self._manager

    @property
    def shape(self) -> KVShape:
        return self._shape

    def sequences(self) -> tuple[SeqId, ...]:
        return self._manager.sequences()

    def length(self, seq: SeqId) -> int:
        if seq not in self._lengths:
            self._manager.block_table(seq)  # the manager's own error for an unknown sequence
        return self._lengths[seq]

    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> int:
        plan = self._manager.add_sequence(seq, prompt)
        self._lengths[seq] = len(prompt)
        self._copy_blocks(plan.copies)
        return plan.cached_tokens

    def append(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan:
        plan = self._manager.append(seq, tokens)
        self._lengths[seq] += len(tokens)
        self._copy_blocks(plan.copies)
        return plan

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self._manager.fork(parent, child)
        self._lengths[child] = self._lengths[parent]
        # a manager that copies a block at the fork (a partial last block, say) hands the child a fresh block:
        # its K and V are the parent's
        self._copy_blocks([(p, c) for p, c in zip(self._table(parent), self._table(child), strict=False) if p != c])

    def free(self, seq: SeqId) -> None:
        self._manager.free(seq)
        self._lengths.pop(seq, None)  # a manager that trusts its caller frees an unknown sequence as a no-op

    def write(self, seq: SeqId, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        table, length = self._table(seq), self.length(seq)
        _check_kv(self._shape, layer, keys, values, length)
        slots = [slot_of(table, p, self._manager.block_size) for p in range(length - len(keys), length)]
        blocks, offsets = np.asarray(slots, dtype=np.int64).reshape(-1, 2).T
        self._keys[layer][blocks, offsets] = keys
        self._values[layer][blocks, offsets] = values

    def read(self, seq: SeqId, layer: int) -> PagedLayerKV:
        if not 0 <= layer < self._shape.num_layers:
            raise InvalidOperation(f"layer {layer} does not exist (0..{self._shape.num_layers - 1})")
        table = self._table(seq)
        return PagedLayerKV(
            self._keys[layer],
            self._values[layer],
            table,
            self.length(seq),
            self.merge,
            self._tile_blocks,
            TILE_SEQUENCES,
        )

    def move_sequences(self, dst: PagedKVCache, seqs: Sequence[SeqId]) -> tuple[tuple[int, int], ...]:
        if dst.shape != self._shape:
            raise InvalidOperation(f"cannot move KV of shape {self._shape} into a cache of shape {dst.shape}")
        mapping = self._manager.move_sequences(dst.manager, seqs)
        for seq in seqs:
            dst._lengths[seq] = self._lengths.pop(seq)
        for layer in range(self._shape.num_layers):
            for source, destination in mapping:
                dst._keys[layer][destination] = self._keys[layer][source]
                dst._values[layer][destination] = self._values[layer][source]
        return mapping

    def _table(self, seq: SeqId) -> tuple[int, ...]:
        return self._manager.block_table(seq)

    def _copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write, in every layer, before the write lands in the copy."""
        for source, destination in copies:
            for layer in range(self._shape.num_layers):
                self._keys[layer][destination] = self._keys[layer][source]
                self._values[layer][destination] = self._values[layer][source]


class ContiguousKVCache:
    """Each sequence's K and V in arrays of its own; fork copies them whole."""

    def __init__(self, shape: KVShape) -> None:
        self._shape = shape
        self._keys: dict[SeqId, list[np.ndarray]] = {}
        self._values: dict[SeqId, list[np.ndarray]] = {}

    @property
    def shape(self) -> KVShape:
        return self._shape

    def sequences(self) -> tuple[SeqId, ...]:
        return tuple(self._keys)

    def length(self, seq: SeqId) -> int:
        return len(self._live(seq)[0])

    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> int:
        prompt = check_tokens(prompt, allow_empty=False)
        if not isinstance(seq, Hashable) or seq in self._keys:
            raise InvalidOperation(f"sequence {seq!r} already exists")
        empty = (0, self._shape.kv_heads, self._shape.head_dim)
        self._keys[seq] = [np.zeros(empty) for _ in range(self._shape.num_layers)]
        self._values[seq] = [np.zeros(empty) for _ in range(self._shape.num_layers)]
        self.append(seq, prompt)
        return 0

    def append(self, seq: SeqId, tokens: Sequence[int]) -> None:
        tokens = check_tokens(tokens, allow_empty=True)
        self._live(seq)
        room = np.zeros((len(tokens), self._shape.kv_heads, self._shape.head_dim))
        self._keys[seq] = [np.concatenate([k, room]) for k in self._keys[seq]]
        self._values[seq] = [np.concatenate([v, room]) for v in self._values[seq]]

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self._live(parent)
        if not isinstance(child, Hashable) or child in self._keys:
            raise InvalidOperation(f"sequence {child!r} already exists")
        self._keys[child] = [k.copy() for k in self._keys[parent]]
        self._values[child] = [v.copy() for v in self._values[parent]]

    def free(self, seq: SeqId) -> None:
        self._live(seq)
        del self._keys[seq], self._values[seq]

    def write(self, seq: SeqId, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        length = self.length(seq)
        _check_kv(self._shape, layer, keys, values, length)
        self._keys[seq][layer][length - len(keys) :] = keys
        self._values[seq][layer][length - len(keys) :] = values

    def read(self, seq: SeqId, layer: int) -> ContiguousLayerKV:
        keys = self._live(seq)
        if not 0 <= layer < self._shape.num_layers:
            raise InvalidOperation(f"layer {layer} does not exist (0..{self._shape.num_layers - 1})")
        return ContiguousLayerKV(keys[layer], self._values[seq][layer])

    def _live(self, seq: SeqId) -> list[np.ndarray]:
        try:
            return self._keys[seq]
        except (KeyError, TypeError):
            raise InvalidOperation(f"sequence {seq!r} does not exist (never added, or freed)") from None
