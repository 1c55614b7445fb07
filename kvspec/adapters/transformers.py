"""kvspec's block manager, prefix-caching manager and sliding-window manager over HF transformers' continuous batching.

    kvspec check --impl kvspec.adapters.transformers:factory
    kvspec check --impl kvspec.adapters.transformers:block_manager_factory      # or prefix_caching_factory,
                                                                              # sliding_window_factory

Tested: transformers 5.24.0.  Each component is one ``PagedAttentionCache`` of
``transformers.generation.continuous_batching.cache`` (``device="cpu"``, float32), built for
a one-layer model with one KV head of 16 dims -- a Llama config, or a Mistral config with
``sliding_window`` for the sliding-window manager, which gives a ``SlidingAttentionCacheAllocator``
-- so that a sector holds exactly one block and ``num_blocks`` is the pool's capacity.  Its one
allocator (``FullAttentionCacheAllocator`` or the sliding one), its ``CachePool`` and its
``BlockLedger`` are the state; a ``RequestState`` per sequence is the scheduler's.

One engine call (or the call sequence of one scheduler step) per operation:

* ``add_sequence`` / ``append`` -> ``can_store_request_tokens(state, n)`` (``False``:
  ``OutOfBlocks``, nothing allocated), then the forward pass's cache writes: the tokens' KV
  written at ``get_write_indices`` by the allocator's own ``update`` -- the KV is a write id
  per token that the adapter maps back to the token, so a misplaced write shows as another
  token.  ``WritePlan.slots`` are the write indices as (block, offset).
* ``read(seq)`` -> the allocator's ``update`` reading at ``get_read_indices``: the sequence as
  attention sees it.
* ``fork(parent, child)`` -> ``prepare_fork_request`` (full blocks shared, the partial last
  block given a fresh block) and ``perform_cache_copy``, as ``ContinuousBatchingProcessor``
  forks; no room: ``OutOfBlocks``.  Its ``WritePlan`` copies are none: the fork made them.
* ``free(seq)`` -> ``free_blocks(request_id)``, then ``pool.try_to_free_sectors()``, which the
  scheduler runs first thing at its next step (*emulated*: two calls).
* prefix caching: ``add_sequence`` -> ``search_prefix_match`` (at most ``(len - 1) // B``
  blocks, shared), ``count_new_complete_blocks`` before the forward and
  ``mark_complete_blocks`` after it -- at the end of the write under ``commit="on_fill"``,
  at ``commit(seq)`` under ``"after_forward"``.  ``mark_complete_blocks`` *adopts*
  duplicates: a full block whose hash another block holds is replaced in the table by that
  block, and released.  Admission is the adapter's (*emulated*): the blocks the hit leaves to
  allocate, against the free blocks -- and, when those are short, the cached ones too, all of
  which ``evict_cached_blocks`` then frees (the scheduler's ``_try_to_meet_safety_margin``
  under memory pressure).  ``evict(n)`` -> ``evict_cached_blocks()``: every cached block, not
  ``n``.  ``cached_prefix`` -> ``match_prefix_blocks`` of the tokens and one more (its cap
  lifted); ``block_hashes`` -> the chain of ``compute_block_hash``.  HF keys blocks by tokens
  alone: an admission or lookup under an extra key is refused (``InvalidOperation``), and
  ``block_hashes`` answers none for one.  Its ``fork`` is the block manager's, offered and
  judged there.
* sliding window -> the same calls on a ``SlidingAttentionCacheAllocator``, the tokens being
  positions.

Numbering: the ``CachePool`` keeps two trash sectors (0 and 1) and hands out its free
sectors from the end of ``free_sectors`` (``list.pop``), highest first; kvspec block ``b`` is
engine block ``capacity + 1 - b``, so that both hand out block 0 first.

Conventions, as read from ``continuous_batching/cache_allocators``:

* ``manager.fork_partial_block="copy"``: ``fork_blocks`` shares the first
  ``count_shareable_blocks`` (``past_length // page_size``: the full ones) and backs the
  rest -- the partial last block -- with fresh blocks that ``perform_cache_copy`` fills, so the
  child owns its copy from the fork on and no write copies later.
* ``unhashed_free_position="head"``: ``free_blocks`` returns a table's blocks to the pool in
  table order, ``try_to_free_sectors`` appends the empty sectors to ``free_sectors`` and
  ``allocate_sector`` pops from its end: the last block freed is handed out first.
* ``policies=("lru",)``: one free pool; ``lfu`` is refused.
* ``slid_out="ring"``: ``SlidingAttentionCacheAllocator._compute_blocks_needed`` caps a
  request's blocks at ``ceil(sliding_window / page_size)``, ``_token_indices_to_physical_indices``
  writes position ``p`` at ring slot ``p % sliding_window``, and nothing is freed before
  ``free_blocks``.
* ``trusts_caller=True``: the allocator extends whatever table a request id names, a free of
  an unknown id is a no-op, ``BlockLedger.release`` decrements unchecked.  The scheduler's
  ledger of requests is the adapter's: a second admission of a live sequence, or a call on one
  that is not live, is refused (``InvalidOperation``).

What HF does that no declared convention says -- a duplicate block adopted rather than left
uncached, every cached block evicted at once, cached blocks kept out of the free pool -- shows in
the verdict, each under the tier of the rule it breaks.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Hashable, Sequence
from typing import Any

from kvspec.spec.block_manager import FORK, ManagerState, SeqId, WritePlan, blocks_for
from kvspec.spec.block_pool import BlockPool, PoolState
from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions, ManagerConventions, PoolConventions, WindowConventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.prefix_cache import DEFERRED_COMMIT, ExtraKey
from kvspec.spec.sliding_window import Table, WindowState

VERSION = "5.24.0"
HEAD_DIM = 16  # with one KV head in float32, a page of B tokens is 128 * B bytes: one block per sector
CONVENTIONS = Conventions(
    pool=PoolConventions(unhashed_free_position="head", policies=("lru",)),
    manager=ManagerConventions(fork_partial_block="copy"),
    window=WindowConventions(slid_out="ring"),
    trusts_caller=True,
)


@functools.cache
def engine() -> types.SimpleNamespace:
    """transformers' continuous-batching cache and the configs it is built from."""
    import torch
    from transformers import LlamaConfig, MistralConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash
    from transformers.generation.continuous_batching.distributed import DistributedHelper
    from transformers.generation.continuous_batching.requests import RequestState

    return types.SimpleNamespace(
        torch=torch,
        LlamaConfig=LlamaConfig,
        MistralConfig=MistralConfig,
        ContinuousBatchingConfig=ContinuousBatchingConfig,
        PagedAttentionCache=PagedAttentionCache,
        DistributedHelper=DistributedHelper,
        RequestState=RequestState,
        compute_block_hash=compute_block_hash,
    )


