"""Layer 5 -- paged KV storage and blockwise attention: paging moves the KV, never the result.

Rules (vLLM §4.1-4.3, lecture §4.1-4.2 and §5.1-5.2):

* Every layer keeps its keys and its values in physical blocks, one array each
  of shape ``[num_blocks, B, kv_heads, head_dim]``: block ``b`` of the array is
  physical block ``b`` of the block pool.  The block manager's tables say where
  a sequence's KV lives: position ``p`` of a sequence is slot ``p mod B`` of
  block ``table[p div B]`` (``slot_of`` below).
* The storage mirrors the manager, operation for operation.  A write follows
  the manager's ``WritePlan``: first every ``(source, destination)`` of
  ``copies`` is copied block-wise, in every layer, for keys and values
  (copy-on-write); then the new tokens' K and V go to ``slots`` -- the slots
  of the sequence's last positions, as its updated table places them.  ``fork``
  shares (copies nothing); ``free`` releases (clears nothing -- the slots are
  dead once the pool has them back); ``move_sequences`` copies each
  ``(source, destination)`` block the manager's swap returns.
* The ragged forward of a model needs exactly three things of a cache
  (``KVCache``): ``length(seq)``, the positions it holds; ``write(seq, layer,
  keys, values)``, the K and V of the sequence's last ``len(keys)`` positions
  at ``layer``; ``read(seq, layer)``, a view of all of them that can
  ``attend``.  A paged cache and a contiguous one both offer it, so the same
  forward runs on both; positions enter the cache through ``SequenceStore``'s
  ``add_sequence`` / ``append`` before the forward writes their K and V.
* Attention over blocks is the paper's formula (4).  For query ``q_i`` and the
  key and value blocks ``K_j``, ``V_j`` of its sequence (``d`` = head_dim)::

      A_ij = exp(q_i K_j^T / sqrt(d)) / sum_t exp(q_i K_t^T / sqrt(d)) 1
      o_i  = sum_j A_ij V_j

  Computed block by block with an online softmax: a running maximum ``m``, a
  running denominator ``l`` and a running output ``o``; on block ``j``,
  ``m' = max(m, max_j)``, ``l' = l e^(m - m') + sum e^(s_j - m')`` and
  ``o' = o e^(m - m') + e^(s_j - m') V_j``.  Dropping the rescale ``e^(m - m')``
  is a classic bug: it is exact only while the first block holds the maximum.
* A step may fold a *tile* -- blocks ``j .. j+k-1`` of the table at once, ``s``
  and ``V`` their scores and values side by side, ``max`` over all of them --
  and this is still formula (4), the same ``m``, ``l`` and ``o`` as ``k``
  single-block steps: by induction on ``k``, after ``i`` steps
  ``m_i = max(m, max over blocks j..j+i-1)``, ``l_i = l e^(m - m_i) + sum
  e^(s - m_i)`` and ``o_i = o e^(m - m_i) + sum e^(s - m_i) V`` over those
  blocks, because step ``i`` multiplies everything before it by
  ``e^(m_(i-1) - m_i)`` and these rescales telescope to ``e^(m - m_i)``; at
  ``i = k`` that is the tile's update.  Only the floating-point rounding
  differs, far inside the tolerance below.  Sequences, their queries and the
  KV heads are independent rows of this arithmetic, so one step may fold a
  tile of many sequences; a key past a query's position (causality, a
  sequence that ends inside the tile, a table padded to whole tiles) gets
  score ``-inf`` and weight 0 -- formula (4) over that query's own keys -- and
  a sequence whose keys all precede a tile need not take part in it.

Theory of operation: no state machine of its own -- the block manager's model
(``kvspec.spec.block_manager``) is the state, and this layer adds one obligation:
whatever sequence of prefills, decodes, forks with copy-on-write, beam
re-forks, frees, prefix hits and swap round trips ran, the logits computed
through a paged cache equal those computed through a contiguous twin that
simply keeps every sequence's K and V in one array.

``Implementation.paged_kv_cache(manager, shape)`` takes a
``kvspec.spec.block_manager.BlockManager`` and a ``KVShape`` and returns a
``PagedKVCache`` that stores KV for that manager's pool.  The yardstick the
properties measure it with comes through the same record, from the reference
unless replaced: ``tiny_model(vocab=, d_model=, heads=, kv_heads=, layers=,
mlp=, seed=)`` returns a model with ``config.kv_shape`` and ``forward(cache,
batch)`` (the logits of each batch entry); ``contiguous_kv_cache(shape)``
returns the contiguous twin (``KVCache`` and ``SequenceStore``); and
``decode_attention(queries, key_blocks, value_blocks, tables, lengths,
chunk_blocks)`` is the batched decode kernel -- one query ``[heads, d]`` per
sequence, at position ``length - 1``, over head-major blocks ``[kv_heads,
num_blocks, B, d]``, folding tiles of ``chunk_blocks`` blocks -- whose outputs
must equal formula (4).

Invariants:

* ``invariant_paged_equals_contiguous`` [safety] -- max |logits_paged - logits_contiguous|
  <= 1e-12 in float64, for every step, every sequence and every block size.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, Self, runtime_checkable

import attrs
import numpy as np
from numpy.typing import NDArray

from kvspec.spec.block_manager import BlockManager, SeqId, WritePlan
from kvspec.spec.components import component_kind, optional_operation
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import invariant

Array = NDArray[np.float64]  # keys, values, queries and logits: float arrays

LOGITS_TOLERANCE = 1e-12


@attrs.frozen
class KVShape:
    """What one position stores: K and V of ``kv_heads`` heads of ``head_dim`` in ``num_layers`` layers."""

    num_layers: int
    kv_heads: int
    head_dim: int

    def __attrs_post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOperation(f"{name} must be a positive int, got {value!r}")


def slot_of(table: Sequence[int], position: int, block_size: int) -> tuple[int, int]:
    """Where position ``position`` of a sequence lives: (physical block, offset in it)."""
    if not 0 <= position < len(table) * block_size:
        raise InvalidOperation(f"position {position} is outside a table of {len(table)} blocks of {block_size}")
    return table[position // block_size], position % block_size


class LayerKV(Protocol):
    """One sequence's K and V at one layer, as ``read`` returns it."""

    @property
    def length(self) -> int: ...
    def attend(self, queries: Array, start: int) -> Array:
        """Causal attention of ``queries`` ``[n, heads, head_dim]`` at positions ``start..start+n-1``."""
        ...


