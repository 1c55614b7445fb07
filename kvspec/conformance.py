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
* The status: CONFORMS (something was checked, nothing counts against it),
  VIOLATED, or NOTHING CHECKED (no machine judged this implementation); an
  interrupted run is marked so.  An implementation that declares
  ``trusts_caller`` has its caller-contract findings reported as its declared
  choice: they do not make it fail.  A finding on an operation the adapter
  emulates is the adapter's, and says so.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from hypothesis import settings as Settings

from kvspec.properties import harness, profiles, suite
from kvspec.properties.loading import REFERENCE, AdapterError, build, load_implementation
from kvspec.report import table
from kvspec.spec.components import DeclarationError
from kvspec.spec.conventions import Conventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import REGISTRY, TIERS, Invariant

ROUNDS = 6  # runs of one machine: the first, then one per round of new findings
THIN_CHECKS = 20  # a rule held on fewer checks than this is reported as thinly checked
NOT_REACHED, HELD, VIOLATED, NOT_OFFERED, NOT_RUN = "not reached", "held", "VIOLATED", "not offered", "not run"
CONFORMS, NOTHING_CHECKED = "CONFORMS", "NOTHING CHECKED"
BORROWED_ONLY = "not counted: it uses only components borrowed from the reference"
EXIT_STATUS = {CONFORMS: 0, VIOLATED: 1, NOTHING_CHECKED: 3}  # 2: usage or adapter error (kvspec.cli)

MachineEntry = tuple[str, type[harness.LockstepMachine]]


class UsageError(ValueError):
    """A layer word or profile that names nothing: checking nothing must not pass for a verdict."""


@attrs.frozen
class Violation:
    """One distinct finding."""

    invariant: str  # or "uncaught error" when kvspec's own machine failed
    tier: str
    operation: str  # the out-of-contract call, for a caller-contract finding
    detail: str
    machines: tuple[str, ...]
    steps: tuple[str, ...]
    consequences: tuple[str, ...] = ()  # lower-tier rules that failed at the same step
    knock_ons: tuple[Violation, ...] = ()  # other findings with the same root cause
    in_production: str = ""  # what a caller-contract finding means in production, as the adapter says
    emulated: bool = False  # the operation is the adapter's emulation: the finding is the adapter's

    @property
    def heading(self) -> str:
        what = f"{self.invariant} ({self.operation})" if self.operation else self.invariant
        owner = " [on an operation the adapter emulates: the adapter's finding]" if self.emulated else ""
        return f"{what} violated in {', '.join(self.machines)}: {self.detail}{owner}"


@attrs.frozen
class RuleVerdict:
    invariant: str
    layer: str
    tier: str
    verdict: str
    checks: int
    checks_after_known: int = 0

    @property
    def shown(self) -> str:
        """The verdict as printed: a held rule says how thinly, or only past which findings, it was checked."""
        if self.verdict != HELD:
            return self.verdict
        if not self.checks:
            return f"{HELD} (only after known findings)"
        return f"{HELD} (thin)" if self.checks < THIN_CHECKS else HELD


@attrs.frozen
class MachineRun:
    machine: str
    runs: int
    examples: int
    steps: int
    findings: int
    ended: str  # why it stopped: "nothing new", "budget spent", "not offered: ...", "interrupted", ...