def engine_version() -> str:
    import transformers

    return str(transformers.__version__)


def paged_cache(num_blocks: int, block_size: int, window: int | None = None) -> Any:
    """A ``PagedAttentionCache`` of ``num_blocks`` blocks of ``block_size`` tokens for a one-layer model."""
    hf = engine()
    shape = dict(
        hidden_size=HEAD_DIM,
        intermediate_size=HEAD_DIM,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        vocab_size=64,
        max_position_embeddings=1 << 20,
    )
    config = hf.MistralConfig(sliding_window=window, **shape) if window else hf.LlamaConfig(**shape)
    batching = hf.ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=64,
        max_blocks_per_request=0,
        allow_block_sharing=True,
        max_memory_percent=0.5,
    )
    helper = hf.DistributedHelper(None, None)
    return hf.PagedAttentionCache(config, batching, device="cpu", distributed_helper=helper, dtype=hf.torch.float32)


class Paged:
    """One ``PagedAttentionCache``: the engine's numbers, its forward's writes and reads, its pool as a snapshot."""

    def __init__(self, pool: BlockPool, block_size: int, window: int | None = None) -> None:
        self._hf = engine()
        self.capacity, self._block_size = pool.capacity, block_size
        self.cache = paged_cache(pool.capacity, block_size, window)
        (self.allocator,) = self.cache.cache_allocators.values()
        self._states: dict[SeqId, Any] = {}  # the scheduler's RequestState of each live sequence
        self._kv: list[int] = [-1]  # write id -> the token written; the KV stand-in (id 0: never written)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def pool(self) -> PoolView:
        return PoolView(self)

    # -- the forward pass ------------------------------------------------------------------

    def _store(self, state: Any, count: int) -> None:
        """``can_store_request_tokens``: room for ``count`` more tokens of the sequence, or ``OutOfBlocks``."""
        if not self.cache.can_store_request_tokens(state, count):
            free = self.free_blocks()
            raise OutOfBlocks(blocks_for(state.current_len() + count, self.block_size), len(free))

    def _forward(self, state: Any, tokens: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The forward's cache writes for ``tokens``, at the allocator's write indices; their (block, offset)."""
        torch, past = self._hf.torch, state.current_len()
        write = self.allocator.get_write_indices(state.request_id, past, len(tokens))
        ids = torch.arange(len(self._kv), len(self._kv) + len(tokens), dtype=torch.float32)
        self._kv += tokens
        kv = ids[:, None, None].expand(-1, 1, HEAD_DIM).contiguous()
        nothing = torch.tensor([], dtype=torch.long)
        self.allocator.update(kv, kv, self.allocator.layer_indices[0], nothing, torch.tensor(write, dtype=torch.long))
        state.position_offset = past + len(tokens)
        stride = self.allocator.block_physical_stride
        return tuple((self._block(index // stride), index % stride) for index in write)

    def _read(self, state: Any) -> tuple[int, ...]:
        """The sequence as attention reads it: the allocator's ``update`` at its read indices."""
        torch = self._hf.torch
        read = torch.tensor(self.allocator.get_read_indices(state.request_id, state.current_len(), 0), dtype=torch.long)
        nothing = torch.zeros((0, 1, HEAD_DIM))
        keys, _ = self.allocator.update(
            nothing, nothing, self.allocator.layer_indices[0], read, torch.tensor([], dtype=torch.long)
        )
        return tuple(self._kv[int(key)] for key in keys[:, 0, 0].tolist())

    def _slot_tokens(self, block: int, filled: int) -> tuple[int, ...]:
        """What the first ``filled`` slots of a block hold (the K rows of the one layer)."""
        start = self._engine_block(block) * self.allocator.block_physical_stride
        keys, _ = self.allocator._kv_token_views[self.allocator.layer_indices[0]]
        return tuple(self._kv[int(key)] for key in keys[start : start + filled, 0, 0].tolist())

    # -- the scheduler's ledger ------------------------------------------------------------

    def _new(self, seq: SeqId, tokens: Sequence[int]) -> Any:
        if not isinstance(seq, Hashable) or seq in self._states:
            raise InvalidOperation(f"sequence {seq!r} already exists")
        return self._hf.RequestState(request_id=repr(seq), initial_tokens=list(tokens))

    def _live(self, seq: SeqId) -> Any:
        state = self._states.get(seq) if isinstance(seq, Hashable) else None
        if state is None:
            raise InvalidOperation(f"sequence {seq!r} does not exist (never added, or freed)")
        return state

    def _free(self, seq: SeqId) -> None:
        self.cache.free_blocks(self._live(seq).request_id)
        self.cache.pool.try_to_free_sectors()
        del self._states[seq]

    # -- numbering and the pool --------------------------------------------------------------

    def _block(self, engine_block: int) -> int:
        return self.capacity + 1 - engine_block

    def _engine_block(self, block: int) -> int:
        return self.capacity + 1 - block

    def _table(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._block(b) for b in self.allocator.block_table.get(self._live(seq).request_id, ()))

    def free_blocks(self) -> list[int]:
        """The free blocks in the order the pool hands them out: loose blocks first (each free tree from its end),
        then the free sectors, the last one first."""
        pool, index, per_sector = self.cache.pool, self.allocator.index, self.allocator.blocks_per_sector
        loose = [block for tree in pool._free_blocks[index].trees.values() for block in reversed(tree)]
        sectors = [s * per_sector + i for s in reversed(pool.free_sectors) for i in range(per_sector)]
        return [self._block(block) for block in loose + sectors]

    def pool_state(self) -> PoolState:
        """Counts from the ledger (a block held once has no entry), hashes from its maps; the cached blocks,
        which the pool gives out only once ``evict_cached_blocks`` has run, queue after the free ones."""
        ledger, engine_block = self.allocator.ledger, self._engine_block
        free = self.free_blocks()
        cached = [self._block(b) for b in reversed(ledger.cached_blocks)]  # evicted, they are popped last first
        idle = set(free) | set(cached)
        refcounts = tuple(
            0 if b in idle else ledger.shared_ref_counts.get(engine_block(b), 1) for b in range(self.capacity)
        )
        hashes = tuple(ledger.block_to_hash.get(engine_block(b)) for b in range(self.capacity))
        by_hash = {h: (self._block(b),) for h, b in ledger.hash_to_block.items()}
        return PoolState(self.capacity, refcounts, tuple(free + cached), hashes, by_hash)


class PoolView:
    """The manager's ``pool``: HF's ``CachePool`` and ``BlockLedger`` as a read-only ``BlockPool``."""

    def __init__(self, paged: Paged) -> None:
        self._paged = paged

    @property
    def capacity(self) -> int:
        return self._paged.capacity

    def num_free(self) -> int:
        return len(self.snapshot().free_queue)

    def refcount(self, block: int) -> int:
        return self.snapshot().refcounts[block]

    def snapshot(self) -> PoolState:
        return self._paged.pool_state()


class HfBlockManager(Paged):
    """``spec.block_manager.BlockManager`` over a ``FullAttentionCacheAllocator``; ``pool`` gives the capacity."""

    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> WritePlan:
        state = self._new(seq, prompt)
        self._store(state, len(prompt))
        self._states[seq] = state
        return WritePlan(slots=self._forward(state, prompt))

    def append(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan:
        state = self._live(seq)
        self._store(state, len(tokens))
        state.generated_tokens.extend(tokens)
        return WritePlan(slots=self._forward(state, tokens))

    def fork(self, parent: SeqId, child: SeqId) -> None:
        state, child_state = self._live(parent), self._new(child, ())
        copies: dict[str, tuple[list[int], list[int]]] = {name: ([], []) for name in self.cache.cache_allocators}
        if not self.cache.prepare_fork_request(state, [child_state.request_id], copies):
            raise OutOfBlocks(1, len(self.free_blocks()))
        self._states[child] = state.fork(child_state.request_id)
        self.cache.perform_cache_copy(copies)

    def free(self, seq: SeqId) -> None:
        self._free(seq)

    def read(self, seq: SeqId) -> tuple[int, ...]:
        return self._read(self._live(seq))

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        return self._table(seq)

    def sequences(self) -> tuple[SeqId, ...]:
        return tuple(self._states)

    def snapshot(self) -> ManagerState:
        tables = {seq: self._table(seq) for seq in self._states}
        tokens = {seq: tuple(s.initial_tokens + s.generated_tokens) for seq, s in self._states.items()}
        filled = {block: self.block_size for block in (self._block(b) for b in self.allocator.ledger.cached_blocks)}
        for seq, table in tables.items():
            for i, block in enumerate(table):
                filled[block] = min(self.block_size, len(tokens[seq]) - i * self.block_size)
        contents = {block: self._slot_tokens(block, n) for block, n in filled.items()}
        return ManagerState(self.block_size, self.pool_state(), tables, tokens, contents)


class HfPrefixCachingManager(HfBlockManager):
    """``spec.prefix_cache.PrefixCachingManager``: the block manager with HF's prefix sharing."""

    def __init__(self, pool: BlockPool, block_size: int, commit: str = "on_fill") -> None:
        super().__init__(pool, block_size)
        self._commit = commit
        self._complete: dict[SeqId, dict[str, int]] = {}  # blocks the forwards completed, not yet marked

    def add_sequence(self, seq: SeqId, prompt: Sequence[int], extra_key: ExtraKey = None) -> WritePlan:
        self._no_extra_key(extra_key)
        state = self._new(seq, prompt)
        hits = self.allocator.match_prefix_blocks(list(prompt))
        evict = self._room(hits, blocks_for(len(prompt), self.block_size) - len(hits))
        cached = self.cache.search_prefix_match(state.request_id, list(prompt))
        if evict:
            self.cache.evict_cached_blocks()
            self.cache.pool.try_to_free_sectors()
        state.position_offset = cached
        self._store(state, len(prompt) - cached)
        self._states[seq] = state
        plan = self._write(seq, state, list(prompt[cached:]))
        return WritePlan(slots=plan.slots, cached_tokens=cached)

    def append(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan:
        state = self._live(seq)
        self._store(state, len(tokens))
        state.generated_tokens.extend(tokens)
        return self._write(seq, state, list(tokens))

    def commit(self, seq: SeqId) -> None:
        """The forward over ``seq`` ran: ``mark_complete_blocks`` with what its forwards completed."""
        state = self._live(seq)
        self.cache.mark_complete_blocks(state, self._complete.pop(seq, {}))
        self.cache.pool.try_to_free_sectors()  # an adopted duplicate went back to the pool

    def free(self, seq: SeqId) -> None:
        self._complete.pop(seq, None)
        self._free(seq)

    def block_hashes(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[Hashable, ...]:
        """The chain of ``compute_block_hash``; none under an extra key, which HF has no hash for."""
        if extra_key is not None:
            return ()
        size, parent, hashes = self.block_size, None, []
        for start in range(0, len(tokens) - len(tokens) % size, size):
            parent = self._hf.compute_block_hash(parent, list(tokens[start : start + size]))
            hashes.append(parent)
        return tuple(hashes)

    def cached_prefix(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        self._no_extra_key(extra_key)
        return tuple(self._block(b) for b in self.allocator.match_prefix_blocks([*tokens, 0]))  # one more: no cap

    def evict(self, n: int) -> list[int]:
        """``evict_cached_blocks``: every cached block (HF has no count), then the sectors they emptied."""
        evicted = [self._block(b) for b in self.allocator.ledger.cached_blocks]
        self.cache.evict_cached_blocks()
        self.cache.pool.try_to_free_sectors()
        return evicted

    def _write(self, seq: SeqId, state: Any, tokens: list[int]) -> WritePlan:
        """Count the blocks the forward completes, run it, and mark them (``on_fill``) or keep them for ``commit``."""
        complete = self.cache.count_new_complete_blocks(state, len(tokens))
        plan = WritePlan(slots=self._forward(state, tokens))
        pending = self._complete.setdefault(seq, {})
        for name, count in complete.items():
            pending[name] = pending.get(name, 0) + count
        if self._commit == "on_fill":
            self.commit(seq)
        return plan

    def _room(self, hits: list[int], new: int) -> bool:
        """The admission test: ``new`` blocks against the free ones; short of them, against the free and the
        cached ones not hit -- every cached block is then evicted (True), as the scheduler does under memory
        pressure.  Short of both: ``OutOfBlocks``, nothing touched."""
        free, cached = len(self.free_blocks()), self.allocator.ledger.cached_blocks
        if new <= free:
            return False
        evictable = len(cached) - sum(1 for block in hits if block in cached)
        if new > free + evictable:
            raise OutOfBlocks(new, free + evictable)
        return True

    def _no_extra_key(self, extra_key: ExtraKey) -> None:
        if extra_key is not None:
            raise InvalidOperation(f"HF's prefix sharing keys blocks by tokens alone: no extra key ({extra_key!r})")


class HfSlidingWindow(Paged):
    """``spec.sliding_window.WindowManager`` over a ``SlidingAttentionCacheAllocator``: a ring per sequence."""

    def __init__(self, pool: BlockPool, block_size: int, window: int) -> None:
        super().__init__(pool, block_size, window)
        self.window = window

    def add_sequence(self, seq: SeqId, length: int) -> None:
        state = self._new(seq, range(length))
        self._store(state, length)
        self._states[seq] = state
        self._forward(state, list(range(length)))

    def append(self, seq: SeqId, n: int) -> None:
        state = self._live(seq)
        self._store(state, n)
        self._forward(state, list(range(state.current_len(), state.current_len() + n)))

    def free(self, seq: SeqId) -> None:
        self._free(seq)

    def block_table(self, seq: SeqId) -> Table:
        return self._table(seq)

    def read(self, seq: SeqId) -> tuple[int, ...]:
        """The positions a next token's attention reads: the last ``window - 1`` (not a protocol method)."""
        state = self._live(seq)
        torch = self._hf.torch
        read = self.allocator.get_read_indices(state.request_id, state.current_len(), 1)[:-1]  # less the sentinel
        keys, _ = self.allocator._kv_token_views[self.allocator.layer_indices[0]]
        return tuple(self._kv[int(key)] for key in keys[torch.tensor(read, dtype=torch.long), 0, 0].tolist())

    def snapshot(self) -> WindowState:
        tables = {seq: self._table(seq) for seq in self._states}
        lengths = {seq: state.current_len() for seq, state in self._states.items()}
        return WindowState(self.block_size, self.window, self.pool_state(), tables, lengths)


def implementation(name: str, **components: Any) -> Implementation:
    engine()  # fail here, with the engine's ImportError, when transformers is not installed
    return Implementation(name=f"transformers {engine_version()} {name}", conventions=CONVENTIONS, **components)


BLOCK_MANAGER = Offer(HfBlockManager, operations={FORK}, emulated={"free"})
PREFIX_CACHING = Offer(  # its fork is the block manager's (judged there): the scheduler then samples one at a time
    HfPrefixCachingManager,
    operations={DEFERRED_COMMIT},
    emulated={"add_sequence", "free", "cached_prefix", "block_hashes"},
)
SLIDING_WINDOW = Offer(HfSlidingWindow, emulated={"free"})


def factory() -> Implementation:
    return implementation(
        "continuous batching (PagedAttentionCache)",
        block_manager=BLOCK_MANAGER,
        prefix_caching_manager=PREFIX_CACHING,
        sliding_window_manager=SLIDING_WINDOW,
    )


def block_manager_factory() -> Implementation:
    return implementation("FullAttentionCacheAllocator as a block manager", block_manager=BLOCK_MANAGER)


def prefix_caching_factory() -> Implementation:
    return implementation("prefix sharing as a prefix-caching manager", prefix_caching_manager=PREFIX_CACHING)


def sliding_window_factory() -> Implementation:
    return implementation("SlidingAttentionCacheAllocator as a ring", sliding_window_manager=SLIDING_WINDOW)
