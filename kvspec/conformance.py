"""``kvspec.run_conformance``: an implementation's conformance verdict, as an object.

::

    import kvspec

    verdict = kvspec.run_conformance("my_engine.adapter:factory", layers=["block pool"], profile="ci")
    print(verdict)          # what ``kvspec check`` prints; verdict.to_json() is what ``--json`` prints
    assert verdict.conforms

Rules:

* ``factory`` is ``module:factory``, the factory itself, or an
  ``Implementation``; components it leaves out come from the reference.
  ``layers`` keeps the machines whose title contains one of the given words
  (default: every machine of ``properties.suite``).
* A machine runs until it finds nothing new: after a finding it runs again
  with that invariant *known* -- examples that break it are discarded, so the
  next run looks past it -- or, for a caller-contract finding, without
  sending that operation's out-of-contract calls; at most ``ROUNDS`` runs.
* Every distinct finding is reported once, with its own shrunk sequence (the
  shortest any machine found): distinct by invariant and, for
  caller-contract rules, by operation.
* An invariant is *violated*, *held* (checked, never violated) or *not
  reached* (never checked: its machine did not get there).  Never "held"
  for a rule that was not checked.
* Findings are sorted into the invariants' tiers.  An implementation that
  declares ``trusts_caller`` has its caller-contract findings reported as
  its declared choice: they do not make it fail.  Any other finding does.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
from hypothesis import settings as Settings

from kvspec.properties import harness, profiles, suite
from kvspec.report import table
from kvspec.spec.conventions import Conventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import REGISTRY, TIERS, Invariant

ROUNDS = 6  # runs of one machine: the first, then one per new finding
NOT_REACHED, HELD, VIOLATED = "not reached", "held", "VIOLATED"
BORROWED_ONLY = "not counted: it calls only components borrowed from the reference"


@attrs.frozen
class Violation:
    """One distinct finding."""

    invariant: str  # or "uncaught error" when the machine itself failed
    tier: str
    operation: str  # the out-of-contract call, for a caller-contract finding
    detail: str
    machines: tuple[str, ...]
    steps: tuple[str, ...]
    in_production: str = ""  # what a caller-contract finding means in production, as the factory's module says

    @property
    def heading(self) -> str:
        what = f"{self.invariant} ({self.operation})" if self.operation else self.invariant
        return f"{what} violated in {', '.join(self.machines)}: {self.detail}"


@attrs.frozen
class RuleVerdict:
    invariant: str
    layer: str
    tier: str
    verdict: str
    checks: int


@attrs.frozen
class MachineRun:
    machine: str
    runs: int
    examples: int
    steps: int
    findings: int
    ended: str  # why it stopped: "nothing new", "budget spent", "every example broke a known rule", ...


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

    @property
    def failures(self) -> tuple[Violation, ...]:
        """The findings that make the implementation fail: all but the caller-contract ones it declared."""
        trusted = self.conventions.trusts_caller
        return tuple(v for v in self.violations if not (trusted and v.tier == "caller contract"))

    @property
    def conforms(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "path": self.path,
            "profile": self.profile,
            "conventions": attrs.asdict(self.conventions),
            "conforms": self.conforms,
            "tiers": {
                tier: {
                    "invariants": [attrs.asdict(r) for r in self.rules if r.tier == tier],
                    "violations": [attrs.asdict(v) for v in self.violations if v.tier == tier],
                }
                for tier in (*TIERS, "harness")
            },
            "machines": [attrs.asdict(m) for m in self.machines],
        }

    def __str__(self) -> str:
        out = [f"kvspec check: {self.implementation} ({self.path}), profile {self.profile}", describe(self.conventions)]
        for tier in TIERS:
            rows = [[r.invariant, r.layer, r.verdict, r.checks] for r in self.rules if r.tier == tier]
            out += ["", table(["invariant", "layer", "verdict", "checks"], rows, title=f"-- {tier} --")]
            for violation in (v for v in self.violations if v.tier == tier):
                trusted = tier == "caller contract" and self.conventions.trusts_caller
                out += ["", ("trusts caller: " if trusted else "") + violation.heading]
                out += [f"in production: {violation.in_production}"] if violation.in_production else []
                out += ["shrunk operation sequence:", *(f"    {step}" for step in violation.steps)]
        for violation in (v for v in self.violations if v.tier == "harness"):
            out += ["", violation.heading, "operation sequence:", *(f"    {step}" for step in violation.steps)]
        rows = [[m.machine, m.runs, m.examples, m.steps, m.findings, m.ended] for m in self.machines]
        out += ["", table(["machine", "runs", "examples", "steps", "findings", "ended"], rows)]
        counts = Counter(v.tier for v in self.failures)
        summary = ", ".join(f"{tier} {counts[tier]}" for tier in (*TIERS, "harness") if counts[tier])
        if self.conforms:
            excused = len(self.violations)
            out.append(f"\nCONFORMS{f' (trusts its caller: {excused} caller-contract findings)' if excused else ''}")
        else:
            out.append(f"\nVIOLATED: {len(self.failures)} distinct findings ({summary})")
        return "\n".join(out)

    def markdown(self) -> str:
        """A section of ``docs/engines.md``: the verdict, per tier, with each finding's sequence."""
        out = [
            f"## {self.implementation}",
            "",
            f"`{self.path}`, profile `{self.profile}`. {describe(self.conventions)}",
            "",
        ]
        out.append(f"**{'CONFORMS' if self.conforms else 'VIOLATED'}**")
        for tier in TIERS:
            out += ["", f"### {tier}", "", "| invariant | verdict | checks |", "|---|---|---|"]
            out += [f"| `{r.invariant}` | {r.verdict} | {r.checks} |" for r in self.rules if r.tier == tier]
            for violation in (v for v in self.violations if v.tier in (tier, "harness" if tier == TIERS[-1] else "")):
                out += ["", f"- {violation.heading}"]
                out += ["", f"  In production: {violation.in_production}"] if violation.in_production else []
                out += ["", "  ```", *(f"  {step}" for step in violation.steps), "  ```"]
        return "\n".join(out) + "\n"


