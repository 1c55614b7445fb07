"""Time of replaying both Mooncake traces at all 8 capacities x both policies, in one process.

The pool path is ``kvspec.experiments.trace.replay`` (the reference ``BlockPool`` as a
global cache); the lower bound replays the same jobs through a plain ``OrderedDict``
LRU (no reference counts, no free queue, no LFU: the least any replay must do).  Both
run in this process, one job after another, so the ratio compares like with like
(``kvspec trace`` itself spreads the jobs over two processes).

    python -m bench.bench_trace_replay
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict

from kvspec.experiments import trace as traces
from kvspec.report import progress


def dict_replay(blocks: tuple[tuple[int, ...], ...], capacity: int | None) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    limit = capacity or len({b for request in blocks for b in request})
    hit_blocks = 0
    for request in blocks:
        hits = 0
        while hits < len(request) and request[hits] in cache:
            hits += 1
        hit_blocks += hits
        for block in reversed(request[:limit]):
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > limit:
            cache.popitem(last=False)
    return hit_blocks


def main() -> int:
    jobs = [(name, c, p) for name in traces.SHIPPED for p in traces.POLICIES for c in traces.CAPACITIES]
    loaded = {name: traces.load(name) for name in traces.SHIPPED}
    start = time.perf_counter()
    for name, capacity, policy in progress(jobs, "reference pool"):
        traces.replay(loaded[name], capacity, policy)
    pool_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for name, capacity, _ in progress(jobs, "plain dict"):
        dict_replay(loaded[name].blocks, capacity)
    dict_seconds = time.perf_counter() - start
    print(f"{len(jobs)} replays (2 traces x 8 capacities x 2 policies), one process")
    print(f"reference BlockPool:   {pool_seconds:6.2f} s")
    print(f"plain OrderedDict LRU: {dict_seconds:6.2f} s")
    print(f"ratio pool / dict:     {pool_seconds / dict_seconds:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
