"""The reference tiered store against LMCache's CPU backend and vLLM's CPU offloading manager, in one process.

One DRAM tier of ``--chunks`` blocks on one node, LRU, and one stream of requests for the blocks of
documents drawn from a skewed distribution (Zipf-like, so some blocks are hot and most are not): per
block, a lookup; on a hit, a read (a use); on a miss, a store -- evicting the least recently used
block once the tier is full.  The same stream, on each side through its own native API (no kvspec
adapter in the timed loop):

* reference -- ``kvspec.impl.kv_store.KVStore`` of one node and one tier: ``get``, then ``put`` on a miss.
* LMCache -- ``LocalCPUBackend``: ``contains(key, pin=True)``, ``get_blocking``, ``touch_cache`` and
  ``unpin`` on a hit (its retrieve path, where a hit is a use); ``allocate`` (evicting) and
  ``submit_put_task`` on a miss; chunks of 16 float32 tokens (4 KiB aligned).
* vLLM -- ``CPUOffloadingManager``: a request per document; ``lookup``, then ``prepare_load`` and
  ``complete_load`` on a hit, ``prepare_store`` and ``complete_store`` on a miss; ``on_request_finished``.

``ratio`` is the reference's rate over the engine's (above 1.0: the reference is faster).  Each run is on a
fresh store, timed in CPU seconds of this process (other work on the machine changes both sides alike), the
reference and each engine alternating ``--repeat`` times; each row prints each side's median rate and the
ratio's min and median over the runs made side by side.  Prints ratios; asserts nothing about time.

    python -m bench.bench_store                    # both engines (installed as the README says)
    python -m bench.bench_store --only lmcache     # or --only vllm
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.bench_engines import ratios
from kvspec.adapters import importable
from kvspec.impl.kv_store import KVStore
from kvspec.report import table
from kvspec.spec.conventions import StoreConventions

ONE_TIER = StoreConventions(tiers=("cpu",), max_nodes=1, policies=("lru",))
BLOCKS_PER_DOCUMENT = 4
TOKENS = tuple(range(16))


def stream(chunks: int, requests: int, seed: int = 0) -> list[list[int]]:
    """Each request: the block ids of one document, drawn by a Zipf-like law over 8 tiers' worth of documents."""
    rng = random.Random(seed)
    documents = 8 * chunks // BLOCKS_PER_DOCUMENT
    weights = [1.0 / (rank + 1) for rank in range(documents)]
    drawn = rng.choices(range(documents), weights, k=requests)
    return [[doc * BLOCKS_PER_DOCUMENT + b for b in range(BLOCKS_PER_DOCUMENT)] for doc in drawn]


Side = tuple[Callable[[], Any], Callable[[Any], tuple[int, int]]]  # a fresh store, and a run answering (blocks, hits)


def cpu_rate(setup: Callable[[], Any], run: Callable[[Any], tuple[int, int]]) -> tuple[float, int]:
    """Blocks per CPU second of this process of ``run(setup())``, and its hits."""
    state = setup()
    start = time.process_time()
    blocks, hits = run(state)
    return blocks / max(time.process_time() - start, 1e-9), hits


def alternating(reference: Side, engine: Side, repeat: int) -> tuple[list[float], list[float], int, int]:
    """Each side run ``repeat`` times, the two alternating: each side's rates, one a run, and each one's hits."""
    rates: tuple[list[float], list[float]] = ([], [])
    hits = [0, 0]
    for _ in range(repeat):
        for side, (setup, run) in enumerate((reference, engine)):
            rate, hits[side] = cpu_rate(setup, run)
            rates[side].append(rate)
    return rates[0], rates[1], hits[0], hits[1]


