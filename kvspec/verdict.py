"""A conformance verdict as data, and the three ways it is shown: text, JSON and a section of ``docs/engines.md``.

Rules:

* A finding is a ``Violation``: its rule (or, without one, its kind:
  ``answers differ on the same calls``, ``uncaught error``), its tier, the call
  and the kind of out-of-contract call where that matters, the shrunk
  sequence and a ``kvspec replay`` token.  What else failed at the same step
  are ``Consequence`` records, never text to parse back.
* An invariant's verdict is VIOLATED, held (with its count of checks), not
  reached, not offered or not run (``RuleVerdict``); never "held" for a rule
  that was not checked.
* The status: CONFORMS, VIOLATED, NOTHING CHECKED or INTERRUPTED, each with
  its exit status (``EXIT_STATUS``).  Only the findings that count against
  the implementation make it VIOLATED (``Verdict.failures``): a caller-contract
  finding is the declared choice of an implementation that trusts its caller.
* ``Verdict.markdown`` puts the status and the findings first, the rules that
  held with their counts after, the rules no machine could reach collapsed to
  one line, and the rule registry it was judged under (``registry_digest``):
  a page written under another registry is out of date.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from kvspec.adapters import REPRODUCED
from kvspec.properties.findings import FINDING_KINDS
from kvspec.report import table
from kvspec.spec.conventions import Conventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import REGISTRY, TIERS

THIN_CHECKS = 20  # a rule held on fewer checks than this is reported as thinly checked
NOT_REACHED, HELD, VIOLATED, NOT_OFFERED, NOT_RUN = "not reached", "held", "VIOLATED", "not offered", "not run"
CONFORMS, NOTHING_CHECKED, INTERRUPTED = "CONFORMS", "NOTHING CHECKED", "INTERRUPTED"
BORROWED_ONLY = "not counted: it uses only components borrowed from the reference"
# 2: usage or adapter error (kvspec.cli); 130: the shell's status for Ctrl-C, as if the run had been killed
EXIT_STATUS = {CONFORMS: 0, VIOLATED: 1, NOTHING_CHECKED: 3, INTERRUPTED: 130}


@attrs.frozen
class Consequence:
    """A rule of a lower tier that failed at the same step as a finding."""

    invariant: str
    tier: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant} ({self.tier}): {self.detail}"


@attrs.frozen
class Violation:
    """One distinct finding."""

    invariant: str  # the rule; without one, the finding's kind (``rounds.UNRULED``)
    tier: str
    operation: str  # the out-of-contract call, for a caller-contract finding
    detail: str
    machines: tuple[str, ...]
    steps: tuple[str, ...]
    consequences: tuple[Consequence, ...] = ()  # lower-tier rules that failed at the same step
    knock_ons: tuple[Violation, ...] = ()  # other findings with the same root cause
    variant: str = ""  # the kind of out-of-contract call (findings.variant_of), for a caller-contract finding
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


def registry_digest() -> str:
    """The rule registry a verdict is judged under: every rule's name, layer and tier, hashed."""
    rules = "\n".join(f"{name} {rule.layer} {rule.tier}" for name, rule in sorted(REGISTRY.items()))
    return hashlib.sha256(rules.encode()).hexdigest()[:12]


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
    not_started: tuple[str, ...] = ()  # the machines selected that Ctrl-C kept from running
    registry: str = attrs.field(factory=registry_digest)

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
        if self.interrupted:
            return INTERRUPTED
        return CONFORMS if self.counted else NOTHING_CHECKED

    @property
    def conforms(self) -> bool | None:
        """Whether it conforms; None when the run was interrupted before anything counted against it."""
        return None if self.status == INTERRUPTED else self.status == CONFORMS

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.status]

    def to_json(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "path": self.path,
            "profile": self.profile,
            "registry": self.registry,
            "conventions": attrs.asdict(self.conventions),
            "declaration": list(self.declaration),
            "status": self.status,
            "conforms": self.conforms,
            "interrupted": self.interrupted,
            "not_started": list(self.not_started),
            "tiers": {
                tier: {
                    "invariants": [{**attrs.asdict(r), "shown": r.shown} for r in self.rules if r.tier == tier],
                    "violations": [attrs.asdict(v) for v in self.violations if v.tier == tier],
                }
                for tier in FINDING_KINDS
            },
            "machines": [attrs.asdict(m) for m in self.machines],
        }

    def summary(self) -> str:
        counts = Counter(v.tier for v in self.failures)
        tiers = ", ".join(f"{tier} {counts[tier]}" for tier in FINDING_KINDS if counts[tier])
        interrupted = " (interrupted: the verdict of what ran)" if self.interrupted else ""
        if self.status == VIOLATED:
            return f"VIOLATED: {len(self.failures)} distinct findings ({tiers}){interrupted}"
        if self.status == INTERRUPTED:
            finished = sum(1 for m in self.machines if m.ended != "interrupted")
            selected = len(self.machines) + len(self.not_started)
            return (
                f"INTERRUPTED: no verdict -- {finished} of {selected} machines ran to the end "
                f"({self.counted} judged this implementation) and found nothing against it so far"
            )
        if self.status == NOTHING_CHECKED:
            return "NOTHING CHECKED: no machine judged a component of this implementation"
        excused = len(self.violations)
        trusted = f" (trusts its caller: {excused} caller-contract findings)" if excused else ""
        return f"CONFORMS{trusted}"

    def findings_of(self, tier: str) -> list[Violation]:
        """The findings filed under ``tier``; under the last tier, those no rule names too."""
        last = tier == TIERS[-1]
        return [v for v in self.violations if v.tier == tier or (last and v.tier not in TIERS)]

    def __str__(self) -> str:
        out = [f"kvspec check: {self.implementation} ({self.path}), profile {self.profile}", describe(self.conventions)]
        out += [f"  {line}" for line in self.declaration]
        for tier in TIERS:
            rows = [
                [r.invariant, r.layer, r.shown, r.checks + r.checks_after_known] for r in self.rules if r.tier == tier
            ]
            out += ["", table(["invariant", "layer", "verdict", "checks"], rows, title=f"-- {tier} --")]
            for violation in self.findings_of(tier):
                out += ["", *finding_lines(violation, self.excused(violation))]
        rows = [[m.machine, m.runs, m.examples, m.steps, m.findings, m.ended] for m in self.machines]
        rows += [[title, 0, 0, 0, 0, "not started (interrupted)"] for title in self.not_started]
        out += ["", table(["machine", "runs", "examples", "steps", "findings", "ended"], rows)]
        return "\n".join(out) + "\n\n" + self.summary()

    def excused(self, violation: Violation) -> bool:
        """A caller-contract finding of an implementation that declares it trusts its caller."""
        return violation.tier == "caller contract" and self.conventions.trusts_caller

    def markdown(self) -> str:
        """A section of ``docs/engines.md``: the status and the findings first, then what held, with counts."""
        counts = Counter(r.verdict for r in self.rules)
        tally = ", ".join(f"{counts[v]} {v}" for v in (VIOLATED, HELD, NOT_REACHED, NOT_OFFERED, NOT_RUN) if counts[v])
        out = [f"## {self.implementation}", "", f"**{self.summary()}** -- rules: {tally}", ""]
        out += [
            f"`{self.path}`, profile `{self.profile}`, rule registry `{self.registry}`. {describe(self.conventions)}"
        ]
        out += ["", *(f"- {line}" for line in self.declaration)]
        for tier in TIERS:
            for violation in self.findings_of(tier):
                lines = finding_lines(violation, self.excused(violation))
                out += ["", f"- **[{violation.tier}]** {lines[0]}", *markdown_item(lines[1:])]
                out += reproduction_line(self.path, violation) if tier == "safety" else []
        for tier in TIERS:
            reached = [r for r in self.rules if r.tier == tier and r.verdict in (VIOLATED, HELD, NOT_REACHED)]
            out += ["", f"### {tier}", "", "| invariant | verdict | checks |", "|---|---|---|"]
            out += [f"| `{r.invariant}` | {r.shown} | {r.checks + r.checks_after_known:,} |" for r in reached]
            for word in (NOT_OFFERED, NOT_RUN):
                names = [f"`{r.invariant}`" for r in self.rules if r.tier == tier and r.verdict == word]
                out += ["", f"{word.capitalize()} ({len(names)}): {', '.join(names)}."] if names else []
        return "\n".join(out) + "\n"


