"""kvspec's ``KVStore`` protocol over vLLM's CPU KV offloading manager (tested: vLLM 0.33.0).

    kvspec check --impl kvspec.adapters.vllm_offload:factory

vLLM's ``OffloadingConnector`` keeps, on the scheduler side, one
``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``: chunk slots in DRAM
that GPU blocks are stored to and loaded back from, under a key per chunk,
evicted by a pluggable ``CachePolicy`` (``lru``, ``arc``).  In kvspec's terms it
is a store of **one node and one tier** (``cpu``), a profile of layer 7's model.
Each kvspec operation is one request of the manager's (a ``ReqContext``,
``on_request_finished`` at its end, which is when the policies commit recency),
and one manager call:

* ``put(0, key, tokens)`` -> ``prepare_store([key])``: the chunk is allocated
  (evicting if needed) and *pending* (``ref_cnt == -1``); the adapter plays
  the GPU worker and writes ``tokens`` into the chunk slot the returned
  ``CPULoadStoreSpec`` names.  ``None`` (no evictable chunk) is ``OutOfBlocks``.
* ``complete(0, key, ok)`` -> ``complete_store([key], success=ok)``;
  ``find(0, key)`` -> ``lookup(key)``: ``HIT`` / ``HIT_PENDING`` / ``MISS``.
* ``get(0, key)`` -> ``lookup``; on ``HIT``, ``prepare_load([key])`` (reading
  the chunk slot its spec names) and ``complete_load([key])``.
* ``pin`` / ``unpin`` -> ``_prepare_load(..., record_access=False)`` /
  ``complete_load``: a transfer out of the chunk that is not a cache access
  (the manager's own path for its tiering cascade).
* ``lookup(key)`` -> the policy's ``get(key)``.
* ``evict(0, 0)``: the manager evicts only inside ``prepare_store``; the
  adapter runs the same steps for one chunk (``CachePolicy.evict(1, set())``,
  then the manager's ``_free_chunk``) -- emulated.  ``demote``: one tier, so
  always the last (``InvalidOperation``, as the model says).

The node, tier, key and tokens are kvspec's: the adapter refuses what it
cannot map (a node other than 0, a key that is ``None``, tokens that are no
token ids) with ``InvalidOperation``; everything else is the engine's answer.

Conventions, as read from ``vllm/v1/kv_offload/cpu/manager.py`` and ``policies/``:

* ``tiers=("cpu",)``, ``max_nodes=1``; ``policies=("lru", "arc")``
  (``CachePolicyFactory``'s built-ins).
* ``stores="pending"``: ``prepare_store`` inserts the chunk with ``ref_cnt = -1``
  (``ChunkStatus.is_ready`` false: ``lookup`` answers ``HIT_PENDING``, eviction
  skips it) until ``complete_store``; ``success=False`` removes it and frees the
  slot; a completion of a chunk that is not pending is ignored.
* ``reput="touch"``: ``prepare_store`` stores only keys it does not hold; a
  ready one is recorded as *reused* (a use: LRU re-ranks it, ARC moves it to
  T2), a pending one is not recorded at all.
* LRU: a use (a store, a request's access) assigns the key the next rank;
  eviction takes the lowest-ranked chunk with ``ref_cnt == 0``.  ARC:
  ``ARCCachePolicy`` -- T1/T2 in insertion order, B1/B2 ghosts trimmed to the
  capacity after an eviction, ``target_t1_size`` adapted by ``on_store_miss``
  before the eviction, the victim from T1 when ``len(t1) >= int(target)``.
* ``refusal_adapts_policy=True``: ``prepare_store`` calls ``on_store_miss``
  for the keys it does not hold -- ARC adapts its target to a ghost hit and
  moves the ghost to the young end -- and records the request's accesses
  "once before any allocation-related early return", so a store refused for
  want of an evictable chunk (``None``) has still taught ARC; nothing else
  moves (LRU re-ranks only keys it holds: none, for a refused store of one
  new key).
* ``trusts_caller=True``: the manager checks its caller with ``assert`` only
  (``prepare_load`` of a missing or pending chunk, ``complete_load`` of one
  not loading).
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions, StoreConventions, StorePolicy
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.kv_store import PENDING_STORES, StoreState, Tokens
from kvspec.spec.kv_store_policies import ArcLists, Ghosts, eviction_order

VERSION = "0.33.0"
CONVENTIONS = Conventions(
    store=StoreConventions(
        tiers=("cpu",),
        max_nodes=1,
        policies=("lru", "arc"),
        reput="touch",
        stores="pending",
        refusal_adapts_policy=True,
    ),
    trusts_caller=True,
)

# What each caller-contract finding (keyed by the operation kvspec check names) means in production.
IN_PRODUCTION = {
    "pin": "prepare_load asserts that the chunk is cached and ready: a connector that loads a chunk another "
    "request's store has not completed kills the scheduler process (under python -O it pins a chunk being written)",
    "unpin": "complete_load asserts the chunk is loading: a doubled load completion kills the scheduler process "
    "(under python -O ref_cnt goes to -1 and the chunk reads as pending, never evictable again)",
}


def engine_manager() -> Any:
    """vLLM's ``CPUOffloadingManager`` class (importing vLLM takes a few seconds)."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager


