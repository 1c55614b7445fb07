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

import base64
import itertools
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from hypothesis import settings as Settings

from kvspec.properties import harness, profiles, suite
from kvspec.properties.loading import REFERENCE, AdapterError, UsageError, build, load_implementation
from kvspec.report import table
from kvspec.spec.components import DeclarationError
from kvspec.spec.conventions import Conventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import REGISTRY, TIERS, Invariant, invariant_out_of_contract_call_rejected

ROUNDS = 6  # runs of one machine: the first, then one per round of new findings
THIN_CHECKS = 20  # a rule held on fewer checks than this is reported as thinly checked
NOT_REACHED, HELD, VIOLATED, NOT_OFFERED, NOT_RUN = "not reached", "held", "VIOLATED", "not offered", "not run"
CONFORMS, NOTHING_CHECKED = "CONFORMS", "NOTHING CHECKED"
BORROWED_ONLY = "not counted: it uses only components borrowed from the reference"
EXIT_STATUS = {CONFORMS: 0, VIOLATED: 1, NOTHING_CHECKED: 3}  # 2: usage or adapter error (kvspec.cli)

MachineEntry = tuple[str, type[harness.LockstepMachine]]


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
    variant: str = ""  # the kind of out-of-contract call (harness.variant_of), for a caller-contract finding
    leads_to: str = ""  # measured: what accepting the call leads to (a caller-contract finding, probed)
    leads_to_steps: tuple[str, ...] = ()  # the sequence that shows it
    emulated: bool = False  # the operation is the adapter's emulation: the finding is the adapter's
    replay: str = ""  # a token for ``kvspec replay``: the machine, what was known, the shrunk example

    @property
    def heading(self) -> str:
        what = f"{self.invariant} ({self.operation}: {self.variant})" if self.operation else self.invariant
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
                out += ["", f"- {lines[0]}", *markdown_item(lines[1:])]
        return "\n".join(out) + "\n"


def markdown_item(lines: Sequence[str]) -> list[str]:
    """A finding's lines under its list item, each run of indented steps as a code block."""
    out: list[str] = []
    for indented, run in itertools.groupby(lines, key=lambda line: line.startswith("    ")):
        shown = [f"  {line[4:]}" if indented else f"  {line}" for line in run]
        out += ["", "  ```", *shown, "  ```", ""] if indented else shown
    return out


def finding_lines(violation: Violation, trusted: bool) -> list[str]:
    """A finding as printed: its heading, what it leads to, its knock-ons, its sequence."""
    out = [("trusts caller: " if trusted else "") + violation.heading]
    out += [f"at the same step: {line}" for line in violation.consequences]
    out += [f"same root cause: {knock_on.heading} [{knock_on.tier}]" for knock_on in violation.knock_ons]
    out += ["shrunk operation sequence:", *(f"    {step}" for step in violation.steps)]
    out += [f"replay: kvspec replay {violation.replay}"] if violation.replay else []
    if violation.leads_to:
        out += [f"what it leads to (measured): {violation.leads_to}"]
        out += [f"    {step}" for step in violation.leads_to_steps]
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


@attrs.frozen
class Probe:
    """How to rerun the machine that made a caller-contract finding, to measure what the call leads to."""

    machine: type[harness.LockstepMachine]
    known: frozenset[Invariant]
    variant: harness.Variant


@attrs.define
class Run:
    """What the verdict accumulates while its machines run."""

    implementation: Implementation
    path: str
    checks: Counter[Invariant] = attrs.field(factory=Counter)
    checks_after_known: Counter[Invariant] = attrs.field(factory=Counter)
    found: dict[tuple[str, str, str], tuple[Violation, int]] = attrs.field(factory=dict)  # with its machine's rank
    probes: dict[tuple[str, str, str], Probe] = attrs.field(factory=dict)  # where each contract finding was made
    machines: list[MachineRun] = attrs.field(factory=list)
    judged: set[str] = attrs.field(factory=set)  # layers whose rules a counted machine checked
    selected: set[str] = attrs.field(factory=set)  # layers of every machine selected
    interrupted: bool = False
    # whether what it found already answers the question it runs for (a meta-test asks one): then it stops
    answered: Callable[[Run], bool] = lambda run: False


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
        run.selected.update(machine.judges)
        try:
            if progress:
                progress(f"[{i}/{len(chosen)}] {title}")
            run.machines.append(run_one(run, title, machine, base))
        except KeyboardInterrupt:
            run.interrupted = True
            run.machines.append(MachineRun(title, 0, 0, 0, 0, "interrupted"))
            break
    if not run.interrupted:
        try:
            measure_consequences(run, base, progress)
        except KeyboardInterrupt:
            run.interrupted = True
    return verdict_of(run, profile)