@runtime_checkable
class KVCache(Protocol):
    """What a ragged batched forward needs of a cache: length, write, read."""

    def length(self, seq: SeqId) -> int: ...
    def write(self, seq: SeqId, layer: int, keys: Array, values: Array) -> None: ...
    def read(self, seq: SeqId, layer: int) -> LayerKV: ...


@runtime_checkable
class SequenceStore(Protocol):
    """How positions enter and leave a cache; both caches mirror the block manager's operations."""

    def sequences(self) -> tuple[SeqId, ...]: ...
    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> int:
        """Admit a prompt; answers how many leading positions already hold K and V (a prefix hit)."""
        ...

    def append(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan | None:
        """Extend a sequence; a paged cache answers the manager's plan (its copy-on-write copies)."""
        ...

    def fork(self, parent: SeqId, child: SeqId) -> None: ...
    def free(self, seq: SeqId) -> None: ...


@runtime_checkable
class SequenceCache(KVCache, SequenceStore, Protocol):
    """A cache whose sequences come and go: the contiguous yardstick (``contiguous_kv_cache(shape)``)."""


@runtime_checkable
class PagedKVCache(SequenceCache, Protocol):
    """KV in physical blocks, driven by a block manager whose tables it reads."""

    @property
    def manager(self) -> BlockManager: ...
    @property
    def shape(self) -> KVShape: ...
    def move_sequences(self, dst: Self, seqs: Sequence[SeqId]) -> tuple[tuple[int, int], ...]: ...


class Model(Protocol):
    """The yardstick model (``tiny_model(**sizes)``): seeded weights, a ragged batched forward over any cache."""

    @property
    def config(self) -> object: ...
    def forward(self, cache: KVCache, batch: Sequence[tuple[SeqId, Sequence[int]]]) -> list[Array]:
        """Logits ``[len(tokens), vocab]`` for each ``(seq, tokens)``, whose K and V are already in ``cache``."""
        ...


PAGED_KV_CACHE = component_kind("paged_kv_cache", PagedKVCache, builds="paged_kv_cache(manager, shape)")
FORK = optional_operation("fork", PagedKVCache, "fork", kinds=(PAGED_KV_CACHE.name,))
SWAP = optional_operation("swap", PagedKVCache, "move_sequences", kinds=(PAGED_KV_CACHE.name,))
TINY_MODEL = component_kind("tiny_model", Model, builds="tiny_model(**sizes)")
CONTIGUOUS_KV_CACHE = component_kind("contiguous_kv_cache", SequenceCache, builds="contiguous_kv_cache(shape)")
DECODE_ATTENTION = component_kind(  # a kernel: a function, no methods
    "decode_attention",
    None,
    builds="decode_attention(queries, key_blocks, value_blocks, tables, lengths, chunk_blocks)",
    module=__name__,
)


def max_abs_difference(paged: Sequence[Array], contiguous: Sequence[Array]) -> float:
    """max |a - b| over a batch of logits arrays, 0.0 for an empty batch."""
    return max((float(np.max(np.abs(a - b))) for a, b in zip(paged, contiguous, strict=True) if a.size), default=0.0)


@invariant(
    "paging may change where KV lives, never what attention computes: paged logits equal contiguous ones",
    "safety",
)
def invariant_paged_equals_contiguous(
    batch: Sequence[Hashable], paged: Sequence[Array], contiguous: Sequence[Array]
) -> str | None:
    """``paged[i]`` and ``contiguous[i]`` are the logits of batch entry ``batch[i]`` in float64."""
    if len(paged) != len(contiguous) or any(a.shape != b.shape for a, b in zip(paged, contiguous, strict=False)):
        return f"logits shapes differ: {[a.shape for a in paged]} vs {[b.shape for b in contiguous]}"
    for seq, a, b in zip(batch, paged, contiguous, strict=True):
        worst = float(np.max(np.abs(a - b))) if a.size else 0.0
        if not worst <= LOGITS_TOLERANCE:
            return f"sequence {seq!r}: max |logits difference| {worst:.3e} > {LOGITS_TOLERANCE:.0e}"
    return None
