"""The reference against the real engines, side by side in one process.

The reference ``BlockPool`` against vLLM's v1 ``BlockPool`` (4,096 blocks), and the
reference ``RadixCache`` against SGLang's, each driven through its own native API (no
kvspec adapter in the timed loop: vLLM gets its ``KVCacheBlock`` objects and ``bytes``
hashes, SGLang its ``RadixKey`` arrays and ``int64`` tensors, built before timing).  Every
row runs the same operations on both sides; ``ratio`` is the reference's rate over the
engine's (above 1.0: the reference is faster).  Best of ``--repeat`` runs, each on a
fresh structure.  Prints ratios; asserts nothing about time.

    python -m bench.bench_engines               # both comparisons (the engines installed as the README says)
    python -m bench.bench_engines --only vllm   # or --only sglang
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

from kvspec.adapters import importable
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.radix_cache import RadixCache
from kvspec.report import table

BLOCKS = 4_096
BUDGET = 4_096  # tokens the radix tree is kept within under eviction pressure
RUNNING = 8  # requests holding a lock at once under eviction pressure


def best_rate(setup: Callable[[], Any], run: Callable[[Any], int], repeat: int) -> float:
    """Operations per second of ``run(setup())``, best of ``repeat`` fresh runs."""
    best = 0.0
    for _ in range(repeat):
        state = setup()
        start = time.perf_counter()
        operations = run(state)
        best = max(best, operations / (time.perf_counter() - start))
    return best


# -- the block pools -----------------------------------------------------------------------


def pool_rows(repeat: int, scale: float) -> list[tuple[str, float, float]]:
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    n1, n8, cycles = int(50_000 * scale), int(20_000 * scale), int(5_000 * scale)
    hashes = [[f"{c}:{i}".encode() for i in range(8)] for c in range(cycles)]
    keys = [[make_block_hash_with_group_id(h, 0) for h in row] for row in hashes]

    def ref_pool() -> BlockPool:
        return BlockPool(BLOCKS, "lru")

    def vllm_pool() -> Any:
        return VllmBlockPool(BLOCKS + 1, enable_caching=True, hash_block_size=16)  # + the null block

    def ref_alloc1(pool: BlockPool) -> int:
        allocate, release = pool.allocate, pool.release
        for _ in range(n1):
            release(allocate(1))
        return n1

    def vllm_alloc1(pool: Any) -> int:
        get, free = pool.get_new_blocks, pool.free_blocks
        for _ in range(n1):
            free(get(1))
        return n1

    def ref_alloc8(pool: BlockPool) -> int:
        allocate, release = pool.allocate, pool.release
        for _ in range(n8):
            release(allocate(8)[::-1])
        return n8

    def vllm_alloc8(pool: Any) -> int:
        get, free = pool.get_new_blocks, pool.free_blocks
        for _ in range(n8):
            free(reversed(get(8)))  # as vLLM's KVCacheManager frees a request's blocks
        return n8

    def ref_cycle(pool: BlockPool) -> int:
        for row in hashes:
            blocks = pool.allocate(8)
            for block, block_hash in zip(blocks, row, strict=True):
                pool.register(block, block_hash)
            pool.release(blocks[::-1])
            hits = [pool.lookup(block_hash) for block_hash in row]
            pool.share(hits)  # type: ignore[arg-type]
            pool.release(hits[::-1])  # type: ignore[arg-type]
        return cycles

    def vllm_cycle(pool: Any) -> int:
        insert, get_cached = pool._insert_block_hash, pool.get_cached_block
        for row, key_row in zip(hashes, keys, strict=True):
            blocks = pool.get_new_blocks(8)
            for block, key in zip(blocks, key_row, strict=True):
                insert(key, block, num_tokens=None)  # what cache_full_blocks does per full block
            pool.free_blocks(reversed(blocks))
            hits = [get_cached(block_hash, [0])[0] for block_hash in row]
            pool.touch(hits)
            pool.free_blocks(reversed(hits))
        return cycles

    rows = [
        ("allocate(1) + release", ref_alloc1, vllm_alloc1),
        ("allocate(8) + release reversed", ref_alloc8, vllm_alloc8),
        ("prefix cycle: allocate/register/release, lookup+share/release (8 blocks)", ref_cycle, vllm_cycle),
    ]
    return [
        (name, best_rate(ref_pool, ref, repeat), best_rate(vllm_pool, engine, repeat)) for name, ref, engine in rows
    ]


# -- the KV cache managers ------------------------------------------------------------------


def kv_manager_rows(repeat: int, scale: float) -> list[tuple[str, float, float]]:
    """The reference prefix-caching manager against vLLM's full-attention ``KVCacheManager`` through its own
    calls: a request is made (its prompt hashed), looked up, admitted, decoded a token a step, freed."""
    from kvspec.adapters.vllm_kv_cache_manager import engine, kv_cache_manager
    from kvspec.impl.prefix_caching import PrefixCachingBlockManager

    vllm = engine()
    blocks, size, decodes = 4_096, 16, 16
    prompts = sequences(int(2_000 * scale), 64, seed=3)  # nine in ten cut an earlier prompt: hits
    sampling = vllm.SamplingParams(max_tokens=decodes + 1)
    sampling.update_from_generation_config({}, eos_token_id=None)
    hasher = vllm.get_request_block_hasher(size, vllm.sha256)

    def ref_serve(manager: PrefixCachingBlockManager) -> int:
        for seq, prompt in enumerate(prompts):
            manager.add_sequence(seq, prompt)
            for step in range(decodes):
                manager.append(seq, [step])
            manager.free(seq)
        return len(prompts)

    def vllm_serve(manager: Any) -> int:
        lookup, allocate, free = manager.get_computed_blocks, manager.allocate_slots, manager.free
        for seq, prompt in enumerate(prompts):
            request = vllm.Request(str(seq), prompt, sampling, None, block_hasher=hasher)
            hits, cached, _ = lookup(request)
            allocate(request, len(prompt) - cached, cached, hits)
            request.num_computed_tokens = len(prompt)
            for step in range(decodes):
                request.append_output_token_ids(step)
                allocate(request, 1)
                request.num_computed_tokens += 1
            free(request)
        return len(prompts)

    return [
        (
            f"request: admit 64 tokens (hits), {decodes} decodes, free (blocks of {size})",
            best_rate(lambda: PrefixCachingBlockManager(BlockPool(blocks, "lru"), size), ref_serve, repeat),
            best_rate(lambda: kv_cache_manager(blocks, size, [None], caching=True), vllm_serve, repeat),
        )
    ]


# -- the radix caches ----------------------------------------------------------------------


def sequences(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` token sequences of ``length``; each after the first cuts an earlier one at random."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    for _ in range(count):
        prefix: list[int] = []
        if out and rng.random() < 0.9:
            base = rng.choice(out)
            prefix = base[: rng.randrange(len(base))]
        out.append(prefix + [rng.randrange(32_000) for _ in range(length - len(prefix))])
    return out


def radix_rows(repeat: int, scale: float) -> list[tuple[str, float, float]]:
    from kvspec.adapters.sglang import SimulatedAllocator, engine

    sgl = engine()
    torch = sgl.torch

    def workload(count: int, length: int, seed: int) -> tuple[list[list[int]], list[list[int]], list[Any], list[Any]]:
        seqs = sequences(count, length, seed)
        values = [list(range(i * length, (i + 1) * length)) for i in range(count)]
        keys = [sgl.RadixKey(array("q", s)) for s in seqs]
        tensors = [torch.tensor(v, dtype=torch.int64) for v in values]
        return seqs, values, keys, tensors

    def ref_cache() -> RadixCache:
        return RadixCache()

    def sgl_cache() -> Any:
        return sgl.RadixCache.create_simulated(mock_allocator=SimulatedAllocator())

    def insert_match(count: int, length: int) -> tuple[Callable[[Any], int], Callable[[Any], int]]:
        seqs, values, keys, tensors = workload(count, length, seed=length)

        def ref(cache: RadixCache) -> int:
            for seq, vals in zip(seqs, values, strict=True):
                cache.match_prefix(seq)
                cache.insert(seq, vals)
            return count

        def engine_run(cache: Any) -> int:
            match, insert = cache.match_prefix, cache.insert
            for key, tensor in zip(keys, tensors, strict=True):
                match(sgl.MatchPrefixParams(key=key))
                insert(sgl.InsertParams(key=key, value=tensor))
            return count

        return ref, engine_run

    def pressure(count: int, length: int) -> tuple[Callable[[Any], int], Callable[[Any], int]]:
        """SGLang's admission: match, evict down to the budget, insert, lock; finish the oldest running."""
        seqs, values, keys, tensors = workload(count, length, seed=7)

        def ref(cache: RadixCache) -> int:
            running: list[list[int]] = []
            for seq, vals in zip(seqs, values, strict=True):
                matched = len(cache.match_prefix(seq))
                over = cache.total_size() + length - matched - BUDGET
                if over > 0:
                    cache.evict(over)
                cache.insert(seq, vals)
                cache.lock(seq)
                running.append(seq)
                if len(running) > RUNNING:
                    cache.unlock(running.pop(0))
            return count

        def engine_run(cache: Any) -> int:
            running: list[Any] = []
            for key, tensor in zip(keys, tensors, strict=True):
                matched = cache.match_prefix(sgl.MatchPrefixParams(key=key)).device_prefix_len
                # SGLang's scheduler admits by evictable + protected size; total_size() walks the tree
                over = cache.evictable_size() + cache.protected_size() + length - matched - BUDGET
                if over > 0:
                    cache.evict(sgl.EvictParams(num_tokens=over))
                node = cache.insert(sgl.InsertParams(key=key, value=tensor)).last_device_node
                cache.inc_lock_ref(node)
                running.append(node)
                if len(running) > RUNNING:
                    cache.dec_lock_ref(running.pop(0))
            return count

        return ref, engine_run

    def drain(count: int, length: int, step: int) -> tuple[Callable[[], Any], Callable[[], Any], Callable[..., int]]:
        seqs, values, keys, tensors = workload(count, length, seed=11)
        tokens: dict[str, int] = {}

        def ref_filled() -> RadixCache:
            cache = ref_cache()
            for seq, vals in zip(seqs, values, strict=True):
                cache.insert(seq, vals)
            tokens["ref"] = cache.total_size()
            return cache

        def sgl_filled() -> Any:
            cache = sgl_cache()
            for key, tensor in zip(keys, tensors, strict=True):
                cache.insert(sgl.InsertParams(key=key, value=tensor))
            tokens["sgl"] = cache.evictable_size()
            return cache

        def ref(cache: RadixCache) -> int:
            while cache.evict(step):
                pass
            return tokens["ref"]

        def engine_run(cache: Any) -> int:
            while cache.evict(sgl.EvictParams(num_tokens=step)).num_tokens_evicted:
                pass
            return tokens["sgl"]

        return ref_filled, sgl_filled, lambda which, cache: (ref if which == "ref" else engine_run)(cache)

    short, long_ = insert_match(int(4_000 * scale), 32), insert_match(int(400 * scale), 512)
    pressed = pressure(int(4_000 * scale), 64)
    ref_filled, sgl_filled, drain_run = drain(int(2_000 * scale), 64, step=16)
    return [
        ("match + insert, 32 tokens", best_rate(ref_cache, short[0], repeat), best_rate(sgl_cache, short[1], repeat)),
        ("match + insert, 512 tokens", best_rate(ref_cache, long_[0], repeat), best_rate(sgl_cache, long_[1], repeat)),
        (
            f"admission under eviction pressure (64 tokens, {BUDGET:,}-token budget, {RUNNING} locked)",
            best_rate(ref_cache, pressed[0], repeat),
            best_rate(sgl_cache, pressed[1], repeat),
        ),
        (
            "evict drain, 16 tokens at a time (tokens/s)",
            best_rate(ref_filled, lambda c: drain_run("ref", c), repeat),
            best_rate(sgl_filled, lambda c: drain_run("sgl", c), repeat),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_engines", description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("vllm", "sglang"), default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every operation count")
    args = parser.parse_args(argv)
    comparisons = [
        ("vllm", "vLLM v1 BlockPool", pool_rows, "reference BlockPool vs vLLM's (4,096 blocks)"),
        (
            "vllm",
            "vLLM v1 KVCacheManager",
            kv_manager_rows,
            "reference prefix-caching manager vs vLLM's (4,096 blocks)",
        ),
        ("sglang", "SGLang RadixCache", radix_rows, "reference RadixCache vs SGLang's (simulated allocator)"),
    ]
    status = 0
    for module, engine, rows_of, title in comparisons:
        if args.only not in (None, module):
            continue
        if not importable(module):
            print(f"{engine}: not installed, skipped (see the README's 'Real engines' section)\n")
            status = 1
            continue
        print(f"running {title} ...", file=sys.stderr, flush=True)
        rows = rows_of(args.repeat, args.scale)
        shown = [(name, ref, eng, ref / eng) for name, ref, eng in rows]
        print(table(["operation", "reference ops/s", f"{engine} ops/s", "ratio"], shown, title=title))
        print()
    return status


if __name__ == "__main__":
    sys.exit(main())
