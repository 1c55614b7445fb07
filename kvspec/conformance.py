"""``kvspec.run_conformance``: an implementation's conformance verdict, as an object.

::

    import kvspec

    verdict = kvspec.run_conformance("my_engine.adapter:factory", layers=["block pool"], profile="ci")
    print(verdict)          # what ``kvspec check`` prints; verdict.to_json() is what ``--json`` prints
    assert verdict.conforms

Rules:

* ``factory`` is ``module:factory``, the factory itself, or an
  ``Implementation``; components it leaves out come from the reference.  An
  unusable one raises ``AdapterError`` (one line); an unknown layer word or
  profile raises ``UsageError``.  ``layers`` keeps the machines whose title
  contains one of the given words (default: every machine of
  ``properties.suite``); ``machines`` adds machines of a third party's layers.
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
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from hypothesis import settings as Settings

from kvspec import workers
from kvspec.properties import harness, profiles, suite
from kvspec.properties.loading import (
    AdapterError,
    UsageError,
    exits_are_the_adapters,
    import_every_module,
    resolve,
)
from kvspec.replay import ReplayContext, read_token, replay
from kvspec.spec.components import DeclarationError
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import REGISTRY, Invariant, invariant_out_of_contract_call_rejected
from kvspec.verdict import (
    BORROWED_ONLY,
    CONFORMS,
    EXIT_STATUS,
    HELD,
    INTERRUPTED,
    NOT_OFFERED,
    NOT_REACHED,
    NOT_RUN,
    NOTHING_CHECKED,
    VIOLATED,
    Consequence,
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

ROUNDS = 6  # runs of one machine: the first, then one per round of new findings
MACHINE_FAILED = "kvspec's machine failed"
NOT_REPRODUCIBLE = "the implementation answered the same calls differently"
UNRULED = {harness.HARNESS: "uncaught error", harness.NONDETERMINISTIC: "answers differ on the same calls"}
UNRULED_ENDS = {harness.HARNESS: MACHINE_FAILED, harness.NONDETERMINISTIC: NOT_REPRODUCIBLE}
ANSWERED = "stopped: what it found answers the question it ran for"

MachineEntry = tuple[str, type[harness.LockstepMachine]]
FindingKey = tuple[str, str, str]  # the rule (or the kind of an unruled finding), the call and its kind


def watch(implementation: Implementation, used: set[str]) -> Implementation:
    """``implementation`` with each component it brought noting in ``used`` when a machine builds it."""

    def noting(kind: str, factory: Callable[..., Any]) -> Callable[..., Any]:
        def build_component(*args: Any, **kwargs: Any) -> Any:
            used.add(kind)
            return factory(*args, **kwargs)

        build_component.__qualname__ = getattr(factory, "__qualname__", kind)
        return build_component

    offers = implementation.offers()
    noted: dict[str, Any] = {
        kind: attrs.evolve(offers[kind], factory=noting(kind, offers[kind].factory))
        for kind in implementation.own_components()
        if kind not in implementation.extensions
    }
    extensions = {
        kind: attrs.evolve(offer, factory=noting(kind, offer.factory))
        for kind, offer in implementation.extensions.items()
    }
    return attrs.evolve(implementation, extensions=extensions, **noted)


def choose(layers: Iterable[str] | None, machines: Sequence[MachineEntry]) -> list[MachineEntry]:
    """The machines a verdict runs: those whose title contains one of ``layers`` (every word must match one)."""
    everything = [(title, suite.load_machine(path)) for title, path in suite.MACHINES] + list(machines)
    if layers is None:
        return everything
    words = list(layers)
    unknown = [word for word in words if not word or not any(word in title for title, _ in everything)]
    if unknown or not words:
        titles = "; ".join(title for title, _ in everything)
        raise UsageError(
            f"no machine matches {', '.join(map(repr, unknown)) or 'an empty list'}; the machines: {titles}"
        )
    return [(title, machine) for title, machine in everything if any(word in title for word in words)]


def profile_settings(profile: str) -> Settings:
    if profile not in profiles.PROFILES:
        raise UsageError(f"unknown profile {profile!r}; choose from {', '.join(profiles.PROFILES)}")
    return Settings.get_profile(profile)


@attrs.frozen
class Probe:
    """How to rerun the machine that made a caller-contract finding, to measure what the call leads to."""

    machine: str  # its title
    known: frozenset[Invariant]
    variant: harness.Variant


@attrs.define
class Run:
    """What the verdict accumulates while its machines run."""

    implementation: Implementation
    path: str
    checks: Counter[Invariant] = attrs.field(factory=Counter)
    checks_after_known: Counter[Invariant] = attrs.field(factory=Counter)
    found: dict[FindingKey, tuple[Violation, int]] = attrs.field(factory=dict)  # with its machine's rank
    probes: dict[FindingKey, Probe] = attrs.field(factory=dict)  # where each contract finding was made
    machines: list[MachineRun] = attrs.field(factory=list)
    judged: set[str] = attrs.field(factory=set)  # layers whose rules a counted machine checked
    selected: set[str] = attrs.field(factory=set)  # layers of every machine selected
    interrupted: bool = False
    # whether what it found already answers the question it runs for (a meta-test asks one): then it stops
    answered: Callable[[Run], bool] = lambda run: False

    def fold(self, judged: Judged) -> None:
        """Add what a machine judged after this run's machines found and checked."""
        self.checks.update({REGISTRY[name]: count for name, count in judged.checks.items()})
        self.checks_after_known.update({REGISTRY[name]: count for name, count in judged.checks_after_known.items()})
        for key, (violation, rank) in judged.found.items():
            merge(self, key, violation, rank)
        for key, (title, known, variant) in judged.probes.items():
            self.probes.setdefault(key, Probe(title, frozenset(REGISTRY[name] for name in known), variant))
        self.machines.append(judged.machine)
        self.judged |= judged.judged
        self.selected |= judged.selected


