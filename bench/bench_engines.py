"""The reference against the real engines, side by side in one process.

The reference ``BlockPool`` against vLLM's v1 ``BlockPool`` (4,096 blocks), and the
reference ``RadixCache`` against SGLang's, each driven through its own native API (no
kvspec adapter in the timed loop: vLLM gets its ``KVCacheBlock`` objects and ``bytes``
hashes, SGLang its ``RadixKey`` arrays and ``int64`` tensors, built before timing).  Every
row runs the same logical work on both sides; ``ratio`` is the reference's rate over the
engine's (above 1.0: the reference is faster).  Each run is on a fresh structure, timed
in CPU seconds of this process (other work on the machine changes both sides alike), the
two sides alternating ``--repeat`` times; each row prints each side's median rate and
the ratio's min and median over the runs made side by side.  The radix rows run at 32,
64, 512 and 2,048 tokens a request.  Prints ratios; asserts nothing about time.

    python -m bench.bench_engines               # both comparisons (the engines installed as the README says)
    python -m bench.bench_engines --only vllm   # or --only sglang, --only transformers
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

from kvspec.adapters import importable
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.radix_cache import RadixCache, Tokens
from kvspec.report import table

BLOCKS = 4_096
RUNNING = 8  # requests holding a lock at once under eviction pressure


Side = tuple[Callable[[], Any], Callable[[Any], int]]  # a fresh structure, and a run over it answering its count
Rates = tuple[list[float], list[float]]  # the reference's rate and the engine's, one a run, runs side by side


def cpu_rate(setup: Callable[[], Any], run: Callable[[Any], int]) -> float:
    """Operations per CPU second of this process of ``run(setup())``: other work on the machine changes the
    seconds of both sides of a row alike, not their ratio."""
    state = setup()
    start = time.process_time()
    operations = run(state)
    return operations / max(time.process_time() - start, 1e-9)


def alternating(reference: Side, engine: Side, repeat: int) -> Rates:
    """Each side run ``repeat`` times, the two alternating, each run on a fresh structure."""
    rates: Rates = ([], [])
    for _ in range(repeat):
        rates[0].append(cpu_rate(*reference))
        rates[1].append(cpu_rate(*engine))
    return rates


# -- the block pools -----------------------------------------------------------------------


def pool_rows(repeat: int, scale: float) -> list[tuple[str, list[float], list[float]]]:
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
    return [(name, *alternating((ref_pool, ref), (vllm_pool, engine), repeat)) for name, ref, engine in rows]


# -- the KV cache managers ------------------------------------------------------------------


def kv_manager_rows(repeat: int, scale: float) -> list[tuple[str, list[float], list[float]]]:
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
            *alternating(
                (lambda: PrefixCachingBlockManager(BlockPool(blocks, "lru"), size), ref_serve),
                (lambda: kv_cache_manager(blocks, size, [None], caching=True), vllm_serve),
                repeat,
            ),
        )
    ]


# -- the radix caches ----------------------------------------------------------------------


RADIX_LENGTHS = (32, 64, 512, 2_048)  # tokens a request, each a regime of every radix row
RADIX_TOKENS = 256_000  # tokens the requests of one regime add up to (at --scale 1)


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


class FreedSegments:
    """The allocator SGLang's simulated tree frees into: it keeps each freed leaf's values, as the reference
    answers them (the adapter's allocator also lists them token by token, which is not the tree's work)."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[Any] = []

    def free_segment(self, free_index: Any, *, start_pos: int = 0) -> None:
        self.freed.append(free_index)