def measure_consequences(run: Run, base: Settings, progress: Callable[[str], None] | None) -> None:
    """For each caller-contract finding: send that kind of call alone, let the implementation accept it, and
    check safety from there on -- the first safety rule that breaks, and how many calls later, is what the
    call leads to.  Nothing breaking is reported too, with the examples it took."""
    for key, probe in run.probes.items():
        violation, rank = run.found[key]
        if progress:
            progress(f"what {probe.variant[0]} ({probe.variant[1]}) leads to")
        outcome = harness.run_machine(probe.machine, run.implementation, base, known=probe.known, probing=probe.variant)
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
        if rounds.ended in (BORROWED_ONLY, MACHINE_FAILED, ANSWERED):
            break
    for finding in rounds.contract_findings:
        key = (invariant_out_of_contract_call_rejected.name, finding.operation, finding.variant)
        run.probes.setdefault(key, Probe(machine, rounds.known, (finding.operation, finding.variant)))
    return MachineRun(title, rounds.runs, rounds.examples, rounds.steps, rounds.findings, rounds.ended)


MACHINE_FAILED = "kvspec's machine failed"
ANSWERED = "stopped: what it found answers the question it ran for"


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
                merge(
                    self.run,
                    self.title,
                    attrs.evolve(finding, blob=context.token(self.run.path, finding.blob)),
                    rank(finding),
                )
                if finding.invariant is None:
                    self.ended = MACHINE_FAILED
                elif finding.tier == "caller contract":
                    spared |= {(finding.operation, finding.variant)}
                    self.contract_findings.append(finding)
                else:
                    self.known |= {finding.invariant}
            if self.ended == MACHINE_FAILED:
                return
            if self.run.answered(self.run):
                self.ended = ANSWERED
                return
        self.ended = "budget spent"


@attrs.frozen
class ReplayContext:
    """How a machine was bound when it found something: what ``kvspec replay`` needs to run that example again."""

    machine: str
    known: frozenset[Invariant]
    spared: frozenset[harness.Variant]

    def token(self, path: str, blob: str) -> str:
        if not blob:
            return ""
        payload = {
            "impl": path,
            "machine": self.machine,
            "known": sorted(rule.name for rule in self.known),
            "spared": sorted(map(list, self.spared)),
            "blob": blob,
        }
        return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode()


def replay(token: str, machines: Sequence[MachineEntry] = ()) -> tuple[str, harness.Finding | None]:
    """Run the example a verdict printed (``Violation.replay``) again: the implementation it names, and its
    finding now (None: it no longer fails)."""
    try:
        payload = json.loads(base64.urlsafe_b64decode(token.encode()))
        path, title, known, spared, blob = (payload[k] for k in ("impl", "machine", "known", "spared", "blob"))
    except (ValueError, KeyError, TypeError):
        raise UsageError("not a replay token printed by kvspec check") from None
    machine = dict(choose(None, machines)).get(title)
    if machine is None:
        raise UsageError(f"no machine titled {title!r}")
    implementation = load_implementation(path)
    rules = frozenset(REGISTRY[name] for name in known if name in REGISTRY)
    variants = frozenset((operation, variant) for operation, variant in spared)
    return path, harness.replay(machine, implementation, blob, known=rules, spared=variants)


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
    contract = finding.tier == "caller contract"
    operation, variant = (finding.operation, finding.variant) if contract else ("", "")
    consequences = tuple(f"{r.name} ({r.tier}): {detail}" for r, detail in finding.consequences)
    offer = run.implementation.offers().get(kind_of(run.implementation, operation)) if operation else None
    emulated = bool(offer and operation in offer.emulated)
    new = Violation(
        name, finding.tier, operation, finding.detail, (machine,), finding.steps, consequences, variant=variant
    )
    new = attrs.evolve(new, emulated=emulated, replay=finding.blob)
    old = run.found.get((name, operation, variant))
    if old is not None:
        old_violation, old_rank = old
        if (old_rank, len(old_violation.steps)) <= (rank, len(new.steps)):
            new, rank = old_violation, old_rank
        new = attrs.evolve(new, machines=(*old_violation.machines, machine))
    run.found[(name, operation, variant)] = (new, rank)


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
    implementation = run.implementation
    # a rule that failed at another finding's step is violated too, not "held" -- unless that step was a call
    # the implementation declares it accepts (what such a call leads to is reported with it)
    accepted = implementation.conventions.trusts_caller
    violated = {name for name, _, _ in run.found}
    violated |= {
        line.partition(" ")[0]
        for v, _ in run.found.values()
        if not (accepted and v.tier == "caller contract")
        for line in v.consequences
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
