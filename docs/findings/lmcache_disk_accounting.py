"""LMCache 0.5.6: ``LocalDiskBackend.remove()`` gives back ``usage`` but never ``current_cache_size``.

    python docs/findings/lmcache_disk_accounting.py     # needs LMCache (and the torch it runs on), nothing else

``submit_put_task`` admits a chunk, and evicts for it, by ``current_cache_size``;
only its own eviction loop takes a chunk's bytes off that figure.  A removal
from outside the backend -- ``StorageManager.remove`` / ``batched_remove``, as
``LMCacheEngine.clear``, ``move``, ``compress``, ``decompress`` and
remove-after-retrieve call it -- drops the file and the entry and lowers
``usage``, and leaves the bytes counted.  This script drives one disk backend
of two chunks through LMCache's own calls only:

1. two puts fill the disk; ``remove`` of one leaves one chunk on disk, two counted;
2. a put the disk has room for evicts the other chunk anyway;
3. with the chunk on disk pinned (a retrieve in flight), a put the disk has room
   for is skipped ("Insufficient evictable disk cache space");
4. once removes have emptied the disk, it takes no put at all -- until restart.

Each step prints the backend's own figures; the script exits 1 on a release
where any of the damage is gone.  ``damage()`` answers which steps showed it,
for the adapter test that runs the script (``kvspec/adapters/tests/test_lmcache.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.pin_monitor import PinMonitor
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

CHUNK = 4096  # bytes: 1,024 float32, the host allocator's alignment
CHUNKS_ON_DISK = 2


def config(**settings: Any) -> Any:
    return LMCacheEngineConfig.from_defaults(chunk_size=16, lmcache_instance_id="finding", **settings)


@contextmanager
def disk_of_two_chunks() -> Iterator[tuple[LocalDiskBackend, LocalCPUBackend]]:
    """A ``LocalDiskBackend`` of exactly two chunks, and a DRAM backend to allocate the chunks put to it."""
    PinMonitor.GetOrCreate(config())  # what LMCache's engine does at start
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    directory = tempfile.mkdtemp(prefix="lmcache-finding-")
    dram = LocalCPUBackend(config=config(local_cpu=True), memory_allocator=HostMemoryAllocator(8 * CHUNK))
    staging = LocalCPUBackend(config=config(local_cpu=False), memory_allocator=HostMemoryAllocator(CHUNK))
    size_gb = CHUNKS_ON_DISK * CHUNK / 1024**3
    disk = LocalDiskBackend(config(local_disk=directory, max_local_disk_size=size_gb), loop, staging, dst_device="cpu")
    try:
        yield disk, dram
    finally:
        disk.close()
        dram.close()
        staging.close()
        loop.call_soon_threadsafe(loop.stop)
        shutil.rmtree(directory, ignore_errors=True)


def key(name: str) -> CacheEngineKey:
    return CacheEngineKey("finding", 1, 0, sum(map(ord, name)), torch.float32)


def put(disk: LocalDiskBackend, dram: LocalCPUBackend, name: str) -> None:
    """One chunk written to disk, as ``StorageManager`` writes through: ``submit_put_task``, the write awaited."""
    memory_obj = dram.allocate(torch.Size((2, 1, 16, 32)), torch.float32, MemoryFormat.KV_2LTD)
    disk.submit_put_task(key(name), memory_obj)
    while disk.exists_in_put_tasks(key(name)):
        time.sleep(0.001)
    memory_obj.ref_count_down()


def state(disk: LocalDiskBackend, names: str) -> dict[str, Any]:
    """What the backend holds, and the two figures it keeps: bytes written (``usage``) and bytes it admits by."""
    return {
        "on disk": [name for name in names if disk.contains(key(name))],
        "usage": disk.usage,
        "current_cache_size": int(disk.current_cache_size),
        "max_cache_size": disk.max_cache_size,
    }


@dataclasses.dataclass(frozen=True)
class Damage:
    evicted_with_room: bool  # step 2
    skipped_with_room: bool  # step 3
    emptied_disk_takes_nothing: bool  # step 4

    def __bool__(self) -> bool:
        return self.evicted_with_room and self.skipped_with_room and self.emptied_disk_takes_nothing


def damage(show: bool = False) -> Damage:
    """Run the four steps on a fresh backend; print each step's state when ``show``."""

    def step(label: str, disk: LocalDiskBackend) -> list[str]:
        seen = state(disk, "abcdef")
        if show:
            print(f"{label:<52} {seen}")
        return list(seen["on disk"])

    with disk_of_two_chunks() as (disk, dram):
        put(disk, dram, "a")
        put(disk, dram, "b")
        step("1. put a, put b: the disk is full", disk)
        disk.remove(key("a"))  # what StorageManager.remove calls (force=True)
        step("   remove a: one chunk on disk", disk)
        put(disk, dram, "c")
        after_c = step("2. put c: room for it, yet b is evicted", disk)
        disk.pin(key("c"))  # a retrieve holds c
        put(disk, dram, "d")
        after_d = step("3. c pinned, put d: room for it, yet d is skipped", disk)
        disk.unpin(key("c"))
        disk.remove(key("c"))
        step("   remove c: the disk is empty", disk)
        put(disk, dram, "e")
        put(disk, dram, "f")
        after_f = step("4. put e, put f: the empty disk takes neither", disk)
    return Damage(
        evicted_with_room="b" not in after_c,
        skipped_with_room="d" not in after_d,
        emptied_disk_takes_nothing=not after_f,
    )


def main() -> int:
    import lmcache

    print(
        f"LMCache {getattr(lmcache, '__version__', '?')}: LocalDiskBackend of {CHUNKS_ON_DISK} chunks of {CHUNK} bytes"
    )
    found = damage(show=True)
    print(found)
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
