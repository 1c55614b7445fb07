"""kvspec's share of a lockstep step: what each machine's step costs in kvspec's code and in Hypothesis's.

    python -m bench.bench_step_share [--machine TEXT] [--rounds N] [--json]

In one process, under the ``ci`` profile's settings (derandomized; its ``max_examples`` and
``stateful_step_count``, from ``kvspec.properties.profiles``), it runs Hypothesis's stateful runner on an
empty machine (two rules that do nothing) and each machine of ``kvspec.properties.suite`` against the
reference, as ``kvspec check`` runs it (``running.run_machine``), the two alternating, ``--rounds`` times
each.  Every kvspec module is loaded first, as ``kvspec check`` loads them, so that the examples drawn are
the verdict's own.  A step is one rule Hypothesis executed (initialize rules too), counted at the end of each
step (``check_invariants``); time is this process's CPU seconds, a machine's lowest round, and the runner's
lowest over every round of the whole run (it is one machine: each round bounds its cost).

Whose code a step runs is measured two ways.

*Sampled* (the target's measure): while a machine runs, the process's CPU clock interrupts it at every tick
(``SIGPROF``; Linux ticks every 4 ms of CPU by default) and the innermost frame of a module of ``hypothesis`` or
of ``kvspec`` owns the tick -- the code of other modules (the standard library, attrs) is its caller's, and a C
function's time its calling frame's.  kvspec's code is the models, the implementation, the snapshots, the
invariants, the ledgers and the machine's rules and strategies; Hypothesis's is its engine, its stateful
runner and every draw.  The target: Hypothesis's ticks / kvspec's at least 1.0x, kvspec's cost per step at
most Hypothesis's own.

*Parted* (a lower bound of Hypothesis's cost, the measure of earlier stops): the runner -- the empty machine's
cost a step -- and the draws -- the time inside Hypothesis's outermost ``ConjectureData.draw`` calls, measured
in one more run of each side with the calls timed, as a fraction of that run applied to the untimed cost -- are
Hypothesis's; the rest is charged to kvspec.  The rest holds Hypothesis's work that an empty machine of two
rules does not do (choosing among many rules and their preconditions, the notes of ``data.draw``, targets,
examples of other lengths), so runner + draws over the rest bounds the ratio from below.

CPU seconds, not wall time: other work on the machine leaves them nearly as they are.  The sampler needs
``SIGPROF`` (Linux, macOS); where there is none, the sampled columns say "n/a".
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

import attrs
from hypothesis import Phase
from hypothesis import settings as Settings
from hypothesis.internal.conjecture.data import ConjectureData
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from kvspec.properties import harness, loading, profiles, running, suite
from kvspec.report import emit_json, table

PROFILE = "ci"
TARGET = 1.0  # Hypothesis's cost per step / kvspec's


class EmptyMachine(RuleBasedStateMachine):
    """Hypothesis's stateful runner and nothing else: the least any machine's step costs."""

    @rule()
    def first(self) -> None:
        pass

    @rule()
    def second(self) -> None:
        pass


@contextmanager
def counting_steps(machine: type[RuleBasedStateMachine]) -> Iterator[list[int]]:
    """Count the steps of ``machine`` and its subclasses while inside: Hypothesis ends every step with
    ``check_invariants``, and calls it once more before an example's first step."""
    count = [0]
    started: weakref.WeakSet[RuleBasedStateMachine] = weakref.WeakSet()
    own = vars(machine).get("check_invariants")  # restored as it was: the class's own, or none (inherited)
    original = machine.check_invariants

    def check_invariants(self: RuleBasedStateMachine, *args: Any) -> None:
        if self in started:
            count[0] += 1
        else:
            started.add(self)
        original(self, *args)

    machine.check_invariants = check_invariants  # type: ignore[method-assign]
    try:
        yield count
    finally:
        if own is None:
            del machine.check_invariants
        else:
            machine.check_invariants = own  # type: ignore[method-assign]


def run_empty(base: Settings) -> None:
    """The empty machine under the settings ``running.run_machine`` gives a lockstep machine."""
    settings = running.conformance_settings(base)
    phases = [phase for phase in settings.phases if phase is not Phase.explain]
    run_state_machine_as_test(EmptyMachine, settings=Settings(settings, report_multiple_bugs=True, phases=phases))


