"""Attention over a contiguous KV array, and over KV blocks through block tables (formula (4)).

Queries have ``heads`` heads; keys and values have ``kv_heads`` (grouped-query
attention: query head ``h`` reads KV head ``h // (heads // kv_heads)``).
``paged_attention`` runs a ragged batch -- prefill chunks and decode tokens of
sequences of any length -- through their block tables, one block column at a
time, with the online softmax of ``merge_block``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import attrs
import numpy as np

from kvspec.spec.paged_attention import LayerKV

OnlineState = tuple[np.ndarray, np.ndarray, np.ndarray]  # running max, running sum, running output
Merge = Callable[[OnlineState, np.ndarray, np.ndarray], OnlineState]


def _grouped(queries: np.ndarray, kv_heads: int) -> np.ndarray:
    """[n, heads, d] -> [n, kv_heads, heads_per_kv_head, d]."""
    n, heads, dim = queries.shape
    return queries.reshape(n, kv_heads, heads // kv_heads, dim)


def contiguous_attention(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
    """Causal softmax attention; query i sits at position start + i of keys [length, kv_heads, d]."""
    grouped = _grouped(queries, keys.shape[1])
    scores = np.einsum("ngqd,lgd->ngql", grouped, keys) / np.sqrt(keys.shape[-1])
    visible = np.arange(keys.shape[0])[None, :] <= (start + np.arange(len(queries)))[:, None]
    scores = np.where(visible[:, None, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("ngql,lgd->ngqd", weights, values).reshape(queries.shape)


def merge_block(state: OnlineState, scores: np.ndarray, values: np.ndarray) -> OnlineState:
    """Fold one block into the online softmax: rescale what came before by e^(m - m')."""
    running_max, running_sum, output = state
    new_max = np.maximum(running_max, scores.max(axis=-1))
    safe_max = np.where(np.isfinite(new_max), new_max, 0.0)  # rows that have seen no key yet
    rescale = np.exp(running_max - safe_max)
    weights = np.exp(scores - safe_max[..., None])
    running_sum = running_sum * rescale + weights.sum(axis=-1)
    output = output * rescale[..., None] + np.einsum("stgqb,sbgd->stgqd", weights, values)
    return new_max, running_sum, output


def paged_attention(
    queries: Sequence[np.ndarray],
    key_blocks: np.ndarray,
    value_blocks: np.ndarray,
    tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    merge: Merge = merge_block,
) -> list[np.ndarray]:
    """Causal attention for a ragged batch through block tables.

    ``queries[s]`` is ``[n_s, heads, d]`` at positions ``starts[s] .. starts[s] + n_s - 1``
    of sequence ``s``, whose K and V fill the first ``starts[s] + n_s`` slots
    of the blocks ``tables[s]`` of ``key_blocks``/``value_blocks`` ``[num_blocks, B, kv_heads, d]``.
    """
    block_size, kv_heads, dim = key_blocks.shape[1:]
    count = len(queries)
    widest = max(len(q) for q in queries)
    heads = queries[0].shape[1]
    padded = np.zeros((count, widest, heads, dim))
    for s, q in enumerate(queries):
        padded[s, : len(q)] = q
    grouped = padded.reshape(count, widest, kv_heads, heads // kv_heads, dim) / np.sqrt(dim)
    query_positions = np.asarray(starts)[:, None] + np.arange(widest)[None, :]
    columns = max(len(t) for t in tables)
    padded_tables = np.zeros((count, columns), dtype=np.int64)
    for s, table in enumerate(tables):
        padded_tables[s, : len(table)] = table
    has_column = np.arange(columns)[None, :] < np.asarray([len(t) for t in tables])[:, None]
    state = (
        np.full(grouped.shape[:-1], -np.inf),
        np.zeros(grouped.shape[:-1]),
        np.zeros(grouped.shape),
    )
    for column in range(columns):
        blocks = padded_tables[:, column]
        keys, values = key_blocks[blocks], value_blocks[blocks]
        scores = np.einsum("stgqd,sbgd->stgqb", grouped, keys)
        key_positions = column * block_size + np.arange(block_size)
        visible = (key_positions[None, None, :] <= query_positions[:, :, None]) & has_column[:, column, None, None]
        scores = np.where(visible[:, :, None, None, :], scores, -np.inf)
        state = merge(state, scores, values)
    _, running_sum, output = state
    with np.errstate(invalid="ignore", divide="ignore"):
        result = (output / running_sum[..., None]).reshape(count, widest, heads, dim)
    return [result[s, : len(q)] for s, q in enumerate(queries)]


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

    def attend(self, queries: np.ndarray, start: int) -> np.ndarray:
        return attend_ragged([self], [queries], [start])[0]


def attend_ragged(views: Sequence[LayerKV], queries: Sequence[np.ndarray], starts: Sequence[int]) -> list[np.ndarray]:
    """Attention for a whole batch: one ``paged_attention`` call per layer of shared block arrays."""
    results: dict[int, np.ndarray] = {}
    groups: dict[tuple[int, int, Merge], list[tuple[int, PagedLayerKV]]] = {}
    for i, view in enumerate(views):
        if isinstance(view, PagedLayerKV):
            groups.setdefault((id(view.key_blocks), id(view.value_blocks), view.merge), []).append((i, view))
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
        )
        for (i, _), out in zip(members, outputs, strict=True):
            results[i] = out
    return [results[i] for i in range(len(views))]


def _decode_one(query: np.ndarray, chunks: Iterator[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """One decode query ``[heads, d]`` over head-major K/V chunks ``[kv_heads, tokens, d]``, online softmax."""
    heads, dim = query.shape
    first = next(chunks)  # a sequence has at least one token, so at least one chunk
    kv_heads = len(first[0])
    grouped = query.reshape(kv_heads, heads // kv_heads, dim) / np.sqrt(query.dtype.type(dim))
    running_max = np.full((kv_heads, heads // kv_heads, 1), -np.inf, dtype=query.dtype)
    running_sum = np.zeros_like(running_max)
    acc = np.zeros_like(grouped)
    for keys, values in itertools.chain([first], chunks):
        scores = np.matmul(grouped, keys.transpose(0, 2, 1))  # [kv_heads, group, tokens]; both BLAS-ready
        new_max = np.maximum(running_max, scores.max(axis=-1, keepdims=True))
        weights = np.exp(scores - new_max)
        rescale = np.exp(running_max - new_max)
        running_sum = running_sum * rescale + weights.sum(axis=-1, keepdims=True)
        acc = acc * rescale + np.matmul(weights, values)
        running_max = new_max
    return (acc / running_sum).reshape(heads, dim)


def paged_decode_attention(
    queries: np.ndarray,
    key_blocks: np.ndarray,
    value_blocks: np.ndarray,
    tables: Sequence[Sequence[int]],
    lengths: Sequence[int],
    chunk_blocks: int = 4,
) -> np.ndarray:
    """Batched decode (one query ``[heads, d]`` per sequence) through block tables, for speed.

    The blocks are head-major, ``[kv_heads, num_blocks, B, d]``, so that a gather of
    ``chunk_blocks`` blocks is already the ``[kv_heads, tokens, d]`` operand of the matrix
    products, and small enough to stay in cache while both products read it.
    """
    kv_heads, _, block_size, dim = key_blocks.shape

    def chunks(table: Sequence[int], length: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        used = np.asarray(table[: -(-length // block_size)])
        for first in range(0, len(used), chunk_blocks):
            blocks = used[first : first + chunk_blocks]
            tokens = min(len(blocks) * block_size, length - first * block_size)
            keys = key_blocks.take(blocks, axis=1).reshape(kv_heads, -1, dim)[:, :tokens]
            values = value_blocks.take(blocks, axis=1).reshape(kv_heads, -1, dim)[:, :tokens]
            yield keys, values

    return np.stack([_decode_one(q, chunks(t, n)) for q, t, n in zip(queries, tables, lengths, strict=True)])


def contiguous_decode_attention(
    queries: np.ndarray, keys: np.ndarray, values: np.ndarray, lengths: Sequence[int], chunk_tokens: int = 2048
) -> np.ndarray:
    """The same computation on contiguous head-major ``[sequences, kv_heads, max_length, d]`` arrays."""

    def chunks(s: int, length: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for first in range(0, length, chunk_tokens):
            last = min(first + chunk_tokens, length)
            yield keys[s, :, first:last], values[s, :, first:last]

    return np.stack([_decode_one(q, chunks(s, n)) for s, (q, n) in enumerate(zip(queries, lengths, strict=True))])