@attrs.frozen
class Verdict:
    """What ``kvspec check`` prints: per tier, every invariant's verdict and every distinct finding."""

    implementation: str
    path: str
    profile: str
    conventions: Conventions
    rules: tuple[RuleVerdict, ...]
    violations: tuple[Violation, ...]
    machines: tuple[MachineRun, ...]
    declaration: tuple[str, ...] = ()  # one line per component: own or borrowed, operations, emulated
    interrupted: bool = False

    @property
    def failures(self) -> tuple[Violation, ...]:
        """The findings that make the implementation fail: all but the caller-contract ones it declared."""
        trusted = self.conventions.trusts_caller
        return tuple(v for v in self.violations if not (trusted and v.tier == "caller contract"))

    @property
    def counted(self) -> int:
        """The machines that judged this implementation."""
        return sum(1 for m in self.machines if m.runs and m.ended != BORROWED_ONLY)

    @property
    def status(self) -> str:
        if self.failures:
            return VIOLATED
        return CONFORMS if self.counted else NOTHING_CHECKED

    @property
    def conforms(self) -> bool:
        return self.status == CONFORMS

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.status]

    def to_json(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "path": self.path,
            "profile": self.profile,
            "conventions": attrs.asdict(self.conventions),
            "declaration": list(self.declaration),
            "status": self.status,
            "conforms": self.conforms,
            "interrupted": self.interrupted,
            "tiers": {
                tier: {
                    "invariants": [{**attrs.asdict(r), "shown": r.shown} for r in self.rules if r.tier == tier],
                    "violations": [attrs.asdict(v) for v in self.violations if v.tier == tier],
                }
                for tier in (*TIERS, "harness")
            },
            "machines": [attrs.asdict(m) for m in self.machines],
        }

    def summary(self) -> str:
        counts = Counter(v.tier for v in self.failures)
        tiers = ", ".join(f"{tier} {counts[tier]}" for tier in (*TIERS, "harness") if counts[tier])
        interrupted = " (interrupted: the verdict of what ran)" if self.interrupted else ""
        if self.status == VIOLATED:
            return f"VIOLATED: {len(self.failures)} distinct findings ({tiers}){interrupted}"
        if self.status == NOTHING_CHECKED:
            return f"NOTHING CHECKED: no machine judged a component of this implementation{interrupted}"
        excused = len(self.violations)
        trusted = f" (trusts its caller: {excused} caller-contract findings)" if excused else ""
        return f"CONFORMS{trusted}{interrupted}"

    def __str__(self) -> str:
        out = [f"kvspec check: {self.implementation} ({self.path}), profile {self.profile}", describe(self.conventions)]
        out += [f"  {line}" for line in self.declaration]
        for tier in TIERS:
            rows = [
                [r.invariant, r.layer, r.shown, r.checks + r.checks_after_known] for r in self.rules if r.tier == tier
            ]
            out += ["", table(["invariant", "layer", "verdict", "checks"], rows, title=f"-- {tier} --")]
            for violation in (v for v in self.violations if v.tier == tier):
                out += ["", *finding_lines(violation, tier == "caller contract" and self.conventions.trusts_caller)]
        for violation in (v for v in self.violations if v.tier == "harness"):
            out += ["", *finding_lines(violation, False)]
        rows = [[m.machine, m.runs, m.examples, m.steps, m.findings, m.ended] for m in self.machines]
        out += ["", table(["machine", "runs", "examples", "steps", "findings", "ended"], rows)]
        return "\n".join(out) + "\n\n" + self.summary()

    def markdown(self) -> str:
        """A section of ``docs/engines.md``: the verdict, per tier, with each finding's sequence."""
        counts = Counter(r.verdict for r in self.rules)
        out = [
            f"## {self.implementation}",
            "",
            f"`{self.path}`, profile `{self.profile}`. {describe(self.conventions)}",
            "",
            *(f"- {line}" for line in self.declaration),
            "",
            f"**{self.summary()}** -- rules: "
            + ", ".join(f"{counts[v]} {v}" for v in (VIOLATED, HELD, NOT_REACHED, NOT_OFFERED, NOT_RUN) if counts[v]),
        ]
        for tier in TIERS:
            out += ["", f"### {tier}", "", "| invariant | verdict | checks |", "|---|---|---|"]
            out += [
                f"| `{r.invariant}` | {r.shown} | {r.checks + r.checks_after_known} |"
                for r in self.rules
                if r.tier == tier
            ]
            for violation in (v for v in self.violations if v.tier in (tier, "harness" if tier == TIERS[-1] else "")):
                lines = finding_lines(violation, tier == "caller contract" and self.conventions.trusts_caller)
                out += ["", f"- {lines[0]}", *(f"  {line}" for line in lines[1:] if not line.startswith("    "))]
                out += ["", "  ```", *(f"  {step}" for step in violation.steps), "  ```"]
        return "\n".join(out) + "\n"


def finding_lines(violation: Violation, trusted: bool) -> list[str]:
    """A finding as printed: its heading, what it leads to, its knock-ons, its sequence."""
    out = [("trusts caller: " if trusted else "") + violation.heading]
    out += [f"in production: {violation.in_production}"] if violation.in_production else []
    out += [f"at the same step: {line}" for line in violation.consequences]
    out += [f"same root cause: {knock_on.heading} [{knock_on.tier}]" for knock_on in violation.knock_ons]
    out += ["shrunk operation sequence:", *(f"    {step}" for step in violation.steps)]
    return out


