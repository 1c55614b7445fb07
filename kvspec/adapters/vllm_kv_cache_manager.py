"""kvspec's prefix-caching and sliding-window managers over vLLM's own v1 ``KVCacheManager`` (tested: 0.33.0).

    kvspec check --impl kvspec.adapters.vllm_kv_cache_manager:full      # full attention: prefix cache
    kvspec check --impl kvspec.adapters.vllm_kv_cache_manager:sliding   # sliding window: window tables

The manager is vLLM's (``vllm/v1/core/kv_cache_manager.py``: its coordinator, its single-type managers,
its ``BlockPool``), built from a ``KVCacheConfig`` of one or two KV cache groups of block size ``B`` and
``capacity + 1`` blocks (block 0 is vLLM's null block, so kvspec block ``b`` is engine block ``b + 1``).
A kvspec sequence is a vLLM ``Request`` (prompt copied, as the engine core receives its own; the
hasher vLLM's ``get_request_block_hasher(B, sha256)``).  Each kvspec operation is the calls vLLM's
scheduler (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``) makes for that event, and no
check vLLM lacks:

* ``add_sequence(seq, prompt, extra_key)`` -- admission: ``get_computed_blocks(request)`` (hits
  capped at ``num_tokens - 1``), then ``allocate_slots(request, num_new_tokens, num_new_computed_tokens,
  new_computed_blocks)``; ``None`` ("cannot allocate") is ``OutOfBlocks``, the only translation.  Then
  the forward runs: ``num_computed_tokens`` becomes the prompt's length.
* ``append(seq, tokens)`` -- a decode step (or a chunk): the sampled tokens join the request
  (``append_output_token_ids``, which hashes newly full blocks), then ``allocate_slots(request,
  len(tokens))`` and the forward.  A refused append takes the tokens back out of the request: the
  request is the caller's, and the refused tokens were never scheduled.  Nothing to append is
  nothing scheduled (``schedule`` skips a request with ``num_new_tokens == 0``).
* ``free(seq)`` -> ``free(request)`` (the table last block first); ``block_table(seq)`` ->
  ``get_block_ids(request_id)``, the null block as ``None`` (a slid-out entry).
* ``block_hashes(tokens, extra_key)`` -> the ``block_hashes`` vLLM's hasher gives a request of those
  tokens, keyed as its ``BlockPool`` keys them (``make_block_hash_with_group_id(hash, 0)``).  A kvspec
  extra key is the request's ``cache_salt`` (``repr`` of the key: distinct keys, distinct salts; vLLM
  hashes the salt into block 0, ``generate_block_hash_extra_keys``, and the chain carries it on).
* ``cached_prefix(tokens, extra_key)`` -> ``get_computed_blocks(request, max_cache_hit_length=
  len(tokens))``: the uncapped run of hits, touching nothing.
* ``commit(seq)`` (``deferred_commit``: ``commit="after_forward"``) -> ``cache_blocks(request,
  num_computed_tokens)``, every write then being ``allocate_slots(..., delay_cache_blocks=True)``:
  vLLM's P/D path, which caches a request's blocks only once its KV has arrived.

Emulated (``Offer(emulated=...)``): ``read`` and the snapshot's block contents -- vLLM's manager holds
no KV; the adapter writes each token into the slot the engine's block table names (what the model
runner's slot mapping does) and reads it back the same way -- and ``evict(n)``: vLLM evicts lazily
(a free block keeps its hash until ``get_new_blocks`` hands it out); the adapter hands the first
``n`` cached blocks of the free queue to ``evict_blocks``, as ``kvspec.adapters.vllm`` does.

Not offered: ``fork`` (v1 has no fork: ``SamplingParams.n > 1`` becomes sibling requests sharing
their prompt through the prefix cache, ``vllm/v1/engine/parallel_sampling.py``) and ``swap`` /
``tiered_swap_in`` (v1 preempts by recompute only; CPU KV lives in connectors, not in the manager).

Conventions, read from the engine's code:

* the pool's: ``unhashed_free_position="head"``, ``duplicate_hash="keep"``, LRU only (see
  ``kvspec.adapters.vllm``): ``BlockPool.free_blocks`` prepends unhashed blocks;
  ``BlockHashToBlockMap`` keeps a second block under a cached hash (two requests admitted with the
  same prompt before either's blocks were cached both cache theirs).
* ``trusts_caller=True``: ``allocate_slots`` takes whatever request it is given (an unknown one is
  a new one, a second under a held id is taken as that one; token ids are hashed unchecked);
  ``free`` of an unknown request is a no-op (``pop_blocks_for_free``: "Default to [] in case a
  request is freed (aborted) before alloc").  The adapter's map from kvspec sequences to requests
  answers any other call on a sequence no request holds with ``InvalidOperation``: vLLM's manager
  has no call for it.
* Sliding windows (``SlidingWindowManager``, window ``W`` = vLLM's ``sliding_window``), declared
  ``WindowConventions(window_of="next_token", release="at_next_allocation")``: a block is kept for
  the window of the next token, ``get_num_skipped_tokens(c) = c - W + 1``
  (``vllm/v1/core/single_type_kv_cache_manager.py``), one token narrower than the last token's; and
  blocks leave a table lazily, at the request's next ``allocate_slots`` (``remove_skipped_blocks`` on
  the computed tokens, before room is counted: "We can do this even if we cannot schedule this
  request", ``vllm/v1/core/kv_cache_manager.py``).  So an admission keeps the whole prompt until the
  next step, a chunk allocates every block it computes, and a refused append has released what slid
  out.  The sliding-window manager is built with prefix caching off (vLLM's
  ``--no-enable-prefix-caching``): kvspec's sliding-window layer models no cache.

The hybrid -- a full-attention group and a sliding-window group over one pool, vLLM's
``HybridKVCacheCoordinator`` -- is ``VllmHybridManager``, driven by the adapter tests with kvspec's
safety rules (the pool's, with both groups' entries as holders; read-back through each group).  It
is no kvspec component: a kvspec manager holds one table per sequence, and no layer models two
tables over one pool whose hits need both, so there is no model to refine it against.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Hashable, Sequence
from types import SimpleNamespace
from typing import Any

import attrs

from kvspec.adapters.vllm import VllmBlockPool, engine_version
from kvspec.spec.block_manager import ManagerState, SeqId, WritePlan
from kvspec.spec.block_pool import BlockPool, PoolState
from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions, PoolConventions, WindowConventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.prefix_cache import DEFERRED_COMMIT, Commit, ExtraKey
from kvspec.spec.sliding_window import Table, WindowState

VERSION = "0.33.0"
CONVENTIONS = Conventions(
    pool=PoolConventions(unhashed_free_position="head", duplicate_hash="keep", policies=("lru",)),
    trusts_caller=True,
)
SLIDING_CONVENTIONS = attrs.evolve(
    CONVENTIONS, window=WindowConventions(window_of="next_token", release="at_next_allocation")
)
MAX_MODEL_LEN = 1 << 20  # allocate_slots clips a request at max_model_len: far beyond any kvspec machine's
NULL_BLOCK = 0  # vLLM's placeholder for a skipped (slid-out) entry: held by nobody


def on_cpu() -> None:
    """vLLM picks its platform once, at first use: the scheduler's configs need the CPU one, so every vLLM
    adapter here asks for it before its first import."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@functools.cache
