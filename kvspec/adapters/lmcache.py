"""kvspec's ``KVStore`` protocol over LMCache's local backends (tested: LMCache 0.5.6).

    kvspec check --impl kvspec.adapters.lmcache:factory

One node with two tiers: ``cpu`` is ``lmcache.v1.storage_backend.local_cpu_backend.
LocalCPUBackend`` (its hot cache over a ``HostMemoryAllocator`` of exactly the
tier's chunks), ``ssd`` is ``local_disk_backend.LocalDiskBackend`` (one file per
chunk in a scratch directory, ``max_local_disk_size`` exactly the tier's
chunks).  A chunk is 4 KiB of float32 (the allocator's alignment) holding the
block's token ids.  Each tier orders its chunks by its own ``cache_policy``
(``LRU`` or ``LFU``, one config per backend).

LMCache's ``StorageManager`` writes every chunk through to every backend and
reads a disk hit back into DRAM as a second copy: an *inclusive* hierarchy,
which kvspec's tiers (a node holds one copy of a key) cannot express.  The
adapter composes the two backends the exclusive way instead -- **demotion is a
write to disk on eviction** -- from the backends' own calls, so what is checked
is each backend's bookkeeping, eviction choice, pins and bytes:

* ``put(0, key, tokens)`` -> unless a tier holds the key (``contains``,
  ``exists_in_put_tasks``): ``LocalCPUBackend.allocate(..., eviction=False)``;
  when DRAM is full, the demotion below first; the tokens into the chunk;
  ``submit_put_task``.  Emulated.
* ``demote(0, 0)`` -> the DRAM policy's ``get_evict_candidates(hot_cache, 1)``,
  ``LocalDiskBackend.submit_put_task`` of its memory object (the disk evicts for
  room itself, by its policy), the write awaited, then ``remove(key,
  force=False)`` from DRAM.  ``OutOfBlocks`` when the disk cannot take it.  Emulated.
* ``evict(0, t)`` -> the tier's ``get_evict_candidates`` then ``remove(key,
  force=False)``, as ``allocate`` (DRAM) and ``submit_put_task`` (disk, which
  also gives back ``current_cache_size``) evict.  Emulated.
* ``get(0, key)`` -> DRAM: ``contains(key, pin=True)``, ``get_blocking``,
  ``touch_cache``, ``unpin`` (the retrieve path); disk: ``get_blocking``, read
  in place (its staging buffer comes from an allocator of its own, so a disk
  read never evicts from the DRAM tier).
* ``pin`` / ``unpin`` / ``remove`` -> the holding backend's ``pin`` / ``unpin`` /
  ``remove(key, force=True)``; ``False`` (no such key) is ``InvalidOperation``.
* ``snapshot()`` reads the backends: ``hot_cache`` and ``dict`` in their
  policies' order, the bytes of every chunk (DRAM tensors, disk files), pin counts.

Conventions, as read from ``local_cpu_backend.py``, ``local_disk_backend.py`` and ``cache_policy/``:

* ``tiers=("cpu", "ssd")``, ``max_nodes=1``, ``policies=("lru", "lfu")``.
* ``reput="skip"``: ``submit_put_task`` of a key the hot cache holds returns at
  once, no recency update (the chunk hash names its contents).
* ``promotion=False``: a disk hit is read where it is (see above).
* ``trusts_caller=True``: an unpin without a pin logs "Double unpin" and sets
  the count back to 0; a forced ``remove`` drops a pinned chunk and releases
  its pins (the caller's own request: a caller-contract finding, never a
  safety one).

What the verdict files under safety is LMCache's: ``LocalDiskBackend.remove``
lowers ``usage`` but never ``current_cache_size``, the figure
``submit_put_task`` admits and evicts by, so after a remove from the disk
tier a disk with room evicts a chunk (``invariant_demotion_keeps_the_block``),
a put it has room for is skipped, and a disk emptied by removes takes
nothing.  ``docs/findings/lmcache_disk_accounting.py`` shows it with
LMCache's own calls alone (LMCache issue #4546, open).
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions, StoreConventions, StorePolicy
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.kv_store import REMOVE, StoreState, Tokens

VERSION = "0.5.6"
CONVENTIONS = Conventions(
    store=StoreConventions(tiers=("cpu", "ssd"), max_nodes=1, policies=("lru", "lfu"), reput="skip", promotion=False),
    trusts_caller=True,
)
SHAPE = (2, 1, 16, 32)  # 1,024 float32: 4 KiB, the allocator's alignment, so a tier of n chunks is n * 4 KiB
CHUNK_BYTES = 4096
DRAM, DISK = 0, 1

# What each caller-contract finding (keyed by the operation kvspec check names) means in production.
IN_PRODUCTION = {
    "remove": "remove(key, force=True) drops a chunk a retrieve has pinned and releases its pins: the retrieve "
    "reads a freed memory object (DRAM) or a deleted file (disk)",
    "unpin": "an unpin without a pin is logged and the count set back to 0: a later pin of the chunk is "
    "then released by the stray unpin's owner, and the chunk can be evicted under its reader",
}


class Runtime:
    """What every store of this process shares: LMCache's pin monitor, the event loop the disk backends
    write from, and the one store alive (a new store closes the one before: the machines build one per
    example)."""

    def __init__(self) -> None:
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.pin_monitor import PinMonitor

        self.torch, self.config = torch, LMCacheEngineConfig
        PinMonitor.GetOrCreate(self.settings(policy="lru"))  # what the cache engine does at start
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="kvspec-lmcache-disk", daemon=True).start()
        self.live: LMCacheStore | None = None
        atexit.register(self.adopt, None)

    def settings(self, policy: str, **extra: Any) -> Any:
        return self.config.from_defaults(chunk_size=16, lmcache_instance_id="kvspec", cache_policy=policy, **extra)

    def adopt(self, store: LMCacheStore | None) -> None:
        if self.live is not None:
            self.live.close()
        self.live = store


_RUNTIME: list[Runtime] = []


def runtime() -> Runtime:
    if not _RUNTIME:
        _RUNTIME.append(Runtime())
    return _RUNTIME[0]


class LMCacheStore:
    """LMCache's ``LocalCPUBackend`` over its ``LocalDiskBackend``, seen through ``kvspec.spec.kv_store.KVStore``."""

    def __init__(self, nodes: int, capacities: Sequence[int], policies: Sequence[StorePolicy]) -> None:
        if nodes != 1 or len(capacities) != 2 or len(policies) != 2:
            raise InvalidOperation("LMCache's local backends are one node with two tiers (cpu, ssd)")
        if any(policy not in CONVENTIONS.store.policies for policy in policies):
            raise InvalidOperation(f"LMCache has no such cache policy among {tuple(policies)} (lru, lfu)")
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        shared = runtime()
        self.torch, self.capacities, self.policies = shared.torch, tuple(capacities), tuple(policies)
        self._shape = shared.torch.Size(SHAPE)
        self._engine_key = lambda chunk: CacheEngineKey("kvspec", 1, 0, chunk, shared.torch.float32)
        self._format = MemoryFormat.KV_2LTD
        self.directory = tempfile.mkdtemp(prefix="kvspec-lmcache-")
        disk_size = capacities[DISK] * CHUNK_BYTES / 1024**3
        self.dram = LocalCPUBackend(
            config=shared.settings(policies[DRAM].upper(), local_cpu=True),
            memory_allocator=HostMemoryAllocator(capacities[DRAM] * CHUNK_BYTES),
        )
        self.staging = LocalCPUBackend(  # the disk's read buffer: one chunk, never a cache
            config=shared.settings("LRU", local_cpu=False), memory_allocator=HostMemoryAllocator(CHUNK_BYTES)
        )
        disk_config = shared.settings(policies[DISK].upper(), local_disk=self.directory, max_local_disk_size=disk_size)
        self.disk = LocalDiskBackend(disk_config, shared.loop, self.staging, dst_device="cpu")
        self._chunks: dict[Hashable, int] = {}  # kvspec key -> the chunk hash it is stored under
        self._keys: dict[int, Hashable] = {}
        shared.adopt(self)

    def close(self) -> None:
        for key in list(self.dram.hot_cache):  # give every chunk back, pinned or not: the store is gone
            self.dram.remove(key, force=True)
        self.disk.close()
        self.dram.close()
        self.staging.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- mapping ----------------------------------------------------------------------------------

    def _key(self, key: Hashable) -> Any:
        chunk = self._chunks.setdefault(key, len(self._chunks))
        self._keys[chunk] = key
        return self._engine_key(chunk)

    @staticmethod
    def _node(node: object) -> None:
        if node != 0 or isinstance(node, bool):
            raise InvalidOperation(f"node {node!r} is not a node of this store (0..0)")

    def _tier(self, tier: object) -> int:
        if not isinstance(tier, int) or isinstance(tier, bool) or tier not in (DRAM, DISK):
            raise InvalidOperation(f"tier {tier!r} is not a tier (0..1: cpu, ssd)")
        return tier

    def _backend(self, engine_key: Any) -> Any:
        """The backend holding ``engine_key``, if any."""
        if self.dram.contains(engine_key):
            return self.dram
        return self.disk if self.disk.contains(engine_key) else None

    def _write(self, memory_obj: Any, tokens: Tokens) -> None:
        flat = memory_obj.tensor.view(-1)
        flat.zero_()
        flat[0] = len(tokens)
        flat[1 : 1 + len(tokens)] = self.torch.tensor(tokens, dtype=self.torch.float32)

    @staticmethod
    def _read(memory_obj: Any) -> Tokens:
        flat = memory_obj.tensor.view(-1)
        return tuple(int(x) for x in flat[1 : 1 + int(flat[0])].tolist())

    def _read_file(self, engine_key: Any) -> Tokens:
        """A disk chunk's tokens, read as ``get_blocking`` reads them but without counting a hit."""
        meta = self.disk.dict[engine_key]
        loaded = self.disk.load_bytes_from_disk(engine_key, meta.path, meta.dtype, meta.shape, meta.fmt)
        try:
            return self._read(loaded)
        finally:
            loaded.ref_count_down()

    # -- operations ---------------------------------------------------------------------------------

    def put(self, node: int, key: Hashable, tokens: Sequence[int]) -> None:
        self._node(node)
        contents = tuple(tokens)
        if key is None or not contents or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in contents):
            raise InvalidOperation(f"a block is a key and one or more token ids, got {key!r}: {contents!r}")
        engine_key = self._key(key)
        if self._backend(engine_key) is not None or self.disk.exists_in_put_tasks(engine_key):
            return
        memory_obj = self.dram.allocate(self._shape, self.torch.float32, self._format, eviction=False, busy_loop=False)
        if memory_obj is None:
            if self._demote() is None:
                raise OutOfBlocks(1, 0, what="evictable chunks in LMCache's DRAM tier")
            memory_obj = self.dram.allocate(
                self._shape, self.torch.float32, self._format, eviction=False, busy_loop=False
            )
        self._write(memory_obj, contents)
        self.dram.submit_put_task(engine_key, memory_obj)
        memory_obj.ref_count_down()  # the caller's reference: the backend keeps its own

    def _demote(self) -> Hashable | None:
        """Write the DRAM policy's victim to disk and drop it from DRAM; its key, None when there is none."""
        if not any(memory_obj.can_evict for memory_obj in self.dram.hot_cache.values()):
            return None
        if not self._disk_takes(CHUNK_BYTES):  # asked first: an LFU policy forgets the candidates it names
            raise OutOfBlocks(1, 0, what="evictable chunks in LMCache's disk tier")
        (victim,) = self.dram.cache_policy.get_evict_candidates(self.dram.hot_cache, num_candidates=1)
        self.disk.submit_put_task(victim, self.dram.hot_cache[victim])
        while self.disk.exists_in_put_tasks(victim):  # the write runs on the disk worker
            time.sleep(0.0002)
        self.dram.remove(victim, force=False)
        return self._keys[victim.chunk_hash]

    def _disk_takes(self, size: int) -> bool:
        """Whether ``submit_put_task`` will admit ``size`` bytes: the room it has, or what it may evict."""
        needed = self.disk.current_cache_size + size - self.disk.max_cache_size
        return needed <= 0 or sum(m.size for m in self.disk.dict.values() if m.can_evict) >= needed

    def demote(self, node: int, tier: int) -> Hashable | None:
        self._node(node)
        if self._tier(tier) == DISK:
            raise InvalidOperation("ssd is the last tier: evict from it instead")
        return self._demote()

    def evict(self, node: int, tier: int) -> Hashable | None:
        self._node(node)
        backend = (self.dram, self.disk)[self._tier(tier)]
        held = backend.hot_cache if tier == DRAM else backend.dict
        victims = backend.cache_policy.get_evict_candidates(held, num_candidates=1)
        if not victims:
            return None
        if tier == DISK:
            self.disk.current_cache_size -= held[victims[0]].size
        backend.remove(victims[0], force=False)
        return self._keys[victims[0].chunk_hash]

    def get(self, node: int, key: Hashable) -> Tokens | None:
        self._node(node)
        engine_key = self._key(key)
        if self.dram.contains(engine_key, pin=True):
            memory_obj = self.dram.get_blocking(engine_key)
            read = self._read(memory_obj)
            memory_obj.ref_count_down()
            self.dram.touch_cache()
            self.dram.unpin(engine_key)
            return read
        memory_obj = self.disk.get_blocking(engine_key)
        if memory_obj is None:
            return None
        read = self._read(memory_obj)
        memory_obj.ref_count_down()
        return read

    def _held(self, node: int, key: Hashable) -> tuple[Any, Any]:
        self._node(node)
        engine_key = self._key(key)
        backend = self._backend(engine_key)
        if backend is None:
            raise InvalidOperation(f"node {node} holds no block {key!r}")
        return backend, engine_key

    def pin(self, node: int, key: Hashable) -> None:
        backend, engine_key = self._held(node, key)
        backend.pin(engine_key)

    def unpin(self, node: int, key: Hashable) -> None:
        backend, engine_key = self._held(node, key)
        backend.unpin(engine_key)

    def remove(self, node: int, key: Hashable) -> None:
        backend, engine_key = self._held(node, key)
        backend.remove(engine_key, force=True)

    def lookup(self, key: Hashable) -> tuple[tuple[int, int], ...]:
        engine_key = self._key(key)
        backend = self._backend(engine_key)
        return () if backend is None else ((0, DRAM if backend is self.dram else DISK),)

    # -- the abstraction function ---------------------------------------------------------------------

    def _order(self, tier: int) -> list[Any]:
        """A tier's keys, the one its policy evicts first at the head."""
        backend = (self.dram, self.disk)[tier]
        held = backend.hot_cache if tier == DRAM else backend.dict
        if self.policies[tier] == "lru":
            return list(held)
        return [key for keys in backend.cache_policy.freq_to_keys.values() for key in keys if key in held]

    def snapshot(self) -> StoreState:
        orders = [self._order(DRAM), self._order(DISK)]
        name = {engine_key: self._keys[engine_key.chunk_hash] for order in orders for engine_key in order}
        contents = {(0, name[k]): self._read(self.dram.hot_cache[k]) for k in orders[DRAM]}
        contents.update({(0, name[k]): self._read_file(k) for k in orders[DISK]})
        pins = {(0, name[k]): self.dram.hot_cache[k].meta.pin_count for k in orders[DRAM]}
        pins.update({(0, name[k]): self.disk.dict[k].pin_count for k in orders[DISK]})
        return StoreState(
            capacities=self.capacities,
            alive=(True,),
            tiers=(tuple(tuple(name[k] for k in order) for order in orders),),
            contents=contents,
            pins={place: count for place, count in pins.items() if count > 0},
            directory={name[k]: ((0, tier),) for tier, order in enumerate(orders) for k in order},
            names=CONVENTIONS.store.tiers,
        )


def engine_version() -> str:
    from importlib.metadata import version

    return version("lmcache")


def factory() -> Implementation:
    """LMCache's DRAM and disk backends under test as layer 7's store; every other layer is the reference's."""
    from lmcache.v1.storage_backend import local_disk_backend  # noqa: F401  (fail here when LMCache is missing)

    store = Offer(LMCacheStore, operations={REMOVE}, emulated={"put", "demote", "evict"})
    return Implementation(name=f"LMCache {engine_version()} local CPU + disk", kv_store=store, conventions=CONVENTIONS)
