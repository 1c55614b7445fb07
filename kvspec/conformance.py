"""``kvspec.run_conformance``: an implementation's conformance verdict, as an object.

::

    import kvspec

    verdict = kvspec.run_conformance("my_engine.adapter:factory", titled=["block pool"], profile="ci")
    print(verdict)          # what ``kvspec check`` prints; verdict.to_json() is what ``--json`` prints
    assert verdict.conforms

Rules:

* ``factory`` is ``module:factory``, the factory itself, or an
  ``Implementation``; components it leaves out come from the reference.  An
  unusable one raises ``AdapterError`` (one line); a word that names no
  machine, or an unknown profile, raises ``UsageError``.  ``titled`` keeps
  the machines whose title contains one of the given words (``kvspec check
  --machine``; default: every machine of ``properties.suite``); ``machines``
  adds machines of a third party's layers.  A *layer* is always a spec
  module's name (``Invariant.layer``, the verdict's layer column).
* ``jobs``: the machines are judged in that many worker processes (default
  1: in this process; ``kvspec check`` uses every core), each machine on its
  own; what they found is folded into the verdict in the machines' order, so
  that under ``ci`` the verdict is the one a single process reaches
  (``kvspec.workers``).  An implementation given as an object that cannot be
  sent to a worker is an ``AdapterError`` there: give it as ``module:factory``.
* A machine runs only when the implementation offers what it requires and
  brought at least one component it uses; otherwise it is "not offered" or
  "not counted" -- it did not judge this implementation.
* A machine runs until it finds nothing new.  Each run files every finding
  under the highest tier that failed at its step (safety over caller contract
  over convention) and shrinks each tier's finding on its own.  After a
  finding the machine runs again with it *known*: an example that breaks a
  known rule goes on checking safety alone, so that a convention finding
  never hides a safety one; a caller-contract finding stops that operation's
  out-of-contract calls instead.  At most ``ROUNDS`` runs.
* Every distinct finding is reported once, with the shortest sequence found by
  a machine of its own layer; a finding on the same sequence as another, or
  among another's consequences, is listed under it as a knock-on.
* An invariant is *VIOLATED*, *held* (with its number of checks; "thin" below
  ``THIN_CHECKS``, and said when only examples past a known finding checked
  it), *not reached* (a machine that judges it ran and never got there), *not
  offered* (the implementation offers nothing that reaches it) or *not run*
  (no machine that judges it was selected).  Never "held" for a rule that was
  not checked.
* The status (``kvspec.verdict``): CONFORMS, VIOLATED, NOTHING CHECKED, or
  INTERRUPTED (Ctrl-C before anything counted against it: no verdict, never
  a pass; ``conforms`` is None).  Ctrl-C after a finding is still VIOLATED,
  marked interrupted.  An implementation that declares ``trusts_caller`` has
  its caller-contract findings reported as its declared choice: they do not
  make it fail.  A finding on an operation the adapter emulates is the
  adapter's, and says so.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvspec import rounds, workers
from kvspec.properties import findings, profiles, suite
from kvspec.properties.loading import (
    AdapterError,
    UsageError,
    exits_are_the_adapters,
    import_every_module,
    resolve,
)
from kvspec.properties.running import ConformanceTest, declaration_of
from kvspec.replay import ReplayContext, read_token, replay
from kvspec.rounds import Run, judge_machine, measure_consequences
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import REGISTRY, Invariant
from kvspec.verdict import (
    CONFORMS,
    EXIT_STATUS,
    HELD,
    INTERRUPTED,
    NOT_OFFERED,
    NOT_REACHED,
    NOT_RUN,
    NOTHING_CHECKED,
    VIOLATED,
    MachineRun,
    RuleVerdict,
    Verdict,
    Violation,
    declaration_lines,
)

__all__ = [  # the verdict's records and the replay token, where a caller of ``run_conformance`` finds them
    "AdapterError",
    "CONFORMS",
    "EXIT_STATUS",
    "HELD",
    "INTERRUPTED",
    "MachineRun",
    "NOTHING_CHECKED",
    "NOT_OFFERED",
    "NOT_REACHED",
    "NOT_RUN",
    "ReplayContext",
    "RuleVerdict",
    "UsageError",
    "VIOLATED",
    "Verdict",
    "Violation",
    "read_token",
    "replay",
    "run_conformance",
]


def choose(titled: Iterable[str] | None, machines: Sequence[ConformanceTest | type]) -> list[ConformanceTest]:
    """The machines a verdict runs: those whose title contains one of ``titled`` (every word must match one)."""
    given = [declaration_of(machine) for machine in machines]
    if None in given:
        raise UsageError("machines takes the declarations of test modules (conformance_test(Machine, title))")
    everything = [*suite.declarations(), *(d for d in given if d is not None)]
    if titled is None:
        return everything
    words = list(titled)
    unknown = [word for word in words if not word or not any(word in d.title for d in everything)]
    if unknown or not words:
        titles = "; ".join(d.title for d in everything)
        raise UsageError(
            f"no machine matches {', '.join(map(repr, unknown)) or 'an empty list'}; the machines: {titles}"
        )
    return [d for d in everything if any(word in d.title for word in words)]


def run_conformance(
    factory: str | Callable[[], Implementation] | Implementation,
    titled: Iterable[str] | None = None,
    profile: str = "ci",
    progress: Callable[[str], None] | None = None,
    machines: Sequence[ConformanceTest | type] = (),  # declarations (or the classes pytest bound from them)
    jobs: int = 1,
) -> Verdict:
    """Run every machine (or those ``titled``) against ``factory``; the verdict, every distinct finding included.

    Ctrl-C stops the run (every worker with it) and returns the verdict of what ran: INTERRUPTED, or VIOLATED
    marked interrupted when a finding was already made.  While it runs, what Hypothesis and the implementation
    print goes to stderr (stdout is the caller's: ``kvspec check --json``), and Hypothesis's files to kvspec's
    cache.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UsageError(f"jobs must be a positive number of worker processes, got {jobs!r}")
    base = rounds.profile_settings(profile)  # through the module: a test patches the profiles' budget there
    chosen = choose(titled, machines)
    with profiles.hypothesis_files_in_cache(), contextlib.redirect_stdout(sys.stderr):
        import_every_module()
        path, implementation = resolve(factory)
        run = Run(implementation, path)
        plan = workers.Plan(path, factory, profile, chosen, workers.how_many(jobs, factory, len(chosen)))
        judged = workers.judge(plan, judge_machine, progress)
        for index, declaration in enumerate(chosen):
            if index in judged.results:
                run.fold(judged.results[index])
            elif index == judged.interrupted_at:
                run.selected.update(declaration.machine.judges)
                run.machines.append(MachineRun(declaration.title, 0, 0, 0, 0, "interrupted"))
        run.interrupted = judged.interrupted
        if not run.interrupted:
            try:
                with exits_are_the_adapters(path, "while kvspec measured what accepted calls lead to"):
                    measure_consequences(run, base, progress, chosen)
            except KeyboardInterrupt:
                run.interrupted = True
    not_started = tuple(d.title for i, d in enumerate(chosen) if i not in judged.results and i != judged.interrupted_at)
    return attrs.evolve(verdict_of(run, profile), not_started=not_started)


def group_knock_ons(violations: list[Violation]) -> list[Violation]:
    """Each finding with the others of the same root cause under it: those shown by the same sequence, or
    among its consequences at the failing step."""
    roots: list[Violation] = []
    for violation in sorted(violations, key=lambda v: findings.FINDING_KINDS.index(v.tier)):
        root = next(
            (
                r
                for r in roots
                if r.steps == violation.steps or any(c.invariant == violation.invariant for c in r.consequences)
            ),
            None,
        )
        if root is None:
            roots.append(violation)
        else:
            roots[roots.index(root)] = attrs.evolve(root, knock_ons=(*root.knock_ons, violation))
    return roots


def verdict_of(run: Run, profile: str) -> Verdict:
    implementation = run.implementation
    # a rule that failed at another finding's step is violated too, not "held" -- unless that step was a call
    # the implementation declares it accepts (what such a call leads to is reported with it)
    accepted = implementation.conventions.trusts_caller
    violated = {name for name, _, _ in run.found}
    violated |= {
        consequence.invariant
        for v, _ in run.found.values()
        if not (accepted and v.tier == "caller contract")
        for consequence in v.consequences
    }
    # a rule judged only through borrowed components is "not offered" by this implementation
    unoffered = implementation.without_borrowed().rules_not_offered()

    def verdict(rule: Invariant) -> str:
        if rule.name in violated:
            return VIOLATED
        if run.checks[rule] or run.checks_after_known[rule]:
            return HELD
        if rule in unoffered:
            return NOT_OFFERED
        if rule.layer not in run.selected:
            return NOT_RUN
        return NOT_REACHED if rule.layer in run.judged else NOT_OFFERED

    rules = tuple(
        RuleVerdict(rule.name, rule.layer, rule.tier, verdict(rule), run.checks[rule], run.checks_after_known[rule])
        for _, rule in sorted(REGISTRY.items(), key=lambda item: (item[1].layer, item[0]))
        if rule.check.__module__.startswith("kvspec.spec.") or rule.layer in run.selected  # a third party's: if run
    )
    violations = group_knock_ons([v for v, _ in run.found.values()])
    return Verdict(
        implementation=implementation.name,
        path=run.path,
        profile=profile,
        conventions=implementation.conventions,
        rules=rules,
        violations=tuple(sorted(violations, key=lambda v: (v.tier, v.invariant, v.operation))),
        machines=tuple(run.machines),
        declaration=declaration_lines(implementation),
        interrupted=run.interrupted,
    )


def report_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
