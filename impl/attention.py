"""Attention over a contiguous KV array, and over KV blocks through block tables (formula (4)).

Queries have ``heads`` heads; keys and values have ``kv_heads`` (grouped-query
attention: query head ``h`` reads KV head ``h // (heads // kv_heads)``).

``contiguous_attention`` is the oracle: one softmax over a sequence's keys.
Every other path runs ``online_softmax_attention``, formula (4)'s online
softmax folded one tile at a time, a tile being a few blocks' worth of
positions of a group of sequences, so that its Python loop turns once per
tile, never per block or per sequence.  Where a tile's K and V come from is
the only thing the paths change: ``block_tiles`` gathers them through block
tables, from blocks in the paged cache's layout (for the ragged forward of
``paged_attention`` and the decode kernel ``paged_decode_attention``), and
``contiguous_decode_attention`` slices them out of contiguous arrays -- so a
paged decode costs a contiguous one plus the gather, and the gather copies
whole blocks, each one contiguous run of memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import numpy as np

from kvspec.spec.errors import InvalidOperation
from kvspec.spec.paged_attention import LayerKV

OnlineState = tuple[np.ndarray, np.ndarray, np.ndarray]  # running max, running sum, running output
Merge = Callable[[OnlineState, np.ndarray, np.ndarray], OnlineState]
# read_tile(first, lo, hi): the K and V ``[kv_heads, hi - lo, tokens, d]`` of positions first, first + 1, ...
# of the batch's sequences lo .. hi - 1; valid until the next tile is read.
ReadTile = Callable[[int, int, int], tuple[np.ndarray, np.ndarray]]
Layout = Literal["head_major", "cache"]  # of a decode kernel's blocks: see paged_decode_attention

# The decode kernel's tiles: 8 blocks (128 positions at B = 16) of as many sequences as keep a tile of K
# within TILE_BYTES.  Larger tiles fall out of cache before both products have read them, smaller ones
# cost more Python steps; these were the fastest bench.bench_attention measured (head_dim 128, float32).
DECODE_TILE_BLOCKS = 8
TILE_BYTES = 1 << 20


def _grouped(queries: np.ndarray, kv_heads: int) -> np.ndarray:
    """[n, heads, d] -> [n, kv_heads, heads_per_kv_head, d]."""
    n, heads, dim = queries.shape
    return queries.reshape(n, kv_heads, heads // kv_heads, dim)


def contiguous_attention(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
    """Causal softmax attention; query i sits at position start + i of keys [length, kv_heads, d]."""
    grouped = _grouped(queries, keys.shape[1])
    # [n, g, q, d] @ [g, d, length] and, below, [n, g, q, length] @ [g, length, d]: a matrix product per KV head
    scores = grouped @ keys.transpose(1, 2, 0) / np.sqrt(keys.shape[-1])
    visible = np.arange(keys.shape[0])[None, :] <= (start + np.arange(len(queries)))[:, None]
    scores = np.where(visible[:, None, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ values.transpose(1, 0, 2)).reshape(queries.shape)


def merge_block(state: OnlineState, scores: np.ndarray, values: np.ndarray) -> OnlineState:
    """Fold one tile into the online softmax: rescale what came before by e^(m - m').

    ``scores`` ``[..., rows, tokens]``, ``values`` ``[..., tokens, d]``; the state's arrays are
    ``[..., rows]``, ``[..., rows]`` and ``[..., rows, d]``.
    """
    running_max, running_sum, output = state
    new_max = np.maximum(running_max, scores.max(axis=-1))
    safe_max = np.where(np.isfinite(new_max), new_max, 0.0)  # rows that have seen no key yet
    rescale = np.exp(running_max - safe_max)
    weights = np.exp(scores - safe_max[..., None])
    running_sum = running_sum * rescale + weights.sum(axis=-1)
    output = output * rescale[..., None] + np.matmul(weights, values)
    return new_max, running_sum, output


def online_softmax_attention(
    grouped: np.ndarray,
    query_positions: np.ndarray,
    read_tile: ReadTile,
    tile_tokens: int,
    tile_sequences: int,
    merge: Merge = merge_block,
) -> np.ndarray:
    """Causal attention of a whole batch, folded tile by tile into the online softmax of formula (4).

    ``grouped`` ``[kv_heads, sequences, rows, d]`` holds each sequence's queries scaled by 1/sqrt(d), row
    ``w * heads_per_kv_head + h`` being the ``h``-th query head on that KV head of query ``w``; ``query_positions``
    ``[sequences, queries]`` are the queries' positions, and a query sees the keys at its position and
    before.  A tile is ``tile_tokens`` positions of ``tile_sequences`` sequences: the batch goes through
    in groups of that many sequences, each group from its first position to its last.  Answers the
    attention outputs in ``grouped``'s shape.
    """
    outputs = np.empty_like(grouped)
    for lo in range(0, grouped.shape[1], tile_sequences):
        rows = slice(lo, lo + tile_sequences)
        outputs[:, rows] = _fold_tiles(grouped[:, rows], query_positions[rows], read_tile, lo, tile_tokens, merge)
    return outputs


def _fold_tiles(
    grouped: np.ndarray, query_positions: np.ndarray, read_tile: ReadTile, lo: int, tile_tokens: int, merge: Merge
) -> np.ndarray:
    """``online_softmax_attention`` for the group of sequences that starts at row ``lo`` of the batch."""
    count = grouped.shape[1]
    heads_per_kv_head = grouped.shape[2] // query_positions.shape[1]
    # A tile reads the group's leading sequences up to the last one that still has keys in it: sequence i
    # runs to the furthest end of any sequence from i on, so a batch ordered longest first loses no work.
    reach = np.maximum.accumulate(query_positions.max(axis=1)[::-1])[::-1] + 1
    # The earliest query of the leading sequences: a tile needs the causal mask only when it holds a later key.
    earliest = np.minimum.accumulate(query_positions.min(axis=1))
    state: OnlineState = (
        np.full(grouped.shape[:-1], -np.inf, grouped.dtype),
        np.zeros(grouped.shape[:-1], grouped.dtype),
        np.zeros_like(grouped),
    )
    outputs = np.empty_like(grouped)
    running = count
    for first in range(0, int(reach[0]), tile_tokens):
        still = int(np.count_nonzero(reach > first))
        if still < running:
            _, running_sum, output = state
            outputs[:, still:running] = output[:, still:] / running_sum[:, still:, :, None]
            state = (state[0][:, :still], running_sum[:, :still], output[:, :still])
            running = still
        keys, values = read_tile(first, lo, lo + running)
        scores = np.matmul(grouped[:, :running], keys.swapaxes(-1, -2))
        last = first + keys.shape[-2]
        if earliest[running - 1] < last - 1:
            visible = np.arange(first, last) <= query_positions[:running, :, None]
            scores = np.where(np.repeat(visible, heads_per_kv_head, axis=1), scores, -np.inf)
        state = merge(state, scores, values)
    _, running_sum, output = state
    outputs[:, :running] = output / running_sum[..., None]
    return outputs


def _padded_tables(
    tables: Sequence[Sequence[int]], lengths: np.ndarray, block_size: int, tile_blocks: int
) -> np.ndarray:
    """``[sequences, columns]``: each table's blocks that hold its ``length`` positions, then block 0 up to a
    whole number of tiles (padding the attention masks, since it lies past every position)."""
    needed = -(-lengths // block_size)
    columns = -(-int(needed.max()) // tile_blocks) * tile_blocks
    padded = np.zeros((len(tables), columns), dtype=np.int64)
    for row, (table, used) in enumerate(zip(tables, needed, strict=True)):
        if len(table) < used:
            raise InvalidOperation(f"a table of {len(table)} blocks cannot hold {lengths[row]} positions")
        padded[row, :used] = table[:used]
    return padded


def block_tiles(
    key_blocks: np.ndarray, value_blocks: np.ndarray, tables: np.ndarray, tile_blocks: int, tile_sequences: int
) -> ReadTile:
    """Tiles of ``tile_blocks`` columns of ``tables`` ``[sequences, columns]``, gathered through the tables,
    of ``tile_sequences`` sequences at most, from blocks in the paged cache's layout ``[num_blocks, B,
    kv_heads, d]``.

    A block is one contiguous run of ``B * kv_heads * d`` values, so a gather copies whole blocks (streamed
    as fast as a contiguous copy, where a block's rows of one KV head alone, a few KiB apart, are not); a
    tile is handed over as a view ``[kv_heads, sequences, tokens, d]``, whose rows of one KV head are evenly
    strided, as the matrix products take them without a copy.  Every tile lands in the same two buffers,
    which stay in cache while both products read them.
    """
    num_blocks, block_size, kv_heads, dim = key_blocks.shape
    if tables.min() < 0 or tables.max() >= num_blocks:
        raise InvalidOperation(f"block tables name blocks outside 0..{num_blocks - 1}")
    # np.take would copy a strided pool whole on every tile; this copies it once, and only if strided.
    key_blocks, value_blocks = np.ascontiguousarray(key_blocks), np.ascontiguousarray(value_blocks)
    tile_elements = min(len(tables), tile_sequences) * tile_blocks * block_size * kv_heads * dim
    key_buffer, value_buffer = np.empty(tile_elements, key_blocks.dtype), np.empty(tile_elements, value_blocks.dtype)

    def gather(blocks: np.ndarray, buffer: np.ndarray, columns: np.ndarray) -> np.ndarray:
        tile = buffer[: columns.size * blocks[0].size].reshape(columns.shape + blocks.shape[1:])
        blocks.take(columns, axis=0, out=tile, mode="clip")  # checked above; "raise" copies out again
        # [sequences, blocks, B, kv_heads, d] -> [kv_heads, sequences, blocks * B, d]
        return tile.transpose(3, 0, 1, 2, 4).reshape(kv_heads, len(columns), -1, dim)

    def read(first: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        column = first // block_size
        columns = tables[lo:hi, column : column + tile_blocks]
        return gather(key_blocks, key_buffer, columns), gather(value_blocks, value_buffer, columns)

    return read


def paged_attention(
    queries: Sequence[np.ndarray],
    key_blocks: np.ndarray,
    value_blocks: np.ndarray,
    tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    merge: Merge = merge_block,
    tile_blocks: int = 1,
    tile_sequences: int = 1,
) -> list[np.ndarray]:
    """Causal attention for a ragged batch through block tables.

    ``queries[s]`` is ``[n_s, heads, d]`` at positions ``starts[s] .. starts[s] + n_s - 1``
    of sequence ``s``, whose K and V fill the first ``starts[s] + n_s`` slots
    of the blocks ``tables[s]`` of ``key_blocks``/``value_blocks`` ``[num_blocks, B, kv_heads, d]``;
    a tile is ``tile_blocks`` blocks of ``tile_sequences`` sequences.
    """
    block_size, kv_heads, dim = key_blocks.shape[1:]
    counts = np.asarray([len(q) for q in queries])
    lengths = np.asarray(starts) + counts
    order = np.argsort(-lengths, kind="stable")  # longest first: see online_softmax_attention
    widest, heads = int(counts.max()), queries[0].shape[1]
    # Short sequences are padded with zero queries at their last position: they see keys, and are dropped.
    padded = np.zeros((len(queries), widest, heads, dim), dtype=np.result_type(*queries))
    for row, s in enumerate(order):
        padded[row, : counts[s]] = queries[s]
    positions = np.minimum(np.asarray(starts)[order, None] + np.arange(widest)[None, :], lengths[order, None] - 1)
    grouped = padded.reshape(len(queries), widest, kv_heads, heads // kv_heads, dim) / np.sqrt(dim)
    grouped = grouped.transpose(2, 0, 1, 3, 4).reshape(kv_heads, len(queries), -1, dim)
    padded_tables = _padded_tables([tables[s] for s in order], lengths[order], block_size, tile_blocks)
    read = block_tiles(key_blocks, value_blocks, padded_tables, tile_blocks, tile_sequences)
    outputs = online_softmax_attention(grouped, positions, read, tile_blocks * block_size, tile_sequences, merge)
    outputs = outputs.reshape(kv_heads, len(queries), widest, -1, dim).transpose(1, 2, 0, 3, 4)
    by_sequence = dict(zip(order.tolist(), outputs.reshape(len(queries), widest, heads, dim), strict=True))
    return [by_sequence[s][: counts[s]] for s in range(len(queries))]


@attrs.frozen(eq=False)
class ContiguousLayerKV:
    """A sequence's K and V at one layer as two arrays ``[length, kv_heads, d]``."""

    keys: np.ndarray
    values: np.ndarray

    @property
    def length(self) -> int:
        return len(self.keys)

    def attend(self, queries: np.ndarray, start: int) -> np.ndarray:
        return contiguous_attention(queries, self.keys, self.values, start)


@attrs.frozen(eq=False)
class PagedLayerKV:
    """A sequence's K and V at one layer: the layer's block arrays and the sequence's table."""

    key_blocks: np.ndarray
    value_blocks: np.ndarray
    table: tuple[int, ...]
    length: int
    merge: Merge = merge_block
    tile_blocks: int = 1
    tile_sequences: int = 1

    def attend(self, queries: np.ndarray, start: int) -> np.ndarray:
        return attend_ragged([self], [queries], [start])[0]


def attend_ragged(views: Sequence[LayerKV], queries: Sequence[np.ndarray], starts: Sequence[int]) -> list[np.ndarray]:
    """Attention for a whole batch: one ``paged_attention`` call per layer of shared block arrays."""
    results: dict[int, np.ndarray] = {}
    groups: dict[tuple[int, int, Merge, int, int], list[tuple[int, PagedLayerKV]]] = {}
    for i, view in enumerate(views):
        if isinstance(view, PagedLayerKV):
            key = (id(view.key_blocks), id(view.value_blocks), view.merge, view.tile_blocks, view.tile_sequences)
            groups.setdefault(key, []).append((i, view))
        else:
            results[i] = view.attend(queries[i], starts[i])
    for members in groups.values():
        first = members[0][1]
        outputs = paged_attention(
            [queries[i] for i, _ in members],
            first.key_blocks,
            first.value_blocks,
            [view.table for _, view in members],
            [starts[i] for i, _ in members],
            first.merge,
            first.tile_blocks,
            first.tile_sequences,
        )
        for (i, _), out in zip(members, outputs, strict=True):
            results[i] = out
    return [results[i] for i in range(len(views))]


def decode_tile_sequences(kv_heads: int, tile_tokens: int, dim: int, itemsize: int) -> int:
    """How many sequences one decode tile spans: as many as keep its K within ``TILE_BYTES``."""
    return max(1, TILE_BYTES // (kv_heads * tile_tokens * dim * itemsize))


def _decode(
    queries: np.ndarray, kv_heads: int, lengths: np.ndarray, read: ReadTile, tile_tokens: int, tile_sequences: int
) -> np.ndarray:
    """One query ``[heads, d]`` per sequence at position ``length - 1``, over the tiles ``read`` gives."""
    count, heads, dim = queries.shape
    if lengths.min() < 1:
        raise InvalidOperation(f"a decode query needs at least one position, got lengths {lengths.tolist()}")
    grouped = (_grouped(queries, kv_heads) / np.sqrt(queries.dtype.type(dim))).swapaxes(0, 1)
    outputs = online_softmax_attention(grouped, lengths[:, None] - 1, read, tile_tokens, tile_sequences)
    return outputs.swapaxes(0, 1).reshape(count, heads, dim)


def paged_decode_attention(
    queries: np.ndarray,
    key_blocks: np.ndarray,
    value_blocks: np.ndarray,
    tables: Sequence[Sequence[int]],
    lengths: Sequence[int],
    chunk_blocks: int = DECODE_TILE_BLOCKS,
    *,
    layout: Layout = "head_major",
) -> np.ndarray:
    """Batched decode (one query ``[heads, d]`` per sequence) through block tables, for speed.

    The blocks are head-major, ``[kv_heads, num_blocks, B, d]`` (the spec states the kernel so), or, with
    ``layout="cache"``, in the paged cache's own layout ``[num_blocks, B, kv_heads, d]``: the fast one,
    which ``block_tiles`` gathers a whole block at a time.  Head-major blocks are put in the cache's layout
    first (one copy of the pool), so that both layouts run one path.  A tile is ``chunk_blocks`` table
    columns of ``decode_tile_sequences`` sequences, to stay in cache while both products read it.
    """
    if layout == "head_major":
        key_blocks, value_blocks = (np.ascontiguousarray(np.moveaxis(b, 0, 2)) for b in (key_blocks, value_blocks))
    _, block_size, kv_heads, dim = key_blocks.shape
    tile_tokens = chunk_blocks * block_size
    tile_sequences = decode_tile_sequences(kv_heads, tile_tokens, dim, key_blocks.itemsize)
    lengths_array = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths_array, kind="stable")  # longest first: see online_softmax_attention
    sorted_lengths = lengths_array[order]
    padded_tables = _padded_tables([tables[s] for s in order], sorted_lengths, block_size, chunk_blocks)
    read = block_tiles(key_blocks, value_blocks, padded_tables, chunk_blocks, tile_sequences)
    outputs = np.empty_like(queries)
    outputs[order] = _decode(queries[order], kv_heads, sorted_lengths, read, tile_tokens, tile_sequences)
    return outputs


def contiguous_decode_attention(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    lengths: Sequence[int],
    chunk_tokens: int = 256,
    tile_sequences: int = 8,
) -> np.ndarray:
    """The same computation on contiguous ``[sequences, kv_heads, max_length, d]`` arrays: tiles are slices.

    The default tiles are the fastest measured for this side: slices gather nothing, so they may be larger.
    """

    def read(first: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        window = slice(first, first + chunk_tokens)
        return keys[lo:hi, :, window].swapaxes(0, 1), values[lo:hi, :, window].swapaxes(0, 1)

    lengths_array = np.asarray(lengths, dtype=np.int64)
    return _decode(queries, keys.shape[1], lengths_array, read, chunk_tokens, tile_sequences)
