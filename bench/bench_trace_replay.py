"""Replaying both Mooncake traces at all 8 capacities, per policy, against a plain dict.

The pool path is ``kvspec.experiments.trace.replay`` (the reference ``BlockPool`` as a
global cache): through its batch operations (five pool calls a request), and driven
block by block (``lookup`` and ``register`` per block, the path of a pool that offers
no batch operations).  The lower bound replays the same jobs through a plain
``OrderedDict`` LRU (no reference counts, no free queue, no LFU: the least any replay
must do).  Each job runs the three back to back and each is timed in CPU seconds of
this process (``time.process_time``), so that other work on the machine changes the
seconds but hardly the ratios; with ``--rounds N`` each job keeps its fastest round
(the dict, whose work does not depend on the policy, its fastest of every run).
Last, ``kvspec trace`` itself runs as a user runs it (its jobs on two processes), in
wall-clock seconds.  Targets (issue 20): the batch path <= 2x the dict for each policy
in one process; ``kvspec trace`` within 60 s.

    python -m bench.bench_trace_replay [--rounds 1] [--json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvspec.experiments import trace as traces
from kvspec.impl.block_pool import BlockPool
from kvspec.report import emit_json, progress, table
from kvspec.spec.block_pool import POLICIES
from kvspec.spec.components import Offer

POOL_TARGET = 2.0  # batch path / dict, each policy, one process
TRACE_TARGET_S = 60.0  # kvspec trace, wall clock
BLOCK_BY_BLOCK = Offer(BlockPool)  # the reference offering no batch operation


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


def cpu_seconds(call: Callable[..., object], *args: Any) -> float:
    start = time.process_time()
    call(*args)
    return time.process_time() - start


def measure(rounds: int) -> dict[str, Any]:
    """CPU seconds per policy of the batch path, the block-by-block path and the dict; kvspec trace's wall time."""
    loaded = {name: traces.load(name) for name in traces.SHIPPED}
    jobs = [(name, capacity, policy) for name in loaded for policy in POLICIES for capacity in traces.CAPACITIES]
    best: dict[tuple[str, int | None, str], dict[str, float]] = {}
    for _ in range(rounds):
        for job in progress(jobs, "replaying in this process"):
            name, capacity, policy = job
            trace = loaded[name]
            seconds = {
                "batch": cpu_seconds(traces.replay, trace, capacity, policy),
                "block by block": cpu_seconds(traces.replay, trace, capacity, policy, BLOCK_BY_BLOCK),
                "dict": cpu_seconds(dict_replay, trace.blocks, capacity),
            }
            kept = best.setdefault(job, seconds)
            best[job] = {path: min(kept[path], s) for path, s in seconds.items()}
    # The dict's work does not depend on the policy: each (trace, capacity) keeps its fastest of all its runs.
    dict_seconds: dict[tuple[str, int | None], float] = {}
    for (name, capacity, _), seconds in best.items():
        dict_seconds[name, capacity] = min(seconds["dict"], dict_seconds.get((name, capacity), seconds["dict"]))
    per_policy = {
        policy: {
            "batch": sum(s["batch"] for job, s in best.items() if job[2] == policy),
            "block by block": sum(s["block by block"] for job, s in best.items() if job[2] == policy),
            "dict": sum(dict_seconds.values()),
        }
        for policy in POLICIES
    }
    print("running kvspec trace ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    command = [sys.executable, "-c", "from kvspec.cli import main; raise SystemExit(main())", "trace", "--json"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return {"rounds": rounds, "cpu_seconds": per_policy, "kvspec_trace_wall_seconds": time.perf_counter() - start}


def rows(result: dict[str, Any]) -> list[list[Any]]:
    """One row per policy and path: seconds, / dict, target, whether it is met; then kvspec trace."""
    out: list[list[Any]] = []
    for policy, seconds in result["cpu_seconds"].items():
        for path in ("batch", "block by block"):
            ratio = seconds[path] / seconds["dict"]
            target = f"<= {POOL_TARGET}x" if path == "batch" else ""
            met = ("yes" if ratio <= POOL_TARGET else "NO") if target else ""
            out.append([f"reference pool, {policy}, {path}", seconds[path], ratio, target, met])
    dict_seconds = result["cpu_seconds"][POLICIES[0]]["dict"]
    out.append(["plain OrderedDict LRU", dict_seconds, 1.0, "", ""])
    wall = result["kvspec_trace_wall_seconds"]
    met = "yes" if wall <= TRACE_TARGET_S else "NO"
    out.append(["kvspec trace (wall clock, both policies)", wall, "", f"<= {TRACE_TARGET_S:.0f} s", met])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_trace_replay", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="keep each job's fastest of this many rounds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.rounds)
    if args.json:
        emit_json(result)
        return 0
    title = "replay of 2 traces x 8 capacities, per policy (CPU seconds of one process; kvspec trace: wall clock)"
    print(table(["replay", "seconds", "/ dict", "target", "met"], rows(result), title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
