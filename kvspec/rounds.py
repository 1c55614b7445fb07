"""One machine's rounds against an implementation: it runs until it finds nothing new.

Each run files what it found into the verdict's ``Run`` (``merge``: one entry
per distinct finding, the best illustration kept); after a finding the machine
runs again with it known (``Rounds.until_nothing_new``).  A machine judged in
a worker process sends its run back as plain data (``Judged``), folded into
the verdict's in the machines' order (``Run.fold``).  Afterwards, each
caller-contract finding's call is sent alone to measure what accepting it
leads to (``measure_consequences``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from hypothesis import settings as Settings

from kvspec.properties import findings, harness, profiles, running, suite
from kvspec.properties.loading import AdapterError, UsageError, exits_are_the_adapters
from kvspec.properties.running import ConformanceTest
from kvspec.replay import ReplayContext
from kvspec.spec.components import DeclarationError
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import REGISTRY, Invariant, invariant_out_of_contract_call_rejected
from kvspec.verdict import BORROWED_ONLY, Consequence, MachineRun, Violation

ROUNDS = 6  # runs of one machine: the first, then one per round of new findings
MACHINE_FAILED = "kvspec's machine failed"
NOT_REPRODUCIBLE = "the implementation answered the same calls differently"
UNRULED = {findings.HARNESS: "uncaught error", findings.NONDETERMINISTIC: "answers differ on the same calls"}
UNRULED_ENDS = {findings.HARNESS: MACHINE_FAILED, findings.NONDETERMINISTIC: NOT_REPRODUCIBLE}
ANSWERED = "stopped: what it found answers the question it ran for"

FindingKey = tuple[str, str, str]  # the rule (or the kind of an unruled finding), the call and its kind


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


def judge_machine(implementation: Implementation, path: str, declaration: ConformanceTest, profile: str) -> Judged:
    """One machine's rounds against ``implementation``, as a run of its own (folded into the verdict's)."""
    run = Run(implementation, path)
    run.selected.update(declaration.machine.judges)
    with exits_are_the_adapters(path, f"under machine {declaration.title!r}"):
        run.machines.append(run_one(run, declaration, profile_settings(profile)))
    return Judged.of(run)


def measure_consequences(
    run: Run, base: Settings, progress: Callable[[str], None] | None, machines: Sequence[ConformanceTest] = ()
) -> None:
    """For each caller-contract finding: send that kind of call alone, let the implementation accept it, and
    check safety from there on -- the first safety rule that breaks, and how many calls later, is what the
    call leads to.  Nothing breaking is reported too, with the examples it took."""
    for key, probe in run.probes.items():
        violation, rank = run.found[key]
        if progress:
            progress(f"what {probe.variant[0]} ({probe.variant[1]}) leads to")
        declaration = next((d for d in machines if d.title == probe.machine), None)
        declaration = declaration or suite.declaration_titled(probe.machine)
        settings = declaration.settings(base)
        outcome = running.run_machine(
            declaration.machine, run.implementation, settings, known=probe.known, probing=probe.variant
        )
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


def run_one(run: Run, declaration: ConformanceTest, base: Settings) -> MachineRun:
    """Rounds of one machine until it finds nothing new, under its declaration's settings of ``base``.

    An implementation that trusts its caller is judged in two passes: first it is sent no out-of-contract
    call at all (its safety and its conventions), then it is sent them (how it answers each kind, and --
    measured afterwards -- what accepting one leads to).
    """
    implementation = run.implementation
    title, machine = declaration.title, declaration.machine
    reason = machine.not_offered(implementation)
    if reason:
        return MachineRun(title, 0, 0, 0, 0, reason)
    if not machine.uses & implementation.own_components():
        return MachineRun(title, 0, 0, 0, 0, BORROWED_ONLY)
    rounds = Rounds(run, title, machine)
    trusted = implementation.conventions.trusts_caller
    for spared in (harness.EVERY_OPERATION, frozenset()) if trusted else (frozenset(),):
        rounds.until_nothing_new(declaration.settings(base), spared)
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
    contract_findings: list[findings.Finding] = attrs.field(factory=list)
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
                outcome = running.run_machine(self.machine, watched, base, known=self.known, spared=spared)
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


def machine_rank(machine: type[harness.LockstepMachine]) -> Callable[[findings.Finding], int]:
    """How well a machine illustrates a finding: 0 when it is a machine of the finding's own layer."""

    def rank(finding: findings.Finding) -> int:
        layer = finding.invariant.layer if finding.invariant else ""
        return 0 if machine.judges[:1] == (layer,) else 1

    return rank


def violation_of(
    implementation: Implementation, machine: str, finding: findings.Finding
) -> tuple[FindingKey, Violation]:
    """``finding`` of ``machine`` as the verdict lists it, and the key that tells it from the others."""
    rule = finding.invariant
    name = rule.name if rule else UNRULED[finding.kind]
    contract = finding.tier == "caller contract"
    operation, variant = (finding.operation, finding.variant) if contract else ("", "")
    consequences = tuple(Consequence(r.name, r.tier, detail) for r, detail in finding.consequences)
    offer = implementation.components.get(kind_of(implementation, operation)) if operation else None
    emulated = bool(offer and operation in offer.emulated)
    violation = Violation(
        name, finding.tier, operation, finding.detail, (machine,), finding.steps, consequences, variant=variant
    )
    return (name, operation, variant), attrs.evolve(violation, emulated=emulated)


def merge(run: Run, key: FindingKey, new: Violation, rank: int) -> None:
    """Add ``new``; one already found keeps the best illustration (own layer, then one that shows its steps, then
    shortest, then first found) and learns the machines."""
    old = run.found.get(key)
    if old is not None:
        old_violation, old_rank = old
        machines = (*old_violation.machines, *(m for m in new.machines if m not in old_violation.machines))
        if illustration(old_violation, old_rank) <= illustration(new, rank):
            new, rank = old_violation, old_rank
        new = attrs.evolve(new, machines=machines)
    run.found[key] = (new, rank)


def illustration(violation: Violation, rank: int) -> tuple[int, bool, int]:
    """How well a finding shows itself, best first: a machine of its own layer, with its steps, the fewest."""
    return rank, not violation.steps, len(violation.steps)


def kind_of(implementation: Implementation, operation: str) -> str:
    """The component kind whose method ``operation`` is, among those the implementation brought."""
    for kind in sorted(implementation.own_components()):
        if hasattr(implementation.components[kind].factory, operation):
            return kind
    return ""


def watch(implementation: Implementation, used: set[str]) -> Implementation:
    """``implementation`` with each component it brought noting in ``used`` when a machine builds it."""

    def noting(kind: str, factory: Callable[..., Any]) -> Callable[..., Any]:
        def build_component(*args: Any, **kwargs: Any) -> Any:
            used.add(kind)
            return factory(*args, **kwargs)

        build_component.__qualname__ = getattr(factory, "__qualname__", kind)
        return build_component

    offers = implementation.components
    noted = {
        kind: attrs.evolve(offers[kind], factory=noting(kind, offers[kind].factory))
        for kind in implementation.own_components()
    }
    return attrs.evolve(implementation, components={**offers, **noted})