def engine() -> SimpleNamespace:
    """vLLM's classes and functions the adapter calls (importing vLLM takes a few seconds)."""
    on_cpu()
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, make_block_hash_with_group_id
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)  # what EngineCore does once at start: the root of every hash chain
    return SimpleNamespace(
        torch=torch,
        SamplingParams=SamplingParams,
        sha256=sha256,
        KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher,
        make_block_hash_with_group_id=make_block_hash_with_group_id,
        FullAttentionSpec=FullAttentionSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        Request=Request,
    )


def kv_cache_config(capacity: int, block_size: int, windows: Sequence[int | None]) -> Any:
    """One KV cache group per entry of ``windows`` (None: full attention), ``capacity`` blocks and the null one."""
    vllm = engine()
    common = {"block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype": vllm.torch.float32}

    def spec(window: int | None) -> Any:
        return (
            vllm.FullAttentionSpec(**common)
            if window is None
            else vllm.SlidingWindowSpec(sliding_window=window, **common)
        )

    groups = [vllm.KVCacheGroupSpec([f"layer{i}"], spec(window)) for i, window in enumerate(windows)]
    return vllm.KVCacheConfig(num_blocks=capacity + 1, kv_cache_tensors=[], kv_cache_groups=groups)


def kv_cache_manager(capacity: int, block_size: int, windows: Sequence[int | None], caching: bool) -> Any:
    return engine().KVCacheManager(
        kv_cache_config(capacity, block_size, windows),
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=caching,
    )