@attrs.frozen
class Judged:
    """What one machine found and checked, as plain data: what a worker process sends back (``Run.fold``)."""

    machine: MachineRun
    checks: dict[str, int]
    checks_after_known: dict[str, int]
    found: dict[FindingKey, tuple[Violation, int]]
    probes: dict[FindingKey, tuple[str, tuple[str, ...], harness.Variant]]
    judged: frozenset[str]
    selected: frozenset[str]

    @classmethod
    def of(cls, run: Run) -> Judged:
        """The run of one machine, as data."""
        return cls(
            run.machines[-1],
            {rule.name: count for rule, count in run.checks.items()},
            {rule.name: count for rule, count in run.checks_after_known.items()},
            dict(run.found),
            {key: (p.machine, tuple(sorted(r.name for r in p.known)), p.variant) for key, p in run.probes.items()},
            frozenset(run.judged),
            frozenset(run.selected),
        )


def run_conformance(
    factory: str | Callable[[], Implementation] | Implementation,
    layers: Iterable[str] | None = None,
    profile: str = "ci",
    progress: Callable[[str], None] | None = None,
    machines: Sequence[MachineEntry] = (),
    jobs: int = 1,
) -> Verdict:
    """Run every machine of ``layers`` against ``factory``; the verdict, every distinct finding included.

    Ctrl-C stops the run (every worker with it) and returns the verdict of what ran: INTERRUPTED, or VIOLATED
    marked interrupted when a finding was already made.  While it runs, what Hypothesis and the implementation
    print goes to stderr (stdout is the caller's: ``kvspec check --json``), and Hypothesis's files to kvspec's
    cache.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UsageError(f"jobs must be a positive number of worker processes, got {jobs!r}")
    base = profile_settings(profile)
    chosen = choose(layers, machines)
    with profiles.hypothesis_files_in_cache(), contextlib.redirect_stdout(sys.stderr):
        import_every_module()
        path, implementation = resolve(factory)
        run = Run(implementation, path)
        plan = workers.Plan(path, factory, profile, chosen, workers.how_many(jobs, factory, len(chosen)))
        judged = workers.judge(plan, judge_machine, progress)
        for index, (title, machine) in enumerate(chosen):
            if index in judged.results:
                run.fold(judged.results[index])
            elif index == judged.interrupted_at:
                run.selected.update(machine.judges)
                run.machines.append(MachineRun(title, 0, 0, 0, 0, "interrupted"))
        run.interrupted = judged.interrupted
        if not run.interrupted:
            try:
                with exits_are_the_adapters(path, "while kvspec measured what accepted calls lead to"):
                    measure_consequences(run, base, progress, chosen)
            except KeyboardInterrupt:
                run.interrupted = True
    not_started = tuple(
        title for i, (title, _) in enumerate(chosen) if i not in judged.results and i != judged.interrupted_at
    )
    return attrs.evolve(verdict_of(run, profile), not_started=not_started)


def judge_machine(
    implementation: Implementation, path: str, title: str, machine: type[harness.LockstepMachine], profile: str
) -> Judged:
    """One machine's rounds against ``implementation``, as a run of its own (folded into the verdict's)."""
    run = Run(implementation, path)
    run.selected.update(machine.judges)
    with exits_are_the_adapters(path, f"under machine {title!r}"):
        run.machines.append(run_one(run, title, machine, profile_settings(profile)))
    return Judged.of(run)


def measure_consequences(
    run: Run, base: Settings, progress: Callable[[str], None] | None, machines: Sequence[MachineEntry] = ()
) -> None:
    """For each caller-contract finding: send that kind of call alone, let the implementation accept it, and
    check safety from there on -- the first safety rule that breaks, and how many calls later, is what the
    call leads to.  Nothing breaking is reported too, with the examples it took."""
    for key, probe in run.probes.items():
        violation, rank = run.found[key]
        if progress:
            progress(f"what {probe.variant[0]} ({probe.variant[1]}) leads to")
        machine = dict(machines).get(probe.machine) or suite.machine_titled(probe.machine)
        outcome = harness.run_machine(machine, run.implementation, base, known=probe.known, probing=probe.variant)
        after = [f for f in outcome.findings if f.after_steps is not None and f.tier == "safety"]
        if after:
            first = min(after, key=lambda f: (f.after_steps or 0, len(f.steps)))
            assert first.invariant is not None
            later = {0: "at that very call", 1: "one call later"}.get(
                first.after_steps or 0, f"{first.after_steps} calls later"
            )
            leads_to = f"{first.invariant.name} breaks {later}: {first.detail}"
            violation = attrs.evolve(violation, leads_to=leads_to, leads_to_steps=first.steps)
        else:
            leads_to = f"no safety rule broke after it, in {outcome.statistics.examples} examples that sent it"
            violation = attrs.evolve(violation, leads_to=leads_to)
        run.found[key] = (violation, rank)


def run_one(run: Run, title: str, machine: type[harness.LockstepMachine], base: Settings) -> MachineRun:
    """Rounds of one machine until it finds nothing new.

    An implementation that trusts its caller is judged in two passes: first it is sent no out-of-contract
    call at all (its safety and its conventions), then it is sent them (how it answers each kind, and --
    measured afterwards -- what accepting one leads to).
    """
    implementation = run.implementation
    reason = machine.not_offered(implementation)
    if reason:
        return MachineRun(title, 0, 0, 0, 0, reason)
    if not machine.uses & implementation.own_components():
        return MachineRun(title, 0, 0, 0, 0, BORROWED_ONLY)
    rounds = Rounds(run, title, machine)
    trusted = implementation.conventions.trusts_caller
    for spared in (harness.EVERY_OPERATION, frozenset()) if trusted else (frozenset(),):
        rounds.until_nothing_new(base, spared)
        if rounds.ended in (BORROWED_ONLY, ANSWERED, *UNRULED_ENDS.values()):
            break
    for finding in rounds.contract_findings:
        key = (invariant_out_of_contract_call_rejected.name, finding.operation, finding.variant)
        run.probes.setdefault(key, Probe(title, rounds.known, (finding.operation, finding.variant)))
    return MachineRun(title, rounds.runs, rounds.examples, rounds.steps, rounds.findings, rounds.ended)


@attrs.define
class Rounds:
    """The runs of one machine against the verdict's implementation, and what they found."""

    run: Run
    title: str
    machine: type[harness.LockstepMachine]
    known: frozenset[Invariant] = frozenset()
    contract_findings: list[harness.Finding] = attrs.field(factory=list)
    runs: int = 0
    examples: int = 0
    steps: int = 0
    findings: int = 0
    ended: str = "budget spent"
    used: set[str] = attrs.field(factory=set)

    def until_nothing_new(self, base: Settings, spared: frozenset[harness.Variant]) -> None:
        watched = watch(self.run.implementation, self.used)
        rank = machine_rank(self.machine)
        for _ in range(ROUNDS):
            try:
                outcome = harness.run_machine(self.machine, watched, base, known=self.known, spared=spared)
            except DeclarationError as error:
                raise AdapterError(f"{self.run.path}: {error}") from None
            statistics = outcome.statistics
            self.runs, self.examples, self.steps = (
                self.runs + 1,
                self.examples + statistics.examples,
                self.steps + statistics.steps,
            )
            if not self.used:
                self.ended = BORROWED_ONLY
                return
            self.run.judged.update(self.machine.judges)
            self.run.checks.update(statistics.checks)
            self.run.checks_after_known.update(statistics.checks_after_known)
            if not outcome.findings:
                self.ended = "every example broke a known rule" if outcome.unsatisfiable else "nothing new"
                return
            self.findings += len(outcome.findings)
            context = ReplayContext(self.title, self.known, spared)
            for finding in outcome.findings:
                key, violation = violation_of(self.run.implementation, self.title, finding)
                merge(
                    self.run,
                    key,
                    attrs.evolve(violation, replay=context.token(self.run.path, finding.blob)),
                    rank(finding),
                )
                if finding.invariant is None:
                    self.ended = UNRULED_ENDS[finding.kind]
                elif finding.tier == "caller contract":
                    spared |= {(finding.operation, finding.variant)}
                    self.contract_findings.append(finding)
                else:
                    self.known |= {finding.invariant}
            if self.ended in UNRULED_ENDS.values():
                return
            if self.run.answered(self.run):
                self.ended = ANSWERED
                return
        self.ended = "budget spent"