class VllmOffloadStore:
    """A vLLM ``CPUOffloadingManager`` seen through ``kvspec.spec.kv_store.KVStore``: one node, one tier."""

    def __init__(self, nodes: int, capacities: Sequence[int], policies: Sequence[StorePolicy]) -> None:
        if nodes != 1 or len(capacities) != 1 or len(policies) != 1:
            raise InvalidOperation("vLLM's CPU offloading is one node with one tier (cpu)")
        if policies[0] not in CONVENTIONS.store.policies:
            raise InvalidOperation(f"vLLM's CPU offloading has no {policies[0]!r} cache policy (lru, arc)")
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

        self._results, self._context, self._offload_key = LookupResult, ReqContext, make_offload_key
        self.capacity, self.policy = capacities[0], policies[0]
        self.engine = engine_manager()(num_chunks=capacities[0], cache_policy=policies[0])
        self._keys: dict[bytes, Hashable] = {}  # the engine's key -> kvspec's
        self._slots: dict[int, Tokens] = {}  # chunk slot -> what the GPU worker wrote there
        self._requests = itertools.count()

    # -- one request per operation ----------------------------------------------------------------

    def _key(self, key: Hashable) -> bytes:
        """The engine's key for ``key``: a block hash (its repr's bytes) in KV-cache group 0."""
        engine_key = self._offload_key(repr(key).encode(), 0)
        self._keys.setdefault(engine_key, key)
        return engine_key

    @contextlib.contextmanager
    def _request(self) -> Iterator[Any]:
        """One request of the manager's: its accesses become recency when it finishes."""
        context = self._context(req_id=f"kvspec-{next(self._requests)}")
        self.engine.on_new_request(context)
        yield context
        self.engine.on_request_finished(context)

    @staticmethod
    def _node(node: object) -> None:
        if node != 0 or isinstance(node, bool):
            raise InvalidOperation(f"node {node!r} is not a node of this store (0..0)")

    # -- operations ---------------------------------------------------------------------------------

    def put(self, node: int, key: Hashable, tokens: Sequence[int]) -> None:
        self._node(node)
        contents = tuple(tokens)
        if key is None or not contents or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in contents):
            raise InvalidOperation(f"a block is a key and one or more token ids, got {key!r}: {contents!r}")
        with self._request() as request:
            stored = self.engine.prepare_store([self._key(key)], request)
        if stored is None:
            raise OutOfBlocks(1, 0, what="evictable chunks in vLLM's CPU offloading")
        for chunk in stored.store_spec.block_ids:
            self._slots[int(chunk)] = contents  # the GPU worker copies the block's KV into the slot

    def complete(self, node: int, key: Hashable, ok: bool) -> None:
        self._node(node)
        with self._request() as request:
            self.engine.complete_store([self._key(key)], request, success=ok)

    def find(self, node: int, key: Hashable) -> str:
        self._node(node)
        with self._request() as request:
            answer = self.engine.lookup(self._key(key), request)
        return {self._results.HIT: "hit", self._results.HIT_PENDING: "pending"}.get(answer, "miss")

    def get(self, node: int, key: Hashable) -> Tokens | None:
        self._node(node)
        engine_key = self._key(key)
        with self._request() as request:
            if self.engine.lookup(engine_key, request) != self._results.HIT:
                return None
            spec = self.engine.prepare_load([engine_key], request)
            read = self._slots[int(spec.block_ids[0])]  # the GPU worker copies the slot back
            self.engine.complete_load([engine_key], request)
        return read

    def pin(self, node: int, key: Hashable) -> None:
        self._node(node)
        with self._request() as request:
            self.engine._prepare_load([self._key(key)], request, record_access=False)

    def unpin(self, node: int, key: Hashable) -> None:
        self._node(node)
        with self._request() as request:
            self.engine.complete_load([self._key(key)], request)

    def demote(self, node: int, tier: int) -> Hashable | None:
        self._node(node)
        raise InvalidOperation(f"tier {tier!r}: vLLM's CPU offloading has one tier, the last: evict from it instead")

    def evict(self, node: int, tier: int) -> Hashable | None:
        """One eviction as ``prepare_store`` makes them: the policy's victim, its slot freed."""
        self._node(node)
        if tier != 0 or isinstance(tier, bool):
            raise InvalidOperation(f"tier {tier!r} is not a tier (0..0: cpu)")
        evicted = self.engine._policy.evict(1, set())
        if not evicted:
            return None
        (engine_key, chunk), *_ = evicted
        self.engine._num_evictable_cache_chunks -= 1
        self.engine._free_chunk(chunk)
        return self._keys[engine_key]

    def lookup(self, key: Hashable) -> tuple[tuple[int, int], ...]:
        return ((0, 0),) if self.engine._policy.get(self._key(key)) is not None else ()

    # -- the abstraction function ---------------------------------------------------------------------

    def snapshot(self) -> StoreState:
        """The policy's own state: its chunks with their ``ref_cnt`` and slot, LRU ranks or ARC's lists."""
        policy = self.engine._policy
        chunks = policy.chunks if self.policy == "lru" else {**policy.t1, **policy.t2}
        keys = {self._keys[engine_key]: chunk for engine_key, chunk in chunks.items()}
        arc: dict[tuple[int, int], ArcLists] = {}
        if self.policy == "lru":
            order = tuple(self._keys[k] for k in sorted(policy.chunks, key=policy._ranks.__getitem__))
        else:
            lists = ArcLists(
                recent=tuple(self._keys[k] for k in policy.t1),
                frequent=tuple(self._keys[k] for k in policy.t2),
                recent_ghosts=tuple(self._keys[k] for k in policy.b1),
                frequent_ghosts=tuple(self._keys[k] for k in policy.b2),
                target=float(policy.target_t1_size),
            )
            arc[(0, 0)] = lists
            order = arc_order(lists)
        return StoreState(
            capacities=(self.capacity,),
            alive=(True,),
            tiers=((order,),),
            contents={(0, key): self._slots[int(chunk.chunk_id)] for key, chunk in keys.items()},
            pins={(0, key): int(chunk.ref_cnt) for key, chunk in keys.items() if chunk.ref_cnt > 0},
            directory={key: ((0, 0),) for key in keys},
            names=CONVENTIONS.store.tiers,
            pending=frozenset((0, key) for key, chunk in keys.items() if chunk.ref_cnt < 0),
            arc=arc,
        )


def arc_order(lists: ArcLists) -> tuple[Hashable, ...]:
    """The eviction order the spec lists for an ARC tier holding ``lists``."""
    entries = [
        (key, types.SimpleNamespace(uses=0, last_use=rank, frequent=frequent))
        for rank, (key, frequent) in enumerate(
            [(key, False) for key in lists.recent] + [(key, True) for key in lists.frequent]
        )
    ]
    return eviction_order("arc", entries, Ghosts(target=lists.target))


def engine_version() -> str:
    import vllm

    return str(vllm.__version__)


def factory() -> Implementation:
    """vLLM's ``CPUOffloadingManager`` under test as layer 7's store; every other layer is the reference's."""
    engine_manager()  # fail here, with the engine's ImportError, when vLLM is not installed
    store = Offer(VllmOffloadStore, operations={PENDING_STORES}, emulated={"evict"})
    return Implementation(name=f"vLLM {engine_version()} CPUOffloadingManager", kv_store=store, conventions=CONVENTIONS)
