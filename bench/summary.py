"""Every speed ratio of issues 20 and 27 in one table, each beside its target: where kvspec stands.

    python -m bench.summary [--only AREA ...] [--skip AREA ...] [--engines-python PATH] [--json]

Each area runs its bench in a subprocess, whose progress lines go to stderr as it runs:

* ``attention`` -- ``bench.bench_attention``: paged / contiguous batched decode, at 2 BLAS threads and
  at every core (target <= 1.25x);
* ``trace`` -- ``bench.bench_trace_replay``: the reference pool's batch path / a plain ``OrderedDict``,
  per policy, in CPU seconds of one process (<= 2x), and ``kvspec trace``'s wall time (<= 60 s);
* ``engines`` -- ``bench.bench_engines``: every row of every comparison whose engine imports (vLLM's
  ``BlockPool`` and ``KVCacheManager``, SGLang's ``RadixCache`` alone and over its paged allocator, HF's
  continuous-batching cache), each in every regime (>= 1.0x; a row's value is its median ratio over runs
  alternating in CPU seconds, the lowest run beside it), run by the interpreter where the engines import
  (``--engines-python``, default ``$KVSPEC_ENGINES_PYTHON``, else this one); skipped where none imports;
* ``store`` -- ``bench.bench_store``: the reference tiered store against LMCache's CPU backend and vLLM's
  CPU offloading manager, its default stream (>= 1.0x, median and lowest as above), with the engines'
  interpreter as above;
* ``repro`` -- the wall time of each ``kvspec repro`` (<= 60 s; ``kvspec trace`` is in ``trace``) and its
  CPU time, user and system of all its processes (<= 20 s: the wall time's headroom on a loaded machine);
* ``step share`` -- ``bench.bench_step_share``: per conformance machine against the reference, the CPU ticks
  Hypothesis's code ran over those kvspec's ran (models, implementation, snapshots, invariants, the machine's
  rules), sampled, under the ``ci`` profile (>= 1.0x: kvspec's share of a step at most Hypothesis's).

Seconds depend on the machine and on what else runs on it; the ratios much less.  Nothing is asserted:
the last column says whether each row meets its target, and under the table each row that does not is
named with the reason it does not (``BELOW_TARGET``), where one is known.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from kvspec.report import emit_json, table

Row = tuple[str, str, str, str, bool | None]  # area, measure, value, target, met (None: not measured)
AREAS = ("attention", "trace", "engines", "store", "repro", "step share")
ATTENTION_TARGET, POOL_TARGET, ENGINE_TARGET, WALL_TARGET_S, SHARE_TARGET = 1.25, 2.0, 1.0, 60.0, 1.0
CPU_TARGET_S = 20.0
RUN_KVSPEC = "from kvspec.cli import main; raise SystemExit(main())"
ENGINE_ROWS = """
import json, sys
from bench import bench_engines
from kvspec.adapters import importable
rows = {}
for module, engine, rows_of, _ in bench_engines.COMPARISONS:
    if importable(module):
        print(f"summary: engines: {engine} ...", file=sys.stderr, flush=True)
        rows[engine] = rows_of(3, 1.0)
json.dump(rows, sys.stdout)
"""
STORE_ROWS = """
import json, sys
from bench import bench_store
from kvspec.adapters import importable
requests = bench_store.stream(1_024, 20_000)
rows = {}
for title, module, build in bench_store.ENGINES.values():
    if importable(module):
        mine, theirs, _, _ = bench_store.alternating(bench_store.reference(1_024, requests), build(1_024, requests), 3)
        rows[title] = [mine, theirs]