def machine_rank(machine: type[harness.LockstepMachine]) -> Callable[[harness.Finding], int]:
    """How well a machine illustrates a finding: 0 when it is a machine of the finding's own layer."""

    def rank(finding: harness.Finding) -> int:
        layer = finding.invariant.layer if finding.invariant else ""
        return 0 if machine.judges[:1] == (layer,) else 1

    return rank


def violation_of(
    implementation: Implementation, machine: str, finding: harness.Finding
) -> tuple[FindingKey, Violation]:
    """``finding`` of ``machine`` as the verdict lists it, and the key that tells it from the others."""
    rule = finding.invariant
    name = rule.name if rule else UNRULED[finding.kind]
    contract = finding.tier == "caller contract"
    operation, variant = (finding.operation, finding.variant) if contract else ("", "")
    consequences = tuple(Consequence(r.name, r.tier, detail) for r, detail in finding.consequences)
    offer = implementation.offers().get(kind_of(implementation, operation)) if operation else None
    emulated = bool(offer and operation in offer.emulated)
    violation = Violation(
        name, finding.tier, operation, finding.detail, (machine,), finding.steps, consequences, variant=variant
    )
    return (name, operation, variant), attrs.evolve(violation, emulated=emulated)


def merge(run: Run, key: FindingKey, new: Violation, rank: int) -> None:
    """Add ``new``; one already found keeps the best illustration (own layer, then shortest, then first found)
    and learns the machines."""
    old = run.found.get(key)
    if old is not None:
        old_violation, old_rank = old
        machines = (*old_violation.machines, *(m for m in new.machines if m not in old_violation.machines))
        if (old_rank, len(old_violation.steps)) <= (rank, len(new.steps)):
            new, rank = old_violation, old_rank
        new = attrs.evolve(new, machines=machines)
    run.found[key] = (new, rank)


def kind_of(implementation: Implementation, operation: str) -> str:
    """The component kind whose method ``operation`` is, among those the implementation brought."""
    for kind in sorted(implementation.own_components()):
        if hasattr(implementation.offers()[kind].factory, operation):
            return kind
    return ""


def group_knock_ons(violations: list[Violation]) -> list[Violation]:
    """Each finding with the others of the same root cause under it: those shown by the same sequence, or
    among its consequences at the failing step."""
    roots: list[Violation] = []
    for violation in sorted(violations, key=lambda v: harness.FINDING_KINDS.index(v.tier)):
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
    borrowed: dict[str, Any] = {
        kind: None for kind in implementation.borrowed if kind in attrs.fields_dict(Implementation)
    }
    unoffered = harness.unoffered(attrs.evolve(implementation, **borrowed))

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