def cpu_per_step(machine: type[RuleBasedStateMachine], run: Callable[[], object]) -> tuple[int, float]:
    """The steps ``run`` took, and the CPU seconds per step."""
    with counting_steps(machine) as steps:
        start = time.process_time()
        run()
        seconds = time.process_time() - start
    return steps[0], seconds / max(steps[0], 1)


@contextmanager
def timing_draws() -> Iterator[list[float]]:
    """The CPU seconds spent inside Hypothesis's outermost ``ConjectureData.draw`` calls while inside (a draw's
    nested draws are its own: only the outermost is timed).  ``ConjectureData`` is Hypothesis's internal class,
    every draw's one door: the bench reads it under the pinned minor releases, and nothing of kvspec does."""
    spent, depth = [0.0], [0]
    original = ConjectureData.draw

    def draw(self: ConjectureData, *args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return original(self, *args, **kwargs)
        depth[0] = 1
        start = time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.process_time() - start
            depth[0] = 0

    ConjectureData.draw = draw  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        ConjectureData.draw = original  # type: ignore[method-assign]


def drawing_fraction(run: Callable[[], object]) -> float:
    """The fraction of ``run``'s CPU seconds spent drawing."""
    with timing_draws() as spent:
        start = time.process_time()
        run()
        seconds = time.process_time() - start
    return spent[0] / seconds if seconds else 0.0


TICK_S = 0.001  # asked of the CPU clock; the kernel's tick is the floor (4 ms at Linux's default 250 Hz)
SAMPLED = hasattr(signal, "SIGPROF")  # the CPU clock's signal: Linux and macOS, not Windows


def owner(frame: FrameType | None) -> str:
    """Whose code ``frame`` runs: the innermost frame of a ``hypothesis`` or ``kvspec`` module decides."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("hypothesis"):
            return "hypothesis"
        if module.startswith("kvspec"):
            return "kvspec"
        frame = frame.f_back
    return "other"


@contextmanager
def sampling_owners() -> Iterator[Counter[str] | None]:
    """The ticks of this process's CPU clock while inside, by whose code each interrupted (``owner``); None
    where the platform has no ``SIGPROF``."""
    if not SAMPLED:
        yield None
        return
    ticks: Counter[str] = Counter()

    def tick(signum: int, frame: FrameType | None) -> None:
        ticks[owner(frame)] += 1

    previous = signal.signal(signal.SIGPROF, tick)
    signal.setitimer(signal.ITIMER_PROF, TICK_S, TICK_S)
    try:
        yield ticks
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, previous)


@attrs.frozen
class Measured:
    """One machine's run, and the empty machine's runs beside it: CPU seconds a step, the fraction drawing, and
    the ticks of the machine's rounds by owner (None: not sampled)."""

    title: str
    steps: int
    machine_cost: float
    machine_drawing: float
    runner_costs: tuple[float, ...]
    runner_drawing: float
    ticks: dict[str, int] | None


def measure(title: str, machine: type[harness.LockstepMachine], rounds: int, base: Settings) -> Measured:
    """One machine against the reference and the empty machine, alternating, the machine's rounds sampled; then
    each once more, its draws timed."""
    reference = loading.load_implementation(loading.REFERENCE)

    def empty() -> None:
        run_empty(base)

    def lockstep() -> None:
        running.run_machine(machine, reference, base)

    empties, locksteps = [], []
    ticks: Counter[str] = Counter()
    for _ in range(rounds):
        empties.append(cpu_per_step(EmptyMachine, empty))
        with sampling_owners() as sampled:
            locksteps.append(cpu_per_step(harness.LockstepMachine, lockstep))
        ticks.update(sampled or {})
    steps, machine_cost = min(locksteps, key=lambda measured: measured[1])
    runner_costs = tuple(per_step for _, per_step in empties)
    owners = dict(ticks) if SAMPLED else None
    return Measured(
        title, steps, machine_cost, drawing_fraction(lockstep), runner_costs, drawing_fraction(empty), owners
    )


def parted(measured: Measured, runner_cost: float, runner_drawing: float) -> dict[str, Any]:
    """A machine's step by owner, sampled; and parted into the runner's (the lowest empty step of the whole run:
    the runner is one machine, and every round of it bounds its cost), the draws' and the rest."""
    machine_cost = measured.machine_cost
    draws_cost = max(measured.machine_drawing * machine_cost - runner_drawing * runner_cost, 0.0)
    hypothesis_cost = runner_cost + draws_cost
    rest_cost = max(machine_cost - hypothesis_cost, 0.0)
    ticks = measured.ticks or {}
    hypothesis_ticks, kvspec_ticks, all_ticks = ticks.get("hypothesis", 0), ticks.get("kvspec", 0), sum(ticks.values())
    sampled = measured.ticks is not None and all_ticks > 0
    return {
        "machine": measured.title,
        "steps": measured.steps,
        "steps_per_cpu_second": 1 / machine_cost,
        "ticks": all_ticks,
        "kvspec_share": kvspec_ticks / all_ticks if sampled else None,
        "hypothesis_over_kvspec": (hypothesis_ticks / kvspec_ticks if kvspec_ticks else float("inf"))
        if sampled
        else None,
        "runner_us_per_step": runner_cost * 1e6,
        "draws_us_per_step": draws_cost * 1e6,
        "rest_us_per_step": rest_cost * 1e6,
        "runner_and_draws_over_rest": hypothesis_cost / rest_cost if rest_cost else float("inf"),
    }


def chosen_machines(text: str) -> list[tuple[str, type[harness.LockstepMachine]]]:
    """The suite's machines whose title contains ``text`` and whose components the reference brings."""
    reference = loading.load_implementation(loading.REFERENCE)
    return [
        (d.title, d.machine) for d in suite.declarations() if text in d.title and not d.machine.not_offered(reference)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_step_share", description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default="", help="only the machines whose title contains this text")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating (default 2)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    loading.import_every_module()  # Hypothesis draws constants from every loaded module (see that function)
    base = Settings.get_profile(PROFILE)
    runs = []
    with profiles.hypothesis_files_in_cache():  # as ``kvspec check``: no .hypothesis/ in the working directory
        for title, machine in chosen_machines(args.machine):
            print(f"step share: {title} ...", file=sys.stderr, flush=True)
            runs.append(measure(title, machine, args.rounds, base))
    runner_cost = min(cost for run in runs for cost in run.runner_costs)
    runner_drawing = statistics.median(run.runner_drawing for run in runs)
    rows = [parted(run, runner_cost, runner_drawing) for run in runs]
    if args.json:
        emit_json({"profile": PROFILE, "target": TARGET, "machines": rows})
        return 0
    body = [
        [
            row["machine"],
            row["steps"],
            round(row["steps_per_cpu_second"]),
            row["ticks"],
            "n/a" if row["kvspec_share"] is None else f"{row['kvspec_share']:.0%}",
            "n/a" if row["hypothesis_over_kvspec"] is None else f"{row['hypothesis_over_kvspec']:.2f}x",
            round(row["runner_us_per_step"]),
            round(row["draws_us_per_step"]),
            round(row["rest_us_per_step"]),
            f"{row['runner_and_draws_over_rest']:.2f}x",
            meets(row),
        ]
        for row in rows
    ]
    header = ["machine", "steps", "steps/CPU-s", "ticks", "kvspec share", "Hyp./kvspec"]
    header += ["runner us", "draws us", "rest us", "(runner+draws)/rest", "meets"]
    title = (
        f"kvspec's share of a step, profile {PROFILE}, against the reference: CPU ticks by whose code ran "
        f"(target Hyp./kvspec >= {TARGET:.1f}x); parted, us a step: the runner, its draws and the rest "
        "(a lower bound of the ratio)"
    )
    print(table(header, body, title=title))
    return 0


def meets(row: dict[str, Any]) -> str:
    ratio = row["hypothesis_over_kvspec"]
    return "n/a" if ratio is None else "yes" if ratio >= TARGET else "NO"


if __name__ == "__main__":
    sys.exit(main())
