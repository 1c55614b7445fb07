"""Time of replaying both Mooncake traces at all 8 capacities x both policies.

The pool path is ``kvspec.experiments.trace.replay`` (the reference ``BlockPool`` as a
global cache); the lower bound replays the same jobs through a plain ``OrderedDict``
LRU (no reference counts, no free queue, no LFU: the least any replay must do).
Printed: the pool one job after another in this process (like against like: the
price of the pool's bookkeeping), the pool as ``kvspec trace`` runs it (its jobs on
two processes), and the dict in this process; each as a ratio to the dict.

    python -m bench.bench_trace_replay
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict

from kvspec.experiments import trace as traces
from kvspec.report import progress, table


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
    traces.replay_all([(str(traces.SHIPPED[name]), capacity, policy) for name, capacity, policy in jobs])
    trace_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for name, capacity, _ in progress(jobs, "plain dict"):
        dict_replay(loaded[name].blocks, capacity)
    dict_seconds = time.perf_counter() - start
    rows = [
        ("reference BlockPool, one process", pool_seconds, pool_seconds / dict_seconds),
        (
            f"reference BlockPool as kvspec trace runs it ({traces.WORKERS} processes)",
            trace_seconds,
            trace_seconds / dict_seconds,
        ),
        ("plain OrderedDict LRU, one process", dict_seconds, 1.0),
    ]
    print(table(["replay of 2 traces x 8 capacities x 2 policies", "seconds", "/ dict"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