def new_request(request_id: str, tokens: Sequence[int], extra_key: ExtraKey, block_size: int | None) -> Any:
    """A vLLM request for ``tokens`` (a copy), salted with the extra key; hashed when ``block_size`` is given."""
    vllm = engine()
    sampling = vllm.SamplingParams(max_tokens=1 << 20)
    sampling.update_from_generation_config({}, eos_token_id=None)
    hasher = None if block_size is None else vllm.get_request_block_hasher(block_size, vllm.sha256)
    salt = None if extra_key is None else repr(extra_key)
    return vllm.Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=sampling,
        pooling_params=None,
        cache_salt=salt,
        block_hasher=hasher,
    )


class EnginePool(VllmBlockPool):
    """kvspec's view of the ``BlockPool`` a vLLM ``KVCacheManager`` built for itself."""

    def __init__(self, engine_pool: Any) -> None:  # not super().__init__: this pool exists already
        self.engine = engine_pool
        self._blocks = engine_pool.blocks


class SlotMemory:
    """The device's KV as vLLM's model runner writes it: token ``i`` in slot ``i mod B`` of block ``table[i div B]``."""

    def __init__(self, block_size: int) -> None:
        self.size = block_size
        self.slots: dict[int, list[int]] = {}  # engine block -> the tokens in its slots

    def write(self, table: Sequence[int], tokens: Sequence[int], start: int, stop: int) -> list[tuple[int, int]]:
        """Tokens ``start .. stop - 1``; the kvspec (block, slot) of each."""
        written = []
        for position in range(start, stop):
            block, offset = table[position // self.size], position % self.size
            if block == NULL_BLOCK:
                continue  # a skipped entry: nothing is written there
            held = self.slots.get(block, []) if offset else []
            self.slots[block] = held[:offset] + [tokens[position]]
            written.append((block - 1, offset))
        return written

    def read(self, table: Sequence[int], length: int) -> tuple[int, ...]:
        return tuple(self.slots[table[i // self.size]][i % self.size] for i in range(length))

    def contents(self, pool: PoolState) -> dict[int, tuple[int, ...]]:
        """What each kvspec block in use or cached holds."""
        live = [b for b, count in enumerate(pool.refcounts) if count > 0 or pool.block_hashes[b] is not None]
        return {b: tuple(self.slots.get(b + 1, ())) for b in live}


class RequestTables:
    """The requests a kvspec manager drives through one vLLM ``KVCacheManager``, and the KV they wrote."""

    def __init__(self, capacity: int, block_size: int, windows: Sequence[int | None], caching: bool) -> None:
        self.engine = kv_cache_manager(capacity, block_size, windows, caching)
        self.groups = len(windows)
        self.view = EnginePool(self.engine.block_pool)
        self.size = block_size
        self.requests: dict[SeqId, Any] = {}
        self.memory = SlotMemory(block_size)

    def request(self, seq: SeqId) -> Any:
        """The vLLM request of ``seq``: vLLM's manager has no call for a request it does not hold."""
        try:
            return self.requests[seq]
        except (KeyError, TypeError):
            raise InvalidOperation(f"no vLLM request holds sequence {seq!r}") from None

    def ids(self, seq: SeqId, group: int = 0) -> list[int]:
        return list(self.engine.get_block_ids(self.request(seq).request_id)[group])

    def admit(self, seq: SeqId, request: Any, deferred: bool) -> tuple[int, list[tuple[int, int]]]:
        """``get_computed_blocks``, ``allocate_slots``, the forward: the tokens cached, the slots written."""
        hits, cached, _ = self.engine.get_computed_blocks(request)
        new = request.num_tokens - cached
        if self.engine.allocate_slots(request, new, cached, hits, delay_cache_blocks=deferred) is None:
            raise OutOfBlocks(new, self.engine.block_pool.get_num_free_blocks())
        self.requests[seq] = request
        return cached, self.forward(seq, cached)

    def grow(self, seq: SeqId, tokens: Sequence[int], deferred: bool) -> list[tuple[int, int]]:
        """A step scheduling ``tokens`` more: they join the request, slots are allocated, the forward runs."""
        request = self.request(seq)
        if not tokens:
            return []  # Scheduler.schedule skips a request with no new tokens: no engine call
        computed, hashed = request.num_computed_tokens, len(request.block_hashes)
        request.append_output_token_ids(list(tokens))
        if self.engine.allocate_slots(request, len(tokens), delay_cache_blocks=deferred) is None:
            del request._output_token_ids[-len(tokens) :]  # the caller's request, as before: never scheduled
            del request._all_token_ids[-len(tokens) :]
            del request.block_hashes[hashed:]
            raise OutOfBlocks(len(tokens), self.engine.block_pool.get_num_free_blocks())
        return self.forward(seq, computed)

    def forward(self, seq: SeqId, start: int) -> list[tuple[int, int]]:
        """The model runner writes the request's tokens from ``start`` on, into every group; they are computed.
        The (block, slot)s of the first group's writes."""
        request = self.requests[seq]
        tokens, stop = request.all_token_ids, request.num_tokens
        written = [self.memory.write(self.ids(seq, group), tokens, start, stop) for group in range(self.groups)]
        request.num_computed_tokens = stop
        return written[0]

    def read(self, seq: SeqId) -> tuple[int, ...]:
        return self.memory.read(self.ids(seq), self.request(seq).num_tokens)

    def free(self, seq: SeqId) -> None:
        """``free(request)``; of a sequence no request holds, a request that holds nothing (vLLM: a no-op)."""
        request = self.requests.pop(seq, None) if isinstance(seq, Hashable) else None
        self.engine.free(request or new_request(repr(seq), [0], None, None))


class VllmPrefixCachingManager:
    """vLLM's full-attention ``KVCacheManager`` as ``kvspec.spec.prefix_cache.PrefixCachingManager``."""

    def __init__(self, pool: BlockPool, block_size: int, commit: Commit = "on_fill") -> None:
        self._tables = RequestTables(pool.capacity, block_size, [None], caching=True)
        self._deferred = commit == "after_forward"

    @property
    def block_size(self) -> int:
        return self._tables.size

    @property
    def pool(self) -> BlockPool:
        return self._tables.view

    def add_sequence(self, seq: SeqId, prompt: Sequence[int], extra_key: ExtraKey = None) -> WritePlan:
        request = new_request(repr(seq), prompt, extra_key, self.block_size)
        cached, slots = self._tables.admit(seq, request, self._deferred)
        return WritePlan(slots=tuple(slots), cached_tokens=cached)

    def append(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan:
        return WritePlan(slots=tuple(self._tables.grow(seq, tokens, self._deferred)))

    def free(self, seq: SeqId) -> None:
        self._tables.free(seq)

    def commit(self, seq: SeqId) -> None:
        request = self._tables.request(seq)
        self._tables.engine.cache_blocks(request, request.num_computed_tokens)

    def read(self, seq: SeqId) -> tuple[int, ...]:
        return self._tables.read(seq)

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(block - 1 for block in self._tables.ids(seq))

    def sequences(self) -> tuple[SeqId, ...]:
        return tuple(self._tables.requests)

    def block_hashes(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[Hashable, ...]:
        request = new_request("block_hashes", tokens, extra_key, self.block_size)
        key = engine().make_block_hash_with_group_id
        return tuple(key(block_hash, 0) for block_hash in request.block_hashes)

    def cached_prefix(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        request = new_request("cached_prefix", tokens, extra_key, self.block_size)
        hits, _, _ = self._tables.engine.get_computed_blocks(request, max_cache_hit_length=len(tokens))
        return tuple(block.block_id - 1 for block in hits.blocks[0])

    def evict(self, n: int) -> list[int]:
        return self._tables.view.evict(n)

    def snapshot(self) -> ManagerState:
        pool = self._tables.view.snapshot()
        requests = self._tables.requests
        return ManagerState(
            block_size=self.block_size,
            pool=pool,
            tables={seq: self.block_table(seq) for seq in requests},
            tokens={seq: tuple(request.all_token_ids) for seq, request in requests.items()},
            contents=self._tables.memory.contents(pool),
        )


class VllmSlidingWindowManager:
    """vLLM's sliding-window ``KVCacheManager`` (prefix caching off) as ``kvspec.spec.sliding_window.WindowManager``."""

    def __init__(self, pool: BlockPool, block_size: int, window: int) -> None:
        self._tables = RequestTables(pool.capacity, block_size, [window], caching=False)
        self._window = window

    def add_sequence(self, seq: SeqId, length: int) -> None:
        self._tables.admit(seq, new_request(repr(seq), [0] * length, None, None), deferred=False)

    def append(self, seq: SeqId, n: int) -> None:
        self._tables.grow(seq, [0] * n, deferred=False)

    def free(self, seq: SeqId) -> None:
        self._tables.free(seq)

    def block_table(self, seq: SeqId) -> Table:
        return tuple(None if block == NULL_BLOCK else block - 1 for block in self._tables.ids(seq))

    def snapshot(self) -> WindowState:
        requests = self._tables.requests
        return WindowState(
            block_size=self._tables.size,
            window=self._window,
            pool=self._tables.view.snapshot(),
            tables={seq: self.block_table(seq) for seq in requests},
            lengths={seq: int(request.num_tokens) for seq, request in requests.items()},
        )


class VllmHybridManager:
    """vLLM's hybrid ``KVCacheManager``: a full-attention group and a sliding-window group over one pool.

    Not a kvspec component: a kvspec manager has one table per sequence, vLLM's hybrid two, drawing on
    one pool (and a hit needs both groups' blocks).  The adapter tests drive it and check kvspec's rules
    on it: the pool's, with the entries of both groups as holders; read-back through the full group;
    the sliding group's window read back for the next token.
    """

    def __init__(self, capacity: int, block_size: int, window: int) -> None:
        self._tables = RequestTables(capacity, block_size, [None, window], caching=True)
        self.window = window

    def add_sequence(self, seq: SeqId, prompt: Sequence[int], extra_key: ExtraKey = None) -> int:
        """Admit ``seq``; the prompt tokens the cache supplied."""
        request = new_request(repr(seq), prompt, extra_key, self._tables.size)
        return self._tables.admit(seq, request, deferred=False)[0]

    def append(self, seq: SeqId, tokens: Sequence[int]) -> None:
        self._tables.grow(seq, tokens, deferred=False)

    def free(self, seq: SeqId) -> None:
        self._tables.free(seq)

    def tables(self, seq: SeqId) -> tuple[Table, Table]:
        """The full group's table and the sliding group's (a skipped entry ``None``), in kvspec blocks."""
        full, sliding = (self._tables.ids(seq, group) for group in (0, 1))
        return tuple(b - 1 for b in full), tuple(None if b == NULL_BLOCK else b - 1 for b in sliding)

    def tokens(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._tables.request(seq).all_token_ids)

    def sequences(self) -> tuple[SeqId, ...]:
        return tuple(self._tables.requests)

    def read(self, seq: SeqId, group: int, positions: range) -> tuple[int | None, ...]:
        """What the group's table reads at ``positions``: None where it names no block, or the slot is empty."""
        table, size, slots = self._tables.ids(seq, group), self._tables.size, self._tables.memory.slots
        held = [slots.get(table[p // size], []) if table[p // size] != NULL_BLOCK else [] for p in positions]
        return tuple(h[p % size] if p % size < len(h) else None for h, p in zip(held, positions, strict=True))

    def pool(self) -> PoolState:
        return self._tables.view.snapshot()


def full() -> Implementation:
    """vLLM's full-attention ``KVCacheManager`` as the prefix-caching manager; the pool and the rest are kvspec's."""
    engine()  # fail here, with the engine's ImportError, when vLLM is not installed
    manager = Offer(VllmPrefixCachingManager, operations={DEFERRED_COMMIT}, emulated={"read", "evict"})
    name = f"vLLM {engine_version()} KVCacheManager (full attention)"
    return Implementation(name=name, prefix_caching_manager=manager, conventions=CONVENTIONS)


def sliding() -> Implementation:
    """vLLM's sliding-window ``KVCacheManager`` as the sliding-window manager."""
    engine()
    name = f"vLLM {engine_version()} KVCacheManager (sliding window)"
    manager = Offer(VllmSlidingWindowManager)
    return Implementation(name=name, sliding_window_manager=manager, conventions=SLIDING_CONVENTIONS)