def reference(chunks: int, requests: list[list[int]]) -> tuple[Callable[[], Any], Callable[[Any], tuple[int, int]]]:
    def setup() -> KVStore:
        return KVStore(1, (chunks,), ("lru",), ONE_TIER)

    def run(store: KVStore) -> tuple[int, int]:
        get, put, hits = store.get, store.put, 0
        for request in requests:
            for block in request:
                if get(0, block) is None:
                    put(0, block, TOKENS)
                else:
                    hits += 1
        return sum(map(len, requests)), hits

    return setup, run


def lmcache(chunks: int, requests: list[list[int]]) -> tuple[Callable[[], Any], Callable[[Any], tuple[int, int]]]:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.pin_monitor import PinMonitor
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    config = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=True, lmcache_instance_id="bench")
    PinMonitor.GetOrCreate(config)
    shape, dtype, layout = torch.Size([2, 1, 16, 32]), torch.float32, MemoryFormat.KV_2LTD  # 4 KiB a chunk
    keys = {block: CacheEngineKey("bench", 1, 0, block, dtype) for request in requests for block in request}

    def setup() -> Any:
        return LocalCPUBackend(config=config, memory_allocator=HostMemoryAllocator(chunks * 4096))

    def run(backend: Any) -> tuple[int, int]:
        contains, get, touch, unpin = backend.contains, backend.get_blocking, backend.touch_cache, backend.unpin
        allocate, submit, hits = backend.allocate, backend.submit_put_task, 0
        for request in requests:
            for block in request:
                key = keys[block]
                if contains(key, pin=True):
                    get(key).ref_count_down()
                    touch()
                    unpin(key)
                    hits += 1
                else:
                    memory = allocate(shape, dtype, layout, busy_loop=False)
                    submit(key, memory)
                    memory.ref_count_down()
        return sum(map(len, requests)), hits

    return setup, run


def vllm(chunks: int, requests: list[list[int]]) -> tuple[Callable[[], Any], Callable[[Any], tuple[int, int]]]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    keys = {block: make_offload_key(block.to_bytes(8, "big"), 0) for request in requests for block in request}

    def setup() -> Any:
        return CPUOffloadingManager(num_chunks=chunks, cache_policy="lru")

    def run(manager: Any) -> tuple[int, int]:
        hits = 0
        for number, request in enumerate(requests):
            context = ReqContext(req_id=str(number))
            manager.on_new_request(context)
            for block in request:
                key = [keys[block]]
                if manager.lookup(key[0], context) == LookupResult.HIT:
                    manager.prepare_load(key, context)
                    manager.complete_load(key, context)
                    hits += 1
                elif manager.prepare_store(key, context) is not None:
                    manager.complete_store(key, context)
            manager.on_request_finished(context)
        return sum(map(len, requests)), hits

    return setup, run


ENGINES = {
    "lmcache": ("LMCache LocalCPUBackend", "lmcache", lmcache),
    "vllm": ("vLLM CPUOffloadingManager", "vllm", vllm),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1_024, help="blocks the DRAM tier holds")
    parser.add_argument("--requests", type=int, default=20_000, help="documents requested")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=sorted(ENGINES))
    args = parser.parse_args(argv)
    requests = stream(args.chunks, args.requests)
    rows = []
    for name, (title, module, build) in ENGINES.items():
        if args.only not in (None, name):
            continue
        if not importable(module):
            print(f"{title}: not installed (kvspec/adapters/install-engines.sh); skipped", file=sys.stderr)
            continue
        mine, theirs, mine_hits, their_hits = alternating(
            reference(args.chunks, requests), build(args.chunks, requests), args.repeat
        )
        rows.append((f"reference vs {title}", *ratios(mine, theirs), mine_hits, their_hits))
    blocks = sum(map(len, requests))
    headers = ("one DRAM tier, LRU", "reference blocks/s (median)", "engine blocks/s (median)", "ratio min")
    print(
        table(
            (*headers, "ratio median", "reference hits", "engine hits"),
            rows,
            title=f"{blocks:,} block lookups over {args.chunks:,} chunks (a hit is read, a miss stored), CPU seconds, "
            f"{args.repeat} runs a side, alternating",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
