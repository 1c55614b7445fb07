"""The exploration score: what each conformance machine reaches, so a hole shows before a bug falls through it.

``python -m bench.bench_exploration [--profile ci] [--machine TEXT] [--json]`` runs every machine of
``kvspec.properties.suite`` against the reference under the profile, and prints per machine the
examples run, the steps explored, the distinct operations called, and the share of examples in which
each mechanism occurred.  A mechanism is a pattern over the events the machines record with
``hypothesis.event`` (``MECHANISMS``; the harness's "... rejected" events and Hypothesis's own are not mechanisms); a dash
means the machine never records it (not "0 %").  ``TARGETS`` names, per mechanism a known bug needs, the
machines that must reach it in ``TARGET_SHARE`` of their examples; a second table shows each target's share.
It prints shares and never asserts them: the score is read, and kept, by people.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.properties import loading, profiles, running, suite
from kvspec.report import emit_json, progress, table

MECHANISMS: dict[str, str] = {
    "hit": r"^(?!no ).*\bhit\b",
    "CoW": r"^copy-on-write happened",
    "preemption": r"^preempted",
    "retry": r"retried",
    "recycle": r"recycled",
    "re-admit": r"re-admitted",
    "replay": r"replayed",
    "eviction": r"evict|demoted",
    "fault": r"fault",
    "refuse-change-retry": r"after its cached blocks changed",
    "2 passed over": r"passed over 2\+ requests not ready",
    "grant taken": r"grant taken from a victim",
    "mid-tier swap-in": r"^partial swap-in mid tier block",
}
TARGET_SHARE = 0.3
TARGETS: dict[str, tuple[str, ...]] = {
    # the shapes the bugs of issue 22 need: a share of examples under the ci profile, in each machine named
    "refuse-change-retry": ("prefix cache", "prefix cache (deferred commit)", "scheduler over the prefix cache"),
    "2 passed over": ("scheduler over the prefix cache", "scheduler (priority)"),
    "grant taken": ("scheduler (priority)",),
    "mid-tier swap-in": ("tiered swap (partial swap-in)",),
}
NOT_MECHANISMS = re.compile(r" out of contract, rejected$| rejected with |^(Retried draw|Draw for|gave up)")


def score(declaration: running.ConformanceTest, base: Settings) -> dict[str, object]:
    """Run one machine against the reference, as the suite declares it; its row of the score."""
    title = declaration.title
    bound = declaration.machine.bind(loading.load_implementation(loading.REFERENCE))
    run_state_machine_as_test(bound, settings=declaration.settings(base))
    examples = [{text for text in events if not NOT_MECHANISMS.search(text)} for events in bound.statistics.reached]
    shares: dict[str, float | None] = {}
    for mechanism, pattern in MECHANISMS.items():
        reached = [any(re.search(pattern, text) for text in events) for events in examples]
        recorded = any(re.search(pattern, text) for events in examples for text in events)
        shares[mechanism] = sum(reached) / len(examples) if recorded else None
    return {
        "machine": title,
        "examples": len(examples),
        "steps": bound.statistics.steps,
        "operations": len(bound.statistics.operations),
        "shares": shares,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_exploration", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci", choices=profiles.PROFILES)
    parser.add_argument("--machine", default="", help="only the machines whose title contains this text")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    base = Settings.get_profile(args.profile)
    reference = loading.load_implementation(loading.REFERENCE)
    chosen = [
        d
        for d in suite.declarations()
        if args.machine in d.title and not d.machine.not_offered(reference)  # the reference's own
    ]
    rows = [score(declaration, base) for declaration in progress(chosen, "machines")]
    if args.json:
        emit_json({"profile": args.profile, "machines": rows, "targets": target_rows(rows)})
        return 0
    header = ["machine", "examples", "steps", "ops", *MECHANISMS]
    body = [
        [
            row["machine"],
            row["examples"],
            row["steps"],
            row["operations"],
            *("-" if share is None else f"{share:.0%}" for share in row["shares"].values()),  # type: ignore[attr-defined]
        ]
        for row in rows
    ]
    print(table(header, body, title=f"exploration score, profile {args.profile}: share of examples per mechanism"))
    targets = target_rows(rows)
    if targets:
        title = f"\ntargets: share of examples, {TARGET_SHARE:.0%} or more wanted"
        print(table(["mechanism", "machine", "share", ""], targets, title=title))
    return 0


def target_rows(rows: list[dict[str, object]]) -> list[list[str]]:
    """(mechanism, machine, share, verdict) for each target among the machines scored."""
    shares = {row["machine"]: row["shares"] for row in rows}
    found = []
    for mechanism, machines in TARGETS.items():
        for machine in machines:
            if machine in shares:
                share = shares[machine][mechanism] or 0.0  # type: ignore[index]
                found.append([mechanism, machine, f"{share:.0%}", "met" if share >= TARGET_SHARE else "BELOW"])
    return found


if __name__ == "__main__":
    sys.exit(main())
