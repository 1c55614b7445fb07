"""Every speed ratio of issue 20 in one table, each beside its target: where kvspec stands.

    python -m bench.summary [--only AREA ...] [--skip AREA ...] [--engines-python PATH] [--json]

Each area runs its bench in a subprocess, whose progress lines go to stderr as it runs:

* ``attention`` -- ``bench.bench_attention``: paged / contiguous batched decode, at 2 BLAS threads and
  at every core (target <= 1.25x);
* ``trace`` -- ``bench.bench_trace_replay``: the reference pool's batch path / a plain ``OrderedDict``,
  per policy, in CPU seconds of one process (<= 2x), and ``kvspec trace``'s wall time (<= 60 s);
* ``engines`` -- ``bench.bench_engines``: the reference against vLLM's ``BlockPool`` and SGLang's
  ``RadixCache``, every row in every regime (>= 1.0x; a radix row's value is its median ratio, the
  lowest run beside it), run by the interpreter where the engines import (``--engines-python``, default
  ``$KVSPEC_ENGINES_PYTHON``, else this one); skipped where neither imports;
* ``store`` -- ``bench.bench_store``, when that bench exists: the reference tiered store against
  LMCache's CPU backend and vLLM's CPU offloading manager, its default stream (>= 1.0x), with the
  engines' interpreter as above;
* ``repro`` -- the wall time of each ``kvspec repro`` (<= 60 s; ``kvspec trace`` is in ``trace``) and its
  CPU time, user and system of all its processes (<= 20 s: the wall time's headroom on a loaded machine);
* ``lockstep`` -- steps per CPU second of each conformance machine in lockstep with the spec, against
  the reference, at the default profile (>= 5,000); a machine of a component the reference does not
  bring is listed as not offered.

Seconds depend on the machine and on what else runs on it; the ratios much less.  Nothing is asserted:
the last column says whether each row meets its target.
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
from pathlib import Path
from typing import Any

from kvspec.report import emit_json, table

Row = tuple[str, str, str, str, bool | None]  # area, measure, value, target, met (None: not measured)
AREAS = ("attention", "trace", "engines", "store", "repro", "lockstep")
ATTENTION_TARGET, POOL_TARGET, ENGINE_TARGET, WALL_TARGET_S, STEPS_TARGET = 1.25, 2.0, 1.0, 60.0, 5_000
CPU_TARGET_S = 20.0
RUN_KVSPEC = "from kvspec.cli import main; raise SystemExit(main())"
ENGINE_ROWS = """
import json, sys
from bench import bench_engines
from kvspec.adapters import importable
rows = {}
if importable("vllm"):
    rows["vLLM BlockPool"] = bench_engines.pool_rows(3, 1.0)
if importable("sglang"):
    rows["SGLang RadixCache"] = bench_engines.radix_rows(3, 1.0)
json.dump(rows, sys.stdout)
"""
STORE_ROWS = """
import json, sys
from bench import bench_store
from kvspec.adapters import importable
requests = bench_store.stream(1_024, 20_000)
mine, _ = bench_store.best_rate(*bench_store.reference(1_024, requests), 3)
rows = {}
for title, module, build in bench_store.ENGINES.values():
    if importable(module):
        rows[title] = mine / bench_store.best_rate(*build(1_024, requests), 3)[0]
json.dump(rows, sys.stdout)
"""


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


def engines(args: argparse.Namespace) -> list[Row]:
    from bench.bench_engines import radix_ratios

    rows: list[Row] = []
    for engine, measured in run_json([args.engines_python, "-c", ENGINE_ROWS]).items():
        for name, reference, other in measured:
            if isinstance(reference, list):  # a radix row: one rate per run
                _, _, lowest, median = radix_ratios(reference, other)
                row = ratio_row("engines", f"{engine}: {name}", median, ENGINE_TARGET, at_most=False)
                rows.append((*row[:2], f"{median:.2f}x (min {lowest:.2f}x)", *row[3:]))
            else:
                rows.append(ratio_row("engines", f"{engine}: {name}", reference / other, ENGINE_TARGET, at_most=False))
    return rows or [("engines", f"neither vLLM nor SGLang imports in {args.engines_python}", "", "", None)]


def store(args: argparse.Namespace) -> list[Row]:
    if not Path(__file__).with_name("bench_store.py").exists():
        return [("store", "bench/bench_store.py does not exist yet", "", "", None)]
    ratios = run_json([args.engines_python, "-c", STORE_ROWS])
    rows = [
        ratio_row("store", f"reference tiered store vs {title}", r, ENGINE_TARGET, False) for title, r in ratios.items()
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


def lockstep(args: argparse.Namespace) -> list[Row]:
    """Each machine's steps per CPU second of this process against the reference (``bench.bench_block_pool``
    prints them per wall-clock second): other work on the machine leaves them as they are."""
    from hypothesis import settings

    from kvspec.properties import harness, loading, profiles, suite
    from kvspec.spec.components import DeclarationError

    settings.load_profile(profiles.default_profile())
    reference = loading.load_implementation(loading.REFERENCE)
    rows: list[Row] = []
    for name, path in suite.MACHINES:
        machine = suite.load_machine(path)
        absent = machine.not_offered(reference)
        if absent:
            rows.append(("lockstep", name, absent, "", None))
            continue
        say(f"lockstep {name} ...")
        start = time.process_time()
        try:
            steps = harness.run_machine(machine, reference).statistics.steps
        except DeclarationError as error:  # a machine of a component the reference does not bring
            rows.append(("lockstep", name, f"not run: {error}", "", None))
            continue
        rate = steps / (time.process_time() - start)
        rows.append(("lockstep", name, f"{rate:,.0f} steps/s", f">= {STEPS_TARGET:,} steps/s", rate >= STEPS_TARGET))
    return rows


MEASURE: dict[str, Callable[[argparse.Namespace], list[Row]]] = {
    "attention": attention,
    "trace": trace,
    "engines": engines,
    "store": store,
    "repro": repro,
    "lockstep": lockstep,
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
        emit_json([dict(zip(("area", "measure", "value", "target", "met"), row, strict=True)) for row in rows])
        return 0
    shown = [(*row[:4], {True: "yes", False: "NO", None: "-"}[row[4]]) for row in rows]
    print(table(["area", "measure", "value", "target", "meets"], shown, title="issue 20: speed against targets"))
    met, missed = (sum(1 for row in rows if row[4] is verdict) for verdict in (True, False))
    print(f"\n{met} of {met + missed} measured rows at their target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