def reproduction_line(path: str, violation: Violation) -> list[str]:
    """Where a safety finding is shown with the engine alone (``kvspec.adapters.REPRODUCED``), or that it is not."""
    script = REPRODUCED.get((path, violation.invariant))
    if script is None:
        return ["", "  not reproduced without kvspec: no script in `docs/findings/` shows it with the engine alone"]
    shown = f"[`docs/findings/{script}`](findings/{script})"
    return [
        "",
        f"  reproduced with the engine alone: {shown}; the damage as measured, the engine's source lines",
        "  and its status upstream: [`docs/findings/README.md`](findings/README.md)",
    ]


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
    out += [f"at the same step: {consequence}" for consequence in violation.consequences]
    out += [f"same root cause: {knock_on.heading} [{knock_on.tier}]" for knock_on in violation.knock_ons]
    out += ["shrunk operation sequence:", *(f"    {step}" for step in violation.steps)]
    out += [f"replay: kvspec replay {violation.replay}"] if violation.replay else []
    if violation.leads_to:
        out += [f"what it leads to (measured): {violation.leads_to}"]
        out += [f"    {step}" for step in violation.leads_to_steps]
    return out


def describe(conventions: Conventions) -> str:
    """Every convention declared, component by component: ``pool(unhashed_free_position=tail, ...)``."""

    def shown(value: object) -> str:
        if isinstance(value, tuple):
            return "/".join(map(str, value))
        return {True: "yes", False: "no"}.get(value, str(value)) if isinstance(value, bool) else str(value)

    families = [
        f"{name}({', '.join(f'{field}={shown(value)}' for field, value in attrs.asdict(family).items())})"
        for name, family in attrs.asdict(conventions, recurse=False).items()
        if attrs.has(type(family))
    ]
    return f"conventions: {'; '.join(families)}; trusts caller: {shown(conventions.trusts_caller)}"


def declaration_lines(implementation: Implementation) -> tuple[str, ...]:
    """One line per component this implementation brought: its factory, optional operations, emulations."""
    lines = []
    for kind, offer in sorted(implementation.components.items()):
        if kind in implementation.borrowed:
            continue
        operations = ", ".join(sorted(map(str, offer.operations))) or "none"
        emulated = f"; the adapter emulates {', '.join(sorted(offer.emulated))}" if offer.emulated else ""
        name = getattr(offer.factory, "__qualname__", type(offer.factory).__name__)
        lines.append(f"{kind}: {name}, optional operations offered: {operations}{emulated}")
    borrowed = ", ".join(sorted(implementation.borrowed))
    return (*lines, f"borrowed from the reference: {borrowed}") if borrowed else tuple(lines)