def describe(conventions: Conventions) -> str:
    pool, radix = conventions.pool, conventions.radix
    return (
        f"conventions: pool(unhashed free at {pool.unhashed_free_position}, duplicate hash {pool.duplicate_hash}, "
        f"policies {'/'.join(pool.policies)}); radix({radix.eviction_granularity}, recency {radix.recency}, "
        f"lock by {radix.lock_by}, page size {radix.page_size}, extra-key namespaces "
        f"{'yes' if radix.extra_key_namespaces else 'no'}); trusts caller: {'yes' if conventions.trusts_caller else 'no'}"
    )


def declaration_lines(implementation: Implementation) -> tuple[str, ...]:
    """One line per component this implementation brought: its factory, optional operations, emulations."""
    lines = []
    for kind, offer in sorted(implementation.offers().items()):
        if kind in implementation.borrowed:
            continue
        operations = ", ".join(sorted(offer.operations)) or "none"
        emulated = f"; the adapter emulates {', '.join(sorted(offer.emulated))}" if offer.emulated else ""
        name = getattr(offer.factory, "__qualname__", type(offer.factory).__name__)
        lines.append(f"{kind}: {name}, optional operations offered: {operations}{emulated}")
    borrowed = ", ".join(sorted(implementation.borrowed))
    return (*lines, f"borrowed from the reference: {borrowed}") if borrowed else tuple(lines)


def in_production(path: str, violation: Violation) -> Violation:
    """``violation`` with what it means in production, if it is a caller-contract finding and the factory's module
    says so in ``IN_PRODUCTION`` (keyed by operation, as the adapters do)."""
    said: Mapping[str, str] = getattr(sys.modules.get(path.partition(":")[0]), "IN_PRODUCTION", {})
    if violation.tier != "caller contract" or violation.operation not in said:
        return violation
    return attrs.evolve(violation, in_production=said[violation.operation])


def resolve(factory: str | Callable[[], Implementation] | Implementation) -> tuple[str, Implementation]:
    """The implementation ``factory`` names, validated and completed from the reference, and how to name it."""
    if isinstance(factory, str):
        return factory, load_implementation(factory)
    path = getattr(factory, "__module__", "?") + ":" + getattr(factory, "__qualname__", type(factory).__name__)
    return path, build(path, factory).complete_with(load_implementation(REFERENCE))


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
    unknown = [word for word in words if not any(word in title for title, _ in everything)]
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


@attrs.define
class Run:
    """What the verdict accumulates while its machines run."""

    implementation: Implementation
    path: str
    checks: Counter[Invariant] = attrs.field(factory=Counter)
    checks_after_known: Counter[Invariant] = attrs.field(factory=Counter)
    found: dict[tuple[str, str], tuple[Violation, int]] = attrs.field(factory=dict)  # with its machine's rank
    machines: list[MachineRun] = attrs.field(factory=list)
    judged: set[str] = attrs.field(factory=set)  # layers whose rules a counted machine checked
    selected: set[str] = attrs.field(factory=set)  # layers of every machine selected
    interrupted: bool = False


def run_conformance(
    factory: str | Callable[[], Implementation] | Implementation,
    layers: Iterable[str] | None = None,
    profile: str = "ci",
    progress: Callable[[str], None] | None = None,
    machines: Sequence[MachineEntry] = (),
) -> Verdict:
    """Run every machine of ``layers`` against ``factory``; the verdict, every distinct finding included.

    Ctrl-C stops the run and returns the verdict of what ran, marked interrupted.
    """
    base = profile_settings(profile)
    chosen = choose(layers, machines)
    path, implementation = resolve(factory)
    run = Run(implementation, path)
    for i, (title, machine) in enumerate(chosen, 1):
        if progress:
            progress(f"[{i}/{len(chosen)}] {title}")
        run.selected.update(machine.judges)
        try:
            run.machines.append(run_one(run, title, machine, base))
        except KeyboardInterrupt:
            run.interrupted = True
            run.machines.append(MachineRun(title, 0, 0, 0, 0, "interrupted"))
            break
    return verdict_of(run, profile)