def describe(conventions: Conventions) -> str:
    pool, radix = conventions.pool, conventions.radix
    return (
        f"conventions: pool(unhashed free at {pool.unhashed_free_position}, duplicate hash {pool.duplicate_hash}, "
        f"policies {'/'.join(pool.policies)}); radix({radix.eviction_granularity}, recency {radix.recency}, "
        f"lock by {radix.lock_by}, page size {radix.page_size}, extra-key namespaces "
        f"{'yes' if radix.extra_key_namespaces else 'no'}); trusts caller: {'yes' if conventions.trusts_caller else 'no'}"
    )


def in_production(path: str, violation: Violation) -> Violation:
    """``violation`` with what it means in production, if it is a caller-contract finding and the factory's module
    says so in ``IN_PRODUCTION`` (keyed by operation, as the adapters do)."""
    said: Mapping[str, str] = getattr(sys.modules.get(path.partition(":")[0]), "IN_PRODUCTION", {})
    if violation.tier != "caller contract" or violation.operation not in said:
        return violation
    return attrs.evolve(violation, in_production=said[violation.operation])


def resolve(factory: str | Callable[[], Implementation] | Implementation) -> tuple[str, Implementation]:
    """The implementation ``factory`` names, completed from the reference, and how to name it."""
    if isinstance(factory, str):
        return factory, harness.load_implementation(factory)
    implementation = factory if isinstance(factory, Implementation) else factory()
    path = getattr(factory, "__module__", "?") + ":" + getattr(factory, "__qualname__", type(factory).__name__)
    return path, implementation.complete_with(harness.load_implementation(harness.REFERENCE))


def watch(implementation: Implementation, used: set[str]) -> Implementation:
    """``implementation`` with each component it brought noting in ``used`` when a machine calls it."""

    def noting(name: str, factory: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            used.add(name)
            return factory(*args, **kwargs)

        return call

    noted: dict[str, Any] = {
        name: noting(name, getattr(implementation, name)) for name in implementation.own_components()
    }
    return attrs.evolve(implementation, **noted)


def run_conformance(
    factory: str | Callable[[], Implementation] | Implementation,
    layers: Iterable[str] | None = None,
    profile: str = "ci",
    progress: Callable[[str], None] | None = None,
) -> Verdict:
    """Run every machine of ``layers`` against ``factory``; the verdict, every distinct finding included."""
    path, implementation = resolve(factory)
    wanted = list(layers) if layers is not None else None
    chosen = [(t, p) for t, p in suite.MACHINES if wanted is None or any(word in t for word in wanted)]
    base = Settings.get_profile(profile) if profile in profiles.PROFILES else Settings()
    checks: Counter[Invariant] = Counter()
    found: dict[tuple[str, str], Violation] = {}
    machines = []
    for i, (title, machine_path) in enumerate(chosen, 1):
        if progress:
            progress(f"[{i}/{len(chosen)}] {title}")
        machine = suite.load_machine(machine_path)
        known: frozenset[Invariant] = frozenset()
        spared: frozenset[str] = frozenset()
        runs = examples = steps = findings = 0
        ended = "budget spent"
        used: set[str] = set()
        watched = watch(implementation, used)
        while runs < ROUNDS:
            outcome = harness.run_machine(machine, watched, base, known=known, spared=spared)
            runs, examples, steps = runs + 1, examples + outcome.runs, steps + outcome.steps_explored
            if not used:
                ended = BORROWED_ONLY  # what it checked is the reference's verdict, not this implementation's
                break
            checks.update(outcome.checks)
            finding = outcome.finding
            if finding is None:
                ended = "every example broke a known rule" if outcome.unsatisfiable else "nothing new"
                break
            findings += 1
            merge(found, title, finding)
            if finding.invariant is None:
                ended = "the machine failed"
                break
            if finding.invariant.tier == "caller contract":
                spared |= {finding.operation}
            else:
                known |= {finding.invariant}
        machines.append(MachineRun(title, runs, examples, steps, findings, ended))
    violated = {name for name, _ in found}
    rules = tuple(
        RuleVerdict(
            rule.name,
            rule.layer,
            rule.tier,
            VIOLATED if name in violated else (HELD if checks[rule] else NOT_REACHED),
            checks[rule],
        )
        for name, rule in sorted(REGISTRY.items(), key=lambda item: (item[1].layer, item[0]))
    )
    return Verdict(
        implementation=implementation.name,
        path=path,
        profile=profile,
        conventions=implementation.conventions,
        rules=rules,
        violations=tuple(
            sorted((in_production(path, v) for v in found.values()), key=lambda v: (v.tier, v.invariant, v.operation))
        ),
        machines=tuple(machines),
    )


def merge(found: dict[tuple[str, str], Violation], machine: str, finding: harness.Finding) -> None:
    """Add ``finding``; one already found keeps the shorter sequence and learns the machine."""
    rule = finding.invariant
    name, tier = (rule.name, rule.tier) if rule else ("uncaught error", "harness")
    operation = finding.operation if tier == "caller contract" else ""
    new = Violation(name, tier, operation, finding.detail, (machine,), finding.steps)
    old = found.get((name, operation))
    if old is not None:
        shorter = new if len(new.steps) < len(old.steps) else old
        new = attrs.evolve(shorter, machines=(*old.machines, machine))
    found[(name, operation)] = new


def report_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