def radix_rows(repeat: int, scale: float) -> list[tuple[str, list[float], list[float]]]:
    """Every radix row at every length of ``RADIX_LENGTHS``; each side run ``repeat`` times, alternating."""
    from kvspec.adapters.sglang import engine

    sgl = engine()
    rows = []
    for length in RADIX_LENGTHS:
        count = max(2 * RUNNING, int(RADIX_TOKENS * scale) // length)
        for name, reference, sglang in radix_regimes(sgl, count, length):
            rows.append((f"{name}, {length:,} tokens", *alternating(reference, sglang, repeat)))
    return rows


def radix_regimes(sgl: Any, count: int, length: int) -> list[tuple[str, Side, Side]]:
    """The radix rows at one length: each the same logical work on both sides, through each one's own calls.
    Each side gets a request's key and values made once, before timing, as its scheduler makes them: SGLang
    its ``RadixKey`` arrays and ``int64`` tensors, the reference its checked ``Tokens``."""
    lists = sequences(count, length, seed=length)
    seqs = [Tokens(s) for s in lists]
    values = [Tokens(range(i * length, (i + 1) * length)) for i in range(count)]
    keys = [sgl.RadixKey(array("q", s)) for s in lists]
    tensors = [sgl.torch.tensor(v, dtype=sgl.torch.int64) for v in values]
    budget = RUNNING * length * 2  # the tree is kept within 16 requests' worth of tokens: it evicts nearly every time

    def sgl_cache() -> Any:
        return sgl.RadixCache.create_simulated(mock_allocator=FreedSegments())

    def ref_filled() -> RadixCache:
        cache = RadixCache()
        for seq, vals in zip(seqs, values, strict=True):
            cache.insert(seq, vals)
        return cache

    def sgl_filled() -> Any:
        cache = sgl_cache()
        for key, tensor in zip(keys, tensors, strict=True):
            cache.insert(sgl.InsertParams(key=key, value=tensor))
        return cache

    def ref_insert_match(cache: RadixCache) -> int:
        for seq, vals in zip(seqs, values, strict=True):
            cache.match_prefix(seq)
            cache.insert(seq, vals)
        return count

    def sgl_insert_match(cache: Any) -> int:
        match, insert = cache.match_prefix, cache.insert
        for key, tensor in zip(keys, tensors, strict=True):
            match(sgl.MatchPrefixParams(key=key))
            insert(sgl.InsertParams(key=key, value=tensor))
        return count

    def ref_pressure(cache: RadixCache) -> int:
        """SGLang's admission: match, evict down to the budget, insert, lock; finish the oldest running."""
        running: list[Tokens] = []
        for seq, vals in zip(seqs, values, strict=True):
            over = cache.total_size() + length - len(cache.match_prefix(seq)) - budget
            if over > 0:
                cache.evict(over)
            cache.insert(seq, vals)
            cache.lock(seq)
            running.append(seq)
            if len(running) > RUNNING:
                cache.unlock(running.pop(0))
        return count

    def sgl_pressure(cache: Any) -> int:
        running: list[Any] = []
        for key, tensor in zip(keys, tensors, strict=True):
            matched = cache.match_prefix(sgl.MatchPrefixParams(key=key)).device_prefix_len
            # SGLang's scheduler admits by evictable + protected size; total_size() walks the tree
            over = cache.evictable_size() + cache.protected_size() + length - matched - budget
            if over > 0:
                cache.evict(sgl.EvictParams(num_tokens=over))
            node = cache.insert(sgl.InsertParams(key=key, value=tensor)).last_device_node
            cache.inc_lock_ref(node)
            running.append(node)
            if len(running) > RUNNING:
                cache.dec_lock_ref(running.pop(0))
        return count

    def ref_drain(step: int) -> Callable[[RadixCache], int]:
        def run(cache: RadixCache) -> int:
            return sum(len(evicted) for evicted in iter(lambda: cache.evict(step), ()))

        return run

    def sgl_drain(step: int) -> Callable[[Any], int]:
        def run(cache: Any) -> int:
            evict, params = cache.evict, sgl.EvictParams(num_tokens=step)
            return sum(iter(lambda: evict(params).num_tokens_evicted, 0))

        return run

    everything = count * length  # more than the tree holds: one call evicts it all
    return [
        ("match + insert", (RadixCache, ref_insert_match), (sgl_cache, sgl_insert_match)),
        (
            f"admission under eviction pressure ({budget:,}-token budget, {RUNNING} locked)",
            (RadixCache, ref_pressure),
            (sgl_cache, sgl_pressure),
        ),
        (
            "evict the whole tree in one call (tokens/s)",
            (ref_filled, ref_drain(everything)),
            (sgl_filled, sgl_drain(everything)),
        ),
        (
            "evict a request's worth a call (tokens/s; SGLang heaps every evictable leaf per call, "
            "the reference pops its standing heap)",
            (ref_filled, ref_drain(length)),
            (sgl_filled, sgl_drain(length)),
        ),
    ]


# -- SGLang's radix cache over its paged allocator; HF transformers' continuous-batching cache ---------


def page_rows(repeat: int, scale: float) -> list[tuple[str, list[float], list[float]]]:
    """The reference page manager against SGLang's tree over its real allocator, both behind the radix-page-manager
    calls (the engine through ``kvspec.adapters.sglang_pages``, whose replayed scheduler calls are the engine's)."""
    from kvspec.adapters.sglang_pages import SglangPages
    from kvspec.impl.radix_pages import RadixPageManager

    pages, page_size, decodes = 512, 16, 16
    prompts = sequences(int(1_000 * scale), 64, seed=5)

    def serve(manager: Any) -> int:
        for rid, prompt in enumerate(prompts):
            if manager.admit(rid, prompt) is None:
                continue
            for step in range(decodes):
                manager.decode(rid, step)
            manager.release(rid, True)
        return len(prompts)

    def reference() -> RadixPageManager:
        return RadixPageManager(pages, page_size)

    def engine_pages() -> Any:
        return SglangPages(pages, page_size)

    title = f"serve: admit 64 tokens (shared prefixes), {decodes} decodes, release (pages of {page_size})"
    return [(title, *alternating((reference, serve), (engine_pages, serve), repeat))]


def hf_rows(repeat: int, scale: float) -> list[tuple[str, list[float], list[float]]]:
    """The reference block and sliding-window managers against HF's allocators through their own calls
    (``can_store_request_tokens``, ``free_blocks``, ``try_to_free_sectors``; no forward pass).  The reference
    block manager answers each write's slots (``WritePlan.slots``), which HF's batch builder computes at every
    step for every request it schedules (``extend_read_and_write_indices``, writes only: the reference reads
    nothing); the sliding-window manager answers none, and HF computes none for it."""
    from kvspec.adapters.transformers import engine, paged_cache
    from kvspec.impl.block_manager import BlockManager
    from kvspec.impl.sliding_window import SlidingWindowManager

    hf = engine()
    blocks, size, window, prompt, decodes = 512, 16, 256, 64, 32
    requests = int(2_000 * scale)

    def ref_requests(manager: Any) -> int:
        for seq in range(requests):
            manager.add_sequence(seq, list(range(prompt)))
            for step in range(decodes):
                manager.append(seq, [step])
            manager.free(seq)
        return requests

    def ref_windows(manager: Any) -> int:
        for seq in range(requests // 8):
            manager.add_sequence(seq, prompt)
            for _ in range(8 * decodes):
                manager.append(seq, 1)
            manager.free(seq)
        return requests // 8

    def hf_requests(cache: Any, count: int = requests, steps: int = decodes, slots: bool = True) -> int:
        store, free, free_sectors = cache.can_store_request_tokens, cache.free_blocks, cache.pool.try_to_free_sectors
        indices = cache.extend_read_and_write_indices
        for seq in range(count):
            state = hf.RequestState(request_id=str(seq), initial_tokens=list(range(prompt)))
            store(state, prompt)
            if slots:
                indices(state.request_id, 0, prompt, None, [[]])
            state.position_offset = prompt
            for _ in range(steps):
                store(state, 1)
                if slots:
                    indices(state.request_id, state.position_offset, 1, None, [[]])
                state.position_offset += 1
            free(state.request_id)
            free_sectors()
        return count

    return [
        (
            f"admit {prompt}, {decodes} decodes, free, each write's slots (blocks of {size})",
            *alternating(
                (lambda: BlockManager(BlockPool(blocks, "lru"), size), ref_requests),
                (lambda: paged_cache(blocks, size), hf_requests),
                repeat,
            ),
        ),
        (
            f"sliding window of {window}: admit {prompt}, {8 * decodes} decodes, free (HF: a ring)",
            *alternating(
                (lambda: SlidingWindowManager(BlockPool(blocks, "lru"), size, window), ref_windows),
                (
                    lambda: paged_cache(blocks, size, window),
                    lambda c: hf_requests(c, requests // 8, 8 * decodes, False),
                ),
                repeat,
            ),
        ),
    ]


RowsOf = Callable[[int, float], list[tuple[str, list[float], list[float]]]]  # (repeat, scale) -> rows
COMPARISONS: tuple[tuple[str, str, RowsOf, str], ...] = (  # the engine's module, its name, its rows, the title
    ("vllm", "vLLM v1 BlockPool", pool_rows, "reference BlockPool vs vLLM's (4,096 blocks)"),
    ("vllm", "vLLM v1 KVCacheManager", kv_manager_rows, "reference prefix-caching manager vs vLLM's (4,096 blocks)"),
    ("sglang", "SGLang RadixCache", radix_rows, "reference RadixCache vs SGLang's (simulated allocator)"),
    ("sglang", "SGLang pages", page_rows, "reference RadixPageManager vs SGLang's RadixCache + paged allocator"),
    ("transformers", "HF continuous batching", hf_rows, "reference managers vs HF's PagedAttentionCache"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_engines", description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("vllm", "sglang", "transformers"), default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every operation count")
    args = parser.parse_args(argv)
    status = 0
    for module, engine, rows_of, title in COMPARISONS:
        if args.only not in (None, module):
            continue
        if not importable(module):
            print(f"{engine}: not installed, skipped (see the README's 'Real engines' section)\n")
            status = 1
            continue
        print(f"running {title} ...", file=sys.stderr, flush=True)
        print(table(*columns(engine, rows_of(args.repeat, args.scale)), title=title))
        print()
    return status


def columns(engine: str, rows: list[tuple[str, list[float], list[float]]]) -> tuple[list[str], list[list[Any]]]:
    """A comparison's headers and rows: each side's median rate, and the ratio's min and median over runs."""
    headers = ["operation", "reference ops/s (median)", f"{engine} ops/s (median)", "ratio min", "ratio median"]
    return headers, [[name, *ratios(ref, eng)] for name, ref, eng in rows]


def ratios(reference: list[float], engine: list[float]) -> list[float]:
    """Each side's median rate, then min and median of the ratio of runs made side by side."""
    ratios = [r / e for r, e in zip(reference, engine, strict=True)]
    return [statistics.median(reference), statistics.median(engine), min(ratios), statistics.median(ratios)]


if __name__ == "__main__":
    sys.exit(main())
