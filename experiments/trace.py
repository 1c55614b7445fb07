"""Replay Mooncake traces through the reference block pool used as one global prefix cache.

``kvspec trace [PATH ...] [--policy lru|lfu] [--capacity N ...] [--json]``; no
PATH replays both shipped traces (experiments/data, FAST'25 release).

A trace line is a request: arrival (ms), input and output length, and
``hash_ids`` -- chained hashes of its 512-token blocks (equal id = equal whole
prefix), so they go into the pool unchanged.  Each request looks its blocks up
in order and *hits* the run before the first miss (those blocks are shared:
touched); it then allocates the rest -- evicting free cached blocks in the
policy's order -- registers them, and releases everything, last block first,
so that all its blocks stay cached.  Hit rate = hit blocks / all blocks
(lecture §8.4, Mooncake Table 1).

A pool that offers the batch operations (``lookup_prefix``, ``register_blocks``;
see ``kvspec.spec.block_pool``) serves a request in five calls; one that does not
is driven block by block through ``lookup`` and ``register``, with the same hits.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
from collections.abc import Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from kvspec.impl.block_pool import BlockPool
from kvspec.report import emit_json, progress, pyplot, table
from kvspec.spec.batch_pool import LOOKUP_PREFIX, REGISTER_BLOCKS, BatchBlockPool
from kvspec.spec.block_pool import POLICIES, Policy
from kvspec.spec.block_pool import BlockPool as PoolProtocol
from kvspec.spec.components import Offer, every_operation

DATA = Path(__file__).parent / "data"
SHIPPED = {"conversation": DATA / "conversation_trace.jsonl.gz", "synthetic": DATA / "synthetic_trace.jsonl.gz"}
BLOCK_TOKENS = 512
WORKERS = 2
CAPACITIES: tuple[int | None, ...] = (1_000, 5_000, 10_000, 20_000, 30_000, 50_000, 100_000, None)  # None: unbounded
REFERENCE_POOL: Offer[[int, Policy], PoolProtocol] = Offer(BlockPool, every_operation("block_pool"))
BATCH_OPERATIONS = (LOOKUP_PREFIX, REGISTER_BLOCKS)
# FAST'25 (Mooncake) Table 2: requests, mean input, mean output of each trace (see experiments/data/README.md).
TABLE_2 = {"conversation": (12_031, 12_035, 343), "synthetic": (3_993, 15_325, 149)}


@attrs.frozen
class Trace:
    name: str
    arrivals_ms: tuple[int, ...]
    input_lengths: tuple[int, ...]
    output_lengths: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]


def load(path: str | Path) -> Trace:
    """A Mooncake-format trace: JSON lines, gzipped or not; a shipped name ('conversation') works too."""
    path = SHIPPED.get(str(path), Path(path))
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    name = Path(path).name.split("_trace")[0].split(".")[0]
    return Trace(
        name=name,
        arrivals_ms=tuple(r["timestamp"] for r in rows),
        input_lengths=tuple(r["input_length"] for r in rows),
        output_lengths=tuple(r["output_length"] for r in rows),
        blocks=tuple(tuple(r["hash_ids"]) for r in rows),
    )


def statistics(trace: Trace) -> dict[str, float | int]:
    n = len(trace.blocks)
    seen: dict[int, int] = {}
    for request in trace.blocks:
        for block in request:
            seen[block] = seen.get(block, 0) + 1
    return {
        "requests": n,
        "duration_s": (trace.arrivals_ms[-1] - trace.arrivals_ms[0]) / 1000,
        "mean_input": sum(trace.input_lengths) / n,
        "mean_output": sum(trace.output_lengths) / n,
        "blocks": sum(seen.values()),
        "distinct_blocks": len(seen),
        "seen_once_share": sum(1 for c in seen.values() if c == 1) / len(seen),
        "most_uses": max(seen.values()),
    }


def replay(
    trace: Trace, capacity: int | None, policy: Policy, pool: Offer[[int, Policy], PoolProtocol] = REFERENCE_POOL
) -> tuple[int, ...]:
    """Hit blocks of each request with a pool of ``capacity`` blocks (None: one per distinct block)."""
    if capacity is None:
        capacity = len({b for request in trace.blocks for b in request})
    built = pool(capacity, policy)
    if all(map(pool.offers, BATCH_OPERATIONS)) and isinstance(built, BatchBlockPool):
        return replay_requests(built, trace.blocks)
    return _replay_block_by_block(built, trace.blocks)


def replay_requests(pool: BatchBlockPool, requests: Sequence[Sequence[Hashable]]) -> tuple[int, ...]:
    """Five pool calls a request: hit the cached run, store what fits of the rest (evicting in the policy's
    order), release all of it, last block first.  This loop is a replay's whole cost, so its calls are bound
    once."""
    lookup_prefix, share, allocate, register_blocks = (
        pool.lookup_prefix,
        pool.share,
        pool.allocate,
        pool.register_blocks,
    )
    release, num_free = pool.release, pool.num_free
    hits_per_request = []
    for request in requests:
        held = lookup_prefix(request)
        hits = len(held)
        share(held)
        misses = request[hits : hits + num_free()]
        fresh = allocate(len(misses))
        register_blocks(fresh, misses)
        held += fresh
        held.reverse()
        release(held)
        hits_per_request.append(hits)
    return tuple(hits_per_request)


def _replay_block_by_block(pool: PoolProtocol, requests: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The same requests through ``lookup`` and ``register``, one block at a time."""
    lookup, register = pool.lookup, pool.register
    hits_per_request = []
    for request in requests:
        held = []
        for block_hash in request:
            block = lookup(block_hash)
            if block is None:
                break
            held.append(block)
        hits = len(held)
        pool.share(held)
        misses = request[hits : hits + pool.num_free()]
        fresh = pool.allocate(len(misses))
        for block, block_hash in zip(fresh, misses, strict=True):
            register(block, block_hash)
        held += fresh
        pool.release(held[::-1])
        hits_per_request.append(hits)
    return tuple(hits_per_request)


