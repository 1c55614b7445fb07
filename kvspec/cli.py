"""The ``kvspec`` command.

* ``kvspec check [--impl module:factory] [--profile ci] [--json | --markdown]``
  -- the conformance verdict (``kvspec.run_conformance``): one section per
  tier (safety, caller contract, convention), every invariant violated, held
  or not reached, every distinct finding with its shrunk operation sequence;
  exit status 1 if any finding counts against the implementation.
* ``kvspec engines [MODULE:FACTORY ...] [--out docs/engines.md]`` -- write
  the verdicts of several implementations (say, the adapters) as one page.
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
    "fragmentation": "kvspec.experiments.fragmentation",
    "serving": "kvspec.experiments.serving",
    "mooncake": "kvspec.experiments.mooncake",
}


def check(argv: Sequence[str]) -> int:
    from kvspec.conformance import report_progress, run_conformance
    from kvspec.properties import harness, profiles, suite
    from kvspec.report import emit_json

    parser = argparse.ArgumentParser(prog="kvspec check", description="Conformance verdict for an implementation.")
    parser.add_argument(
        "--impl", default=None, metavar="MODULE:FACTORY", help="default: $KVSPEC_IMPL or impl:reference"
    )
    parser.add_argument("--profile", default="ci", choices=profiles.PROFILES)
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the verdict as JSON")
    output.add_argument("--markdown", action="store_true", help="print the verdict as a section of docs/engines.md")
    parser.add_argument("--machine", default="", help="run only the machines whose title contains this text")
    args = parser.parse_args(argv)
    if not any(args.machine in title for title, _ in suite.MACHINES):
        print(f"kvspec check: no machine matches {args.machine!r}", file=sys.stderr)
        return 2
    try:
        path, _ = harness.select(args.impl)
    except harness.BadImplementation as error:
        print(f"kvspec check: --impl: {error}", file=sys.stderr)
        return 2
    verdict = run_conformance(path, layers=[args.machine], profile=args.profile, progress=report_progress)
    if args.json:
        emit_json(verdict.to_json())
    elif args.markdown:
        print(verdict.markdown())
    else:
        print(verdict)
    return 0 if verdict.conforms else 1


def engines(argv: Sequence[str]) -> int:
    from kvspec.conformance import report_progress, run_conformance
    from kvspec.properties import harness, profiles

    parser = argparse.ArgumentParser(
        prog="kvspec engines", description="Write docs/engines.md: the verdict of each implementation named."
    )
    parser.add_argument("impls", nargs="*", metavar="MODULE:FACTORY", default=[harness.REFERENCE])
    parser.add_argument("--profile", default="ci", choices=profiles.PROFILES)
    parser.add_argument("--out", default="docs/engines.md", help="where to write (- for standard output)")
    args = parser.parse_args(argv)
    sections = []
    for path in args.impls:
        try:
            sections.append(run_conformance(path, profile=args.profile, progress=report_progress).markdown())
        except harness.BadImplementation as error:
            print(f"kvspec engines: {path}: {error}", file=sys.stderr)
            return 2
    document = ENGINES_HEADER + "\n".join(sections)
    if args.out == "-":
        print(document)
    else:
        with open(args.out, "w", encoding="utf-8") as out:
            out.write(document)
    return 0


ENGINES_HEADER = """# Engines under kvspec

Written by `kvspec engines MODULE:FACTORY ...`; do not edit by hand.  Each
section is one implementation's verdict (`kvspec check --markdown`): its
declared conventions, then per tier every invariant -- violated, held, or
not reached -- and every distinct finding with its shrunk operation sequence
and, for a caller-contract finding, one line on what it means in production
(the adapter's `IN_PRODUCTION`).

"""


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
    usage = "usage: kvspec {check,engines,repro,trace} ...  (kvspec COMMAND --help for each)"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + usage)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "check":
        return check(rest)
    if command == "engines":
        return engines(rest)
    if command == "trace":
        return run_module("kvspec.experiments.trace", rest)
    if command == "repro":
        return repro(rest)
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