def run_one(run: Run, title: str, machine: type[harness.LockstepMachine], base: Settings) -> MachineRun:
    """Rounds of one machine until it finds nothing new."""
    implementation = run.implementation
    reason = machine.not_offered(implementation)
    if reason:
        return MachineRun(title, 0, 0, 0, 0, reason)
    if not machine.uses & implementation.own_components():
        return MachineRun(title, 0, 0, 0, 0, BORROWED_ONLY)
    known: frozenset[Invariant] = frozenset()
    spared: frozenset[str] = frozenset()
    runs = examples = steps = findings = 0
    ended = "budget spent"
    used: set[str] = set()
    watched = watch(implementation, used)
    rank = machine_rank(machine)
    while runs < ROUNDS:
        try:
            outcome = harness.run_machine(machine, watched, base, known=known, spared=spared)
        except DeclarationError as error:
            raise AdapterError(f"{run.path}: {error}") from None
        statistics = outcome.statistics
        runs, examples, steps = runs + 1, examples + statistics.examples, steps + statistics.steps
        if not used:
            return MachineRun(title, runs, examples, steps, 0, BORROWED_ONLY)
        run.judged.update(machine.judges)
        run.checks.update(statistics.checks)
        run.checks_after_known.update(statistics.checks_after_known)
        if not outcome.findings:
            ended = "every example broke a known rule" if outcome.unsatisfiable else "nothing new"
            break
        findings += len(outcome.findings)
        for finding in outcome.findings:
            merge(run, title, finding, rank(finding))
        if any(finding.invariant is None for finding in outcome.findings):
            ended = "kvspec's machine failed"
            break
        for finding in outcome.findings:
            assert finding.invariant is not None
            if finding.tier == "caller contract":
                spared |= {finding.operation}
            else:
                known |= {finding.invariant}
    return MachineRun(title, runs, examples, steps, findings, ended)


def machine_rank(machine: type[harness.LockstepMachine]) -> Callable[[harness.Finding], int]:
    """How well a machine illustrates a finding: 0 when it is a machine of the finding's own layer."""

    def rank(finding: harness.Finding) -> int:
        layer = finding.invariant.layer if finding.invariant else ""
        return 0 if machine.judges[:1] == (layer,) else 1

    return rank


def merge(run: Run, machine: str, finding: harness.Finding, rank: int) -> None:
    """Add ``finding``; one already found keeps the best illustration (own layer, then shortest) and learns
    the machine."""
    rule = finding.invariant
    name = rule.name if rule else "uncaught error"
    operation = finding.operation if finding.tier == "caller contract" else ""
    consequences = tuple(f"{r.name} ({r.tier}): {detail}" for r, detail in finding.consequences)
    offer = run.implementation.offers().get(kind_of(run.implementation, operation)) if operation else None
    emulated = bool(offer and operation in offer.emulated)
    new = Violation(name, finding.tier, operation, finding.detail, (machine,), finding.steps, consequences)
    new = attrs.evolve(new, emulated=emulated)
    old = run.found.get((name, operation))
    if old is not None:
        old_violation, old_rank = old
        if (old_rank, len(old_violation.steps)) <= (rank, len(new.steps)):
            new, rank = old_violation, old_rank
        new = attrs.evolve(new, machines=(*old_violation.machines, machine))
    run.found[(name, operation)] = (new, rank)


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
    for violation in sorted(violations, key=lambda v: (TIERS + ("harness",)).index(v.tier)):
        root = next(
            (
                r
                for r in roots
                if r.steps == violation.steps or any(c.startswith(violation.invariant + " ") for c in r.consequences)
            ),
            None,
        )
        if root is None:
            roots.append(violation)
        else:
            roots[roots.index(root)] = attrs.evolve(root, knock_ons=(*root.knock_ons, violation))
    return roots


def verdict_of(run: Run, profile: str) -> Verdict:
    violated = {name for name, _ in run.found}
    implementation = run.implementation
    unoffered = harness.LockstepMachine.bind(implementation).unoffered

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
    )
    violations = group_knock_ons([in_production(run.path, v) for v, _ in run.found.values()])
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
