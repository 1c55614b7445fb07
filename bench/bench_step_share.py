"""kvspec's share of a lockstep step: what each machine costs per step beyond Hypothesis's own work.

    python -m bench.bench_step_share [--machine TEXT] [--rounds N] [--json]

In one process, under the ``ci`` profile's settings (derandomized; its ``max_examples`` and
``stateful_step_count``, from ``kvspec.properties.profiles``), it runs Hypothesis's stateful runner on an
empty machine (two rules that do nothing) and each machine of ``kvspec.properties.suite`` against the
reference, as ``kvspec check`` runs it (``running.run_machine``), the two alternating, ``--rounds`` times
each.  Every kvspec module is loaded first, as ``kvspec check`` loads them, so that the examples drawn are
the verdict's own.  A step is one rule Hypothesis executed (initialize rules too), counted at the end of each
step (``check_invariants``); time is this process's CPU seconds, a machine's lowest round, and the runner's
lowest over every round of the whole run (it is one machine: each round bounds its cost).

A machine's step is parted three ways:

* the runner: the empty machine's cost a step (choosing a rule, running it, ending the step);
* the draws: Hypothesis drawing what the machine's rules ask of it beyond the empty machine's rule choice --
  the rule and its arguments, and every ``data.draw`` of a rule's body: the time inside Hypothesis's
  outermost ``ConjectureData.draw`` calls, measured in one more run of each side with the calls timed, as a
  fraction of that run applied to the untimed cost;
* kvspec: the rest -- the models, the implementation, the snapshots, the invariants, the ledgers.

Hypothesis's own work on a machine is the runner and its draws; the ratio Hypothesis / kvspec is the target:
at least 1.0x, kvspec's cost per step at most Hypothesis's own.  ``draws + kvspec`` against the runner alone
is the measure of earlier stops (the draws counted as kvspec's), printed beside it.

CPU seconds, not wall time: other work on the machine leaves them nearly as they are.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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


@attrs.frozen
class Measured:
    """One machine's run, and the empty machine's runs beside it: CPU seconds a step, and the fraction drawing."""

    title: str
    steps: int
    machine_cost: float
    machine_drawing: float
    runner_costs: tuple[float, ...]
    runner_drawing: float


def measure(title: str, machine: type[harness.LockstepMachine], rounds: int, base: Settings) -> Measured:
    """One machine against the reference and the empty machine, alternating; then each once more, its draws
    timed."""
    reference = loading.load_implementation(loading.REFERENCE)

    def empty() -> None:
        run_empty(base)

    def lockstep() -> None:
        running.run_machine(machine, reference, base)

    empties, locksteps = [], []
    for _ in range(rounds):
        empties.append(cpu_per_step(EmptyMachine, empty))
        locksteps.append(cpu_per_step(harness.LockstepMachine, lockstep))
    steps, machine_cost = min(locksteps, key=lambda measured: measured[1])
    runner_costs = tuple(per_step for _, per_step in empties)
    return Measured(title, steps, machine_cost, drawing_fraction(lockstep), runner_costs, drawing_fraction(empty))


def parted(measured: Measured, runner_cost: float, runner_drawing: float) -> dict[str, Any]:
    """A machine's step parted into the runner's (the lowest empty step of the whole run: the runner is one
    machine, and every round of it bounds its cost), the draws' and kvspec's."""
    machine_cost = measured.machine_cost
    draws_cost = max(measured.machine_drawing * machine_cost - runner_drawing * runner_cost, 0.0)
    hypothesis_cost = runner_cost + draws_cost
    kvspec_cost = max(machine_cost - hypothesis_cost, 0.0)
    return {
        "machine": measured.title,
        "steps": measured.steps,
        "steps_per_cpu_second": 1 / machine_cost,
        "runner_us_per_step": runner_cost * 1e6,
        "draws_us_per_step": draws_cost * 1e6,
        "kvspec_us_per_step": kvspec_cost * 1e6,
        "kvspec_share": kvspec_cost / machine_cost,
        "hypothesis_over_kvspec": hypothesis_cost / kvspec_cost if kvspec_cost else float("inf"),
        "runner_over_draws_and_kvspec": runner_cost / (draws_cost + kvspec_cost)
        if machine_cost > runner_cost
        else float("inf"),
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
            round(row["runner_us_per_step"]),
            round(row["draws_us_per_step"]),
            round(row["kvspec_us_per_step"]),
            f"{row['kvspec_share']:.0%}",
            f"{row['runner_over_draws_and_kvspec']:.2f}x",
            f"{row['hypothesis_over_kvspec']:.2f}x",
            "yes" if row["hypothesis_over_kvspec"] >= TARGET else "NO",
        ]
        for row in rows
    ]
    header = ["machine", "steps", "steps/CPU-s", "runner us", "draws us", "kvspec us", "kvspec share"]
    header += ["runner/(draws+kvspec)", "Hyp./kvspec"]
    title = (
        f"kvspec's share of a step, profile {PROFILE}, against the reference: us a step each; "
        f"Hyp. = runner + draws (target Hyp./kvspec >= {TARGET:.1f}x)"
    )
    print(table([*header, "meets"], body, title=title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