def seen_before_hits(requests: Sequence[Sequence[Hashable]]) -> tuple[int, ...]:
    """What a cache that never evicts hits: each request's run of blocks seen before it.  ``replay`` with an
    unbounded pool hits the same (``kvspec repro prefix-cache`` checks it on the shipped traces)."""
    seen: set[Hashable] = set()
    hits = []
    for request in requests:
        hits.append(next((i for i, block in enumerate(request) if block not in seen), len(request)))
        seen.update(request)
    return tuple(hits)


def hit_rate(trace: Trace, hits: Sequence[int]) -> float:
    return sum(hits) / sum(len(request) for request in trace.blocks)


def replay_all(jobs: Sequence[tuple[str, int | None, Policy]], label: str = "replaying") -> list[tuple[int, ...]]:
    """``replay`` for each (trace path, capacity, policy), on two processes; results in job order."""
    with ProcessPoolExecutor(max_workers=WORKERS) as workers:
        futures = [workers.submit(_replay_job, *job) for job in jobs]
        return [future.result() for future in progress(futures, label)]


def _replay_job(path: str, capacity: int | None, policy: Policy) -> tuple[int, ...]:
    return replay(load_once(path), capacity, policy)


@functools.cache
def load_once(path: str) -> Trace:
    return load(path)


def sweep(paths: Sequence[str], capacities: Sequence[int | None], policies: Sequence[Policy]) -> list[dict[str, Any]]:
    jobs = [(path, c, p) for path in paths for p in policies for c in capacities]
    rows = []
    for (path, capacity, policy), hits in zip(jobs, replay_all(jobs), strict=True):
        trace = load_once(path)
        rows.append({"trace": trace.name, "policy": policy, "capacity": capacity, "hit_rate": hit_rate(trace, hits)})
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["trace"], r["policy"]) for r in rows}):
        points = [r for r in rows if (r["trace"], r["policy"]) == key and r["capacity"] is not None]
        axes.plot([r["capacity"] for r in points], [r["hit_rate"] for r in points], marker="o", label=" ".join(key))
    axes.set(xscale="log", xlabel="cache capacity (512-token blocks)", ylabel="prefix hit rate (blocks)")
    axes.legend()
    figure.savefig(path, bbox_inches="tight")
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvspec trace", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="Mooncake-format traces (default: both shipped traces)")
    parser.add_argument("--policy", choices=POLICIES, action="append", help="default: both")
    parser.add_argument("--capacity", type=int, action="append", help="blocks (default: 1k .. 100k and unbounded)")
    parser.add_argument("--plot", type=Path, help="write hit rate vs capacity here (needs matplotlib)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    paths = [str(p) for p in args.paths or SHIPPED]
    traces = [load_once(p) for p in paths]
    capacities = args.capacity or list(CAPACITIES)
    rows = sweep(paths, capacities, args.policy or list(POLICIES))
    stats = {t.name: statistics(t) for t in traces}
    checks = {
        name: {"requests": paper[0], "mean_input": paper[1], "mean_output": paper[2]}
        for name, paper in TABLE_2.items()
        if name in stats
    }
    if args.json:
        emit_json({"statistics": stats, "table_2": checks, "hit_rates": rows})
        return 0
    headers = ["trace", "requests", "duration s", "mean input", "mean output", "distinct blocks", "seen once"]
    print(
        table(
            headers,
            [[n, *(s[k] for k in list(s)[:4]), s["distinct_blocks"], s["seen_once_share"]] for n, s in stats.items()],
        )
    )
    if checks:
        print()
        print(
            table(
                ["trace", "requests (paper)", "mean input (paper)", "mean output (paper)", "matches"],
                [
                    [
                        n,
                        c["requests"],
                        c["mean_input"],
                        c["mean_output"],
                        "yes" if matches_table_2(n, stats[n]) else "NO",
                    ]
                    for n, c in checks.items()
                ],
                title="FAST'25 Table 2 (means rounded to whole tokens)",
            )
        )
    print()
    keys = sorted({(r["trace"], r["policy"]) for r in rows})
    hit = {(r["trace"], r["policy"], r["capacity"]): r["hit_rate"] for r in rows}
    print(
        table(
            ["capacity (blocks)", *(f"{t} {p}" for t, p in keys)],
            [
                ["unbounded" if c is None else f"{c:,}", *(round(100 * hit[(t, p, c)], 1) for t, p in keys)]
                for c in capacities
            ],
            title="prefix hit rate, % (blocks hit before the first miss / all blocks)",
        )
    )
    if args.plot:
        print(f"\nplot: {args.plot}" if plot(rows, args.plot) else "\nplot skipped: matplotlib is not installed")
    return 0


def matches_table_2(name: str, measured: dict[str, float | int]) -> bool:
    """A shipped trace's requests and mean input and output (rounded) against FAST'25 Table 2's."""
    return (measured["requests"], round(measured["mean_input"]), round(measured["mean_output"])) == TABLE_2[name]