json.dump(rows, sys.stdout)
"""
BELOW_TARGET: dict[str, str] = {  # the beginning of "area: measure" -> why the row misses its target, as last measured
    "step share: block pool (1,024 blocks)": "the pool's whole-state rules read every block at every step, and the "
    "machine asks refcount() of each of the 1,024 (the snapshot is checked against what the pool answers): kvspec's "
    "step grows with the pool, Hypothesis's does not",
    "step share: block manager (512 blocks of 16)": "the snapshot and the pool's whole-state rules read all 512 "
    "blocks of each device at every step, both devices' every step: kvspec's step grows with the pool",
    "step share: paged attention logits": "each step runs the tiny model's forward twice, through the paged cache and "
    "through the contiguous twin: the numbers the rule compares are computed in the step",
    "step share: scheduler: paged = contiguous logits": "each scheduler iteration runs the tiny model's forward "
    "twice (paged, and the contiguous twin), and one Hypothesis step drives several iterations (the opening, one "
    "step of Hypothesis's, up to 8 x the block size + 2: about two fifths of kvspec's ticks)",
    "step share: scheduler": "one Hypothesis step drives several scheduler iterations (a step rule 1 to 6, 1 to 30 "
    "in the deadlock machine's long runs; an arrival burst then up to 3; the swap machines' opening up to 8 x the "
    "block size + 2), each a call in lockstep with the model and its state's rules (30 to 70 "
    "evaluations) judged after it",
}


def say(text: str) -> None:
    print(f"summary: {text}", file=sys.stderr, flush=True)


def run_json(command: list[str]) -> Any:
    """What ``command`` prints on stdout, as JSON; its stderr (progress) goes to ours."""
    return json.loads(subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout)


def wall_and_cpu_seconds(command: list[str]) -> tuple[float, float]:
    """How long ``command`` took, and the CPU time (user and system) of its processes together."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, check=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def ratio_row(area: str, measure: str, value: float, target: float, at_most: bool = True) -> Row:
    met = value <= target if at_most else value >= target
    return (area, measure, f"{value:.2f}x", f"{'<=' if at_most else '>='} {target:.2f}x", met)


def wall_row(area: str, measure: str, seconds: float) -> Row:
    return (area, measure, f"{seconds:.1f} s", f"<= {WALL_TARGET_S:.0f} s", seconds <= WALL_TARGET_S)


def attention(args: argparse.Namespace) -> list[Row]:
    from bench.bench_attention import all_cores

    results = run_json([sys.executable, "-m", "bench.bench_attention", "--json"])["results"]
    cores = all_cores()
    return [
        ratio_row(
            "attention",
            f"paged / contiguous decode, {r['threads']} BLAS threads"
            + (" (all cores)" if r["threads"] == cores else ""),
            r["paged / contiguous"],
            ATTENTION_TARGET,
        )
        for r in results
    ]


def trace(args: argparse.Namespace) -> list[Row]:
    result = run_json([sys.executable, "-m", "bench.bench_trace_replay", "--json"])
    rows = [
        ratio_row("trace", f"pool batch path / plain dict, {policy}", seconds["batch"] / seconds["dict"], POOL_TARGET)
        for policy, seconds in result["cpu_seconds"].items()
    ]
    return [
        *rows,
        wall_row(
            "trace", "kvspec trace (both traces, 8 capacities, both policies)", result["kvspec_trace_wall_seconds"]
        ),
    ]


def median_row(area: str, measure: str, reference: list[float], engine: list[float]) -> Row:
    """A row measured as one rate a run, each side's runs alternating: its median ratio, the lowest beside it."""
    from bench.bench_engines import ratios

    _, _, lowest, median = ratios(reference, engine)
    row = ratio_row(area, measure, median, ENGINE_TARGET, at_most=False)
    return (*row[:2], f"{median:.2f}x (min {lowest:.2f}x)", *row[3:])


def engines(args: argparse.Namespace) -> list[Row]:
    rows = [
        median_row("engines", f"{engine}: {name}", reference, other)
        for engine, measured in run_json([args.engines_python, "-c", ENGINE_ROWS]).items()
        for name, reference, other in measured
    ]
    return rows or [("engines", f"no engine imports in {args.engines_python}", "", "", None)]


