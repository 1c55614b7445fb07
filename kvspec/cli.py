"""The ``kvspec`` command.

* ``kvspec check [--impl module:factory] [--profile ci] [--json | --markdown]``
  -- the conformance verdict (``kvspec.run_conformance``): one section per
  tier (safety, caller contract, convention), every invariant violated, held,
  not reached, not offered or not run, every distinct finding with its shrunk
  operation sequence.  Exit status 0 conforms, 1 violations, 2 usage or
  adapter error (one line; ``--traceback`` for the whole), 3 nothing checked;
  Ctrl-C prints the verdict of what ran, marked interrupted.
* ``kvspec replay TOKEN`` -- run once more the example a verdict printed for
  a finding (its ``replay:`` line) and print what it breaks now.
* ``kvspec engines [MODULE:FACTORY ...] [--out docs/engines.md]`` -- write
  the verdicts of several implementations (say, the adapters) as one page.
* ``kvspec repro NAME [--json]`` -- reproduce a lecture section's numbers.
* ``kvspec trace [PATH ...] [--policy ...] [--capacity ...] [--json]`` --
  replay a Mooncake-format trace through the prefix cache.
"""

from __future__ import annotations

import importlib
import sys
import traceback
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
    from kvspec.conformance import UsageError, report_progress, run_conformance
    from kvspec.properties import profiles
    from kvspec.properties.loading import REFERENCE, AdapterError, select
    from kvspec.report import Parser, emit_json

    parser = Parser(
        prog="kvspec check",
        description="Conformance verdict for an implementation.",
        epilog="exit status: 0 conforms, 1 violations found, 2 usage or adapter error, 3 nothing checked",
    )
    parser.add_argument("--impl", default=None, metavar="MODULE:FACTORY", help=f"default: $KVSPEC_IMPL or {REFERENCE}")
    parser.add_argument("--profile", default="ci", choices=profiles.PROFILES)
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the verdict as JSON")
    output.add_argument("--markdown", action="store_true", help="print the verdict as a section of docs/engines.md")
    parser.add_argument("--machine", default=None, help="run only the machines whose title contains this text")
    parser.add_argument("--traceback", action="store_true", help="on an adapter error, print the whole traceback")
    args = parser.parse_args(argv)
    try:
        path, _ = select(args.impl)
        layers = None if args.machine is None else [args.machine]
        verdict = run_conformance(path, layers=layers, profile=args.profile, progress=report_progress)
    except (AdapterError, UsageError) as error:
        return fail("kvspec check", error, args.traceback)
    if args.json:
        emit_json(verdict.to_json())
    elif args.markdown:
        print(verdict.markdown())
    else:
        print(verdict)
    return verdict.exit_status


def fail(prog: str, error: BaseException, show_traceback: bool) -> int:
    """A usage or adapter error: one line (the whole traceback on request), exit status 2."""
    if show_traceback:
        traceback.print_exception(error)
    kind = "adapter error" if type(error).__name__ == "AdapterError" else "usage"
    print(f"{prog}: {kind}: {error}", file=sys.stderr)
    return 2


def replay(argv: Sequence[str]) -> int:
    from kvspec.conformance import UsageError
    from kvspec.conformance import replay as replay_token
    from kvspec.properties.loading import AdapterError
    from kvspec.report import Parser

    parser = Parser(
        prog="kvspec replay",
        description="Run once more the example a verdict printed for a finding (its 'replay:' line).",
        epilog="exit status: 1 the finding is reproduced, 0 the example no longer fails, 2 usage or adapter error",
    )
    parser.add_argument("token", help="what follows 'kvspec replay' on the finding's 'replay:' line")
    parser.add_argument("--traceback", action="store_true", help="on an adapter error, print the whole traceback")
    args = parser.parse_args(argv)
    try:
        path, finding = replay_token(args.token)
    except (AdapterError, UsageError) as error:
        return fail("kvspec replay", error, args.traceback)
    if finding is None:
        print(f"kvspec replay: {path}: the example no longer fails")
        return 0
    name = finding.invariant.name if finding.invariant else "uncaught error"
    print(f"{name} ({finding.tier}) violated: {finding.detail}")
    print("operation sequence:", *(f"    {step}" for step in finding.steps), sep="\n")
    return 1


def engines(argv: Sequence[str]) -> int:
    from kvspec.conformance import UsageError, report_progress, run_conformance
    from kvspec.properties import profiles
    from kvspec.properties.loading import REFERENCE, AdapterError
    from kvspec.report import Parser

    parser = Parser(
        prog="kvspec engines", description="Write docs/engines.md: the verdict of each implementation named."
    )
    parser.add_argument("impls", nargs="*", metavar="MODULE:FACTORY", default=[REFERENCE])
    parser.add_argument("--profile", default="ci", choices=profiles.PROFILES)
    parser.add_argument("--out", default="docs/engines.md", help="where to write (- for standard output)")
    parser.add_argument("--traceback", action="store_true", help="on an adapter error, print the whole traceback")
    args = parser.parse_args(argv)
    sections = []
    for path in args.impls:
        try:
            sections.append(run_conformance(path, profile=args.profile, progress=report_progress).markdown())
        except (AdapterError, UsageError) as error:
            return fail("kvspec engines", error, args.traceback)
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
declaration (components, optional operations, what the adapter emulates) and
conventions, then per tier every invariant -- violated, held (with its
checks), not reached, not offered or not run -- and every distinct finding
with its shrunk operation sequence; a caller-contract finding comes with what
accepting that kind of call leads to, measured by sending it alone and
checking safety from there on.

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


USAGE = "usage: kvspec {check,replay,engines,repro,trace} ...  (kvspec COMMAND --help for each)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    from hypothesis.configuration import set_hypothesis_home_dir

    from kvspec.properties.profiles import cache_directory

    set_hypothesis_home_dir(cache_directory() / "hypothesis")  # not a .hypothesis/ in the user's directory
    try:
        return run_command(command, rest)
    except KeyboardInterrupt:
        print(f"kvspec {command}: interrupted", file=sys.stderr)
        return 130


def run_command(command: str, rest: list[str]) -> int:
    if command == "check":
        return check(rest)
    if command == "engines":
        return engines(rest)
    if command == "replay":
        return replay(rest)
    if command == "trace":
        return run_module("kvspec.experiments.trace", rest)
    if command == "repro":
        return repro(rest)
    print(f"kvspec: unknown command {command!r}; {USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
