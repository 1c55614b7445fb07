"""The ``kvspec`` command.

* ``kvspec check [--impl module:factory] [--profile ci] [--json]`` -- run every
  conformance machine against an implementation; one row per invariant;
  exit status 1 if any is violated, with the shrunk operation sequence.
* ``kvspec repro NAME [--json]`` -- reproduce a lecture section's numbers.
* ``kvspec trace [PATH ...] [--policy ...] [--capacity ...] [--json]`` --
  replay a Mooncake-format trace through the prefix cache.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

REPRO = {
    "paged-attention": "kvspec.experiments.paged_attention",
    "prefix-cache": "kvspec.experiments.prefix_cache",
    "preemption": "kvspec.experiments.preemption",
}


def check(argv: Sequence[str]) -> int:
    from hypothesis import settings

    from kvspec.experiments.report import emit_json, table
    from kvspec.properties import harness, profiles, suite
    from kvspec.spec.invariants import REGISTRY

    parser = argparse.ArgumentParser(prog="kvspec check", description="Conformance verdict for an implementation.")
    parser.add_argument(
        "--impl", default=None, metavar="MODULE:FACTORY", help="default: $KVSPEC_IMPL or impl:reference"
    )
    parser.add_argument("--profile", default="ci", choices=profiles.PROFILES)
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.add_argument("--machine", default="", help="run only the machines whose name contains this text")
    args = parser.parse_args(argv)
    chosen = [(layer, path) for layer, path in suite.MACHINES if args.machine in layer]
    if not chosen:
        print(f"kvspec check: no machine matches {args.machine!r}", file=sys.stderr)
        return 2
    try:
        path, implementation = harness.select(args.impl)
    except harness.BadImplementation as error:
        print(f"kvspec check: --impl: {error}", file=sys.stderr)
        return 2
    settings.load_profile(args.profile)
    outcomes = []
    for i, (layer, machine_path) in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {layer} ...", file=sys.stderr, flush=True)
        outcomes.append((layer, harness.run_machine(suite.load_machine(machine_path), implementation, settings())))
    rows = []
    for name, rule in sorted(REGISTRY.items(), key=lambda item: item[1].layer):
        checks = sum(outcome.checks.get(name, 0) for _, outcome in outcomes)
        violated = [layer for layer, outcome in outcomes if outcome.invariant == name]
        verdict = "VIOLATED" if violated else ("held" if checks else "not exercised")
        rows.append({"invariant": name, "layer": rule.layer, "verdict": verdict, "checks": checks})
    machines = [
        {"machine": layer, "verdict": "held" if o.held else "VIOLATED", "runs": o.runs, "steps": o.steps_explored}
        for layer, o in outcomes
    ]
    failures = [
        {"machine": layer, "invariant": o.invariant, "detail": o.detail, "steps": list(o.steps)}
        for layer, o in outcomes
        if not o.held
    ]
    if args.json:
        emit_json(
            {
                "implementation": implementation.name,
                "path": path,
                "profile": args.profile,
                "invariants": rows,
                "machines": machines,
                "violations": failures,
            }
        )
    else:
        print(f"kvspec check: {implementation.name} ({path}), profile {args.profile}\n")
        print(table(["invariant", "layer", "verdict", "checks"], [list(r.values()) for r in rows]))
        print()
        print(table(["machine", "verdict", "runs", "steps explored"], [list(m.values()) for m in machines]))
        for failure in failures:
            print(f"\n{failure['machine']}: {failure['invariant']} violated: {failure['detail']}")
            print("shrunk operation sequence:")
            for step in failure["steps"]:
                print(f"    {step}")
        print(
            f"\n{'VIOLATED' if failures else 'CONFORMS'}: {len(failures)} of {len(outcomes)} machines found a violation"
        )
    return 1 if failures else 0


def run_module(module_name: str, argv: Sequence[str]) -> int:
    status: int = importlib.import_module(module_name).main(list(argv))
    return status


def repro(argv: Sequence[str]) -> int:
    usage = f"usage: kvspec repro {{{','.join(REPRO)}}} [--json] [--help]"
    if argv and argv[0] in REPRO:
        return run_module(REPRO[argv[0]], argv[1:])
    asked = bool(argv) and argv[0] in ("-h", "--help")
    print(usage, file=sys.stdout if asked else sys.stderr)
    if asked:
        for name, module_name in REPRO.items():
            summary = (importlib.import_module(module_name).__doc__ or "").strip().splitlines()[0]
            print(f"  {name:<16} {summary}")
    return 0 if asked else 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: kvspec {check,repro,trace} ...  (kvspec COMMAND --help for each)"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + usage)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "check":
        return check(rest)
    if command == "trace":
        return run_module("kvspec.experiments.trace", rest)
    if command == "repro":
        return repro(rest)
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