def store(args: argparse.Namespace) -> list[Row]:
    measured = run_json([args.engines_python, "-c", STORE_ROWS])
    rows = [
        median_row("store", f"reference tiered store vs {title}", reference, other)
        for title, (reference, other) in measured.items()
    ]
    return rows or [("store", f"neither LMCache nor vLLM imports in {args.engines_python}", "", "", None)]


def repro(args: argparse.Namespace) -> list[Row]:
    from kvspec.cli import REPRO

    rows: list[Row] = []
    for name in REPRO:
        say(f"kvspec repro {name} ...")
        wall, cpu = wall_and_cpu_seconds([sys.executable, "-c", RUN_KVSPEC, "repro", name, "--json"])
        rows.append(wall_row("repro", f"kvspec repro {name}", wall))
        rows.append(
            ("repro", f"kvspec repro {name}, CPU", f"{cpu:.1f} s", f"<= {CPU_TARGET_S:.0f} s", cpu <= CPU_TARGET_S)
        )
    return rows


def step_share(args: argparse.Namespace) -> list[Row]:
    """Each machine's Hypothesis / kvspec ticks, its steps per CPU second and kvspec's share beside it."""
    measured = run_json([sys.executable, "-m", "bench.bench_step_share", "--json"])["machines"]
    rows: list[Row] = []
    for row in measured:
        ratio, share = row["hypothesis_over_kvspec"], row["kvspec_share"]
        sampled = ratio is not None
        measure = (
            f"{row['machine']}: Hypothesis / kvspec, CPU ticks ({row['steps_per_cpu_second']:,.0f} steps/CPU-s, "
            f"kvspec {f'{share:.0%}' if sampled else 'not sampled'})"
        )
        ratio_text = f"{ratio:.2f}x" if sampled else "n/a"
        met = ratio >= SHARE_TARGET if sampled else None
        rows.append(("step share", measure, ratio_text, f">= {SHARE_TARGET:.2f}x", met))
    return rows


def reason(row: Row) -> str:
    """Why ``row`` misses its target, as ``BELOW_TARGET`` records it."""
    named = f"{row[0]}: {row[1]}"
    return next((why for start, why in BELOW_TARGET.items() if named.startswith(start)), "no reason recorded")


MEASURE: dict[str, Callable[[argparse.Namespace], list[Row]]] = {
    "attention": attention,
    "trace": trace,
    "engines": engines,
    "store": store,
    "repro": repro,
    "step share": step_share,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.summary", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=AREAS, help="run only these areas")
    parser.add_argument("--skip", action="append", choices=AREAS, default=[], help="leave these areas out")
    parser.add_argument(
        "--engines-python",
        default=os.environ.get("KVSPEC_ENGINES_PYTHON", sys.executable),
        help="the interpreter where vLLM and SGLang import",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    for area in args.only or AREAS:
        if area in args.skip:
            continue
        say(f"{area} ...")
        start = time.perf_counter()
        try:
            rows += MEASURE[area](args)
        except Exception as error:  # one area failing leaves the others' rows standing
            rows.append((area, f"failed: {type(error).__name__}: {error}".splitlines()[0], "", "", None))
        say(f"{area} done in {time.perf_counter() - start:.0f} s")
    if args.json:
        emit_json(
            [
                dict(zip(("area", "measure", "value", "target", "met"), row, strict=True))
                | ({"reason": reason(row)} if row[4] is False else {})
                for row in rows
            ]
        )
        return 0
    shown = [(*row[:4], {True: "yes", False: "NO", None: "-"}[row[4]]) for row in rows]
    print(table(["area", "measure", "value", "target", "meets"], shown, title="speed against targets"))
    met, missed = (sum(1 for row in rows if row[4] is verdict) for verdict in (True, False))
    print(f"\n{met} of {met + missed} measured rows at their target")
    missed_by_reason: dict[str, list[str]] = {}
    for row in rows:
        if row[4] is False:
            missed_by_reason.setdefault(reason(row), []).append(f"{row[0]}: {row[1]}")
    for why, named in missed_by_reason.items():
        print("\nbelow target:\n" + "\n".join(f"  {measure}" for measure in named) + f"\n  why: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
