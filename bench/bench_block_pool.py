"""Throughput of the reference pool and manager, and lockstep speed of each machine.

Prints operations per second for allocate+release and for the manager's
fork / append / free cycle at a realistic size (4,096 blocks of 16), and the
steps per second each conformance machine explores in lockstep with the spec
(the model is pure and copies its tuples, so this is the price of checking).

    python -m bench.bench_block_pool
"""

from __future__ import annotations

import sys
import time

from hypothesis import settings

from kvspec.properties import loading, profiles, running, suite
from kvspec.report import table

BLOCKS, BLOCK_SIZE = 4_096, 16
REFERENCE = loading.load_implementation(loading.REFERENCE)


def rate(operation, count: int) -> float:
    start = time.perf_counter()
    operation(count)
    return count / (time.perf_counter() - start)


def allocate_release(count: int) -> None:
    pool = REFERENCE.block_pool(BLOCKS, "lru")
    for _ in range(count):
        pool.release(pool.allocate(4)[::-1])


def fork_append_free(count: int) -> None:
    manager = REFERENCE.block_manager(REFERENCE.block_pool(BLOCKS, "lru"), BLOCK_SIZE)
    manager.add_sequence("prompt", list(range(100)))
    for i in range(count):
        manager.fork("prompt", i)
        manager.append(i, [1, 2, 3])
        manager.free(i)


def main() -> int:
    settings.load_profile(profiles.default_profile())
    rows = [
        ("pool allocate(4) + release", rate(allocate_release, 50_000)),
        ("manager fork + append(3) + free", rate(fork_append_free, 20_000)),
    ]
    print(table(["reference operation (4,096 blocks of 16)", "ops/s"], rows))
    print()
    machine_rows = []
    for declaration in suite.declarations():
        name = declaration.title
        print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        outcome = running.run_machine(declaration.machine, REFERENCE, declaration.settings())
        seconds = time.perf_counter() - start
        steps = outcome.statistics.steps
        machine_rows.append((name, steps, seconds, steps / seconds))
    print(table(["machine (lockstep with the spec)", "steps", "seconds", "steps/s"], machine_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
