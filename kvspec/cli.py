"""The ``kvspec`` command.

* ``kvspec check [--impl module:factory] [--profile ci] [--json | --markdown]``
  -- the conformance verdict (``kvspec.run_conformance``): one section per
  tier (safety, caller contract, convention), every invariant violated, held,
  not reached, not offered or not run, every distinct finding with its shrunk
  operation sequence.  Exit status 0 conforms, 1 violations, 2 usage or
  adapter error (one line; ``--traceback`` for the whole), 3 nothing checked,
  130 interrupted (Ctrl-C before any finding: the rules checked so far, no
  verdict; after one, VIOLATED and 1 as ever).
* ``kvspec replay TOKEN`` -- run once more the example a verdict printed for
  a finding (its ``replay:`` line) and print what it breaks now.
* ``kvspec engines [MODULE:FACTORY ...] [--out docs/engines.md]`` -- write
  the verdicts of several implementations (say, the adapters) as one page.
* ``kvspec repro NAME [--json]`` -- reproduce a lecture section's numbers.
* ``kvspec trace [PATH ...] [--policy ...] [--capacity ...] [--json]`` --
  replay a Mooncake-format trace through the prefix cache.

Every command checks what it is given before it starts (``kvspec.inputs``):
a bad argument, file or environment variable is one line on stderr naming
it, exit status 2, nothing written.  stdout carries the command's output
only (``--json``: one JSON document); progress, Hypothesis's messages and
whatever the implementation prints go to stderr.  Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

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
    from kvspec.report import emit_json

    parser = command_parser(
        "check",
        "Conformance verdict for an implementation.",
        "0 conforms, 1 violations found, 2 usage or adapter error, 3 nothing checked, 130 interrupted before any "
        "finding",
    )
    parser.add_argument("--impl", default=None, metavar="MODULE:FACTORY", help=f"default: $KVSPEC_IMPL or {REFERENCE}")
    parser.add_argument("--profile", default="ci", choices=profiles.PROFILES)
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the verdict as JSON")
    output.add_argument("--markdown", action="store_true", help="print the verdict as a section of docs/engines.md")
    parser.add_argument("--machine", default=None, help="run only the machines whose title contains this text")
    add_jobs(parser)
    add_traceback(parser)
    args = parser.parse_args(argv)
    try:
        if args.machine is not None and not args.machine.strip():
            raise UsageError("--machine is empty: give a word of a machine's title")
        profiles.check_example_database(args.profile)
        with contextlib.redirect_stdout(sys.stderr):  # what the adapter prints while it loads
            path, _ = select(args.impl)
        titled = None if args.machine is None else [args.machine]
        verdict = run_conformance(path, titled=titled, profile=args.profile, progress=report_progress, jobs=args.jobs)
    except (AdapterError, UsageError) as error:
        return fail(parser.prog, error, args.traceback)
    if args.json:
        emit_json(verdict.to_json())
    elif args.markdown:
        print(verdict.markdown())
    else:
        print(verdict)
    return verdict.exit_status


ERROR_KINDS = {"AdapterError": "adapter error", "InputError": "bad input"}  # else a UsageError: "usage"


def command_parser(command: str, description: str, exit_statuses: str) -> argparse.ArgumentParser:
    """The parser of ``kvspec command``, its errors one line, its epilog the exit statuses it answers."""
    from kvspec.report import Parser

    return Parser(prog=f"kvspec {command}", description=description, epilog=f"exit status: {exit_statuses}")


def add_traceback(parser: argparse.ArgumentParser) -> None:
    """``--traceback``: a command that loads an adapter prints an adapter error's whole traceback on request."""
    parser.add_argument("--traceback", action="store_true", help="on an adapter error, print the whole traceback")


def add_jobs(parser: argparse.ArgumentParser) -> None:
    """``--jobs N``: the worker processes a verdict's machines are judged in (``kvspec.workers``)."""

    def workers(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of worker processes")
        return int(text)

    cores = os.cpu_count() or 1
    parser.add_argument("--jobs", type=workers, default=cores, metavar="N", help=f"worker processes (default: {cores})")


def fail(prog: str, error: BaseException, show_traceback: bool = False) -> int:
    """A usage, input or adapter error: one line (the whole traceback on request), exit status 2."""
    if show_traceback:
        traceback.print_exception(error)
    kind = ERROR_KINDS.get(type(error).__name__, "usage")
    one_line = " ".join(str(error).split())  # an adapter's message may hold line breaks
    print(f"{prog}: {kind}: {one_line}", file=sys.stderr)
    return 2


def replay(argv: Sequence[str]) -> int:
    from kvspec.conformance import UsageError
    from kvspec.conformance import replay as replay_token
    from kvspec.properties.loading import AdapterError

    parser = command_parser(
        "replay",
        "Run once more the example a verdict printed for a finding (its 'replay:' line).",
        "1 the finding is reproduced, 0 the example no longer fails, 2 usage or adapter error (a damaged token, one "
        "printed under another Hypothesis), 130 interrupted",
    )
    parser.add_argument("token", help="what follows 'kvspec replay' on the finding's 'replay:' line")
    add_traceback(parser)
    args = parser.parse_args(argv)
    try:
        path, finding = replay_token(args.token)
    except (AdapterError, UsageError) as error:
        return fail(parser.prog, error, args.traceback)
    if finding is None:
        print(f"kvspec replay: {path}: the example no longer fails")
        return 0
    name = finding.invariant.name if finding.invariant else "uncaught error"
    print(f"{name} ({finding.tier}) violated: {finding.detail}")
    print("operation sequence:", *(f"    {step}" for step in finding.steps), sep="\n")
    return 1


def engines(argv: Sequence[str]) -> int:
    from kvspec.adapters import PUBLISHED
    from kvspec.conformance import UsageError, report_progress, run_conformance
    from kvspec.inputs import check_output_file
    from kvspec.properties import profiles
    from kvspec.properties.loading import AdapterError, select

    parser = command_parser(
        "engines",
        "Write docs/engines.md: the verdict of each implementation named (default: every published adapter).",
        "0 written, 2 usage or adapter error (nothing written), 130 interrupted (nothing written)",
    )
    parser.add_argument("impls", nargs="*", metavar="MODULE:FACTORY", help="default: every published adapter")
    parser.add_argument("--profile", default="ci", choices=profiles.PROFILES)
    parser.add_argument("--out", default="docs/engines.md", help="where to write (- for standard output)")
    add_jobs(parser)
    add_traceback(parser)
    args = parser.parse_args(argv)
    args.impls = args.impls or list(PUBLISHED)
    sections = []
    try:
        profiles.check_example_database(args.profile)
        if args.out != "-":
            check_output_file(Path(args.out), "--out")
        with contextlib.redirect_stdout(sys.stderr):
            for path in args.impls:  # every one loads before the first verdict's minutes are spent
                select(path)
        for path in args.impls:
            verdict = run_conformance(path, profile=args.profile, progress=report_progress, jobs=args.jobs)
            if verdict.interrupted:
                print(f"kvspec engines: interrupted in {path}; {args.out} left as it was", file=sys.stderr)
                return 130
            sections.append(verdict.markdown())
    except (AdapterError, UsageError) as error:
        return fail(parser.prog, error, args.traceback)
    document = engines_page(sections)
    if args.out == "-":
        print(document)
        return 0
    try:
        Path(args.out).write_text(document, encoding="utf-8")
    except OSError as error:  # checked writable at the start; a full disk or a removed directory since
        print(f"kvspec engines: cannot write --out {args.out}: {error.strerror or error}", file=sys.stderr)
        return 2
    return 0


ENGINES_HEADER = """# Engines under kvspec

Written by `kvspec engines` (every adapter of `kvspec.adapters.PUBLISHED`); do
not edit by hand.  Each section is one implementation's verdict (`kvspec
check --markdown`): its status, the rule registry it was judged under, its
conventions and what it brought; then every finding, each with its shrunk
operation sequence and its `kvspec replay` token -- a caller-contract finding
with what accepting that kind of call leads to, measured by sending it alone
and checking safety from there on; a safety finding with the script that shows
it with the engine alone -- then per tier every rule reached, with its checks,
and those not offered in one line.

"""


def engines_page(sections: Sequence[str]) -> str:
    """``docs/engines.md``: the header, the adapters withheld and why, then each section."""
    from kvspec.adapters import WITHHELD

    withheld = "".join(f"* Withheld: `{path}` -- {why}.\n" for path, why in WITHHELD.items())
    return ENGINES_HEADER + (withheld + "\n" if withheld else "") + "\n".join(sections)


def run_module(module_name: str, argv: Sequence[str]) -> int:
    status: int = importlib.import_module(module_name).main(list(argv))
    return status


def repro(argv: Sequence[str]) -> int:
    from kvspec.inputs import InputError, check_repro

    usage = f"usage: kvspec repro {{{','.join(REPRO)}}} [--json] [--help]"
    if argv and argv[0] in REPRO:
        try:
            check_repro(argv[0], argv[1:])
        except InputError as error:
            return fail(f"kvspec repro {argv[0]}", error)
        return run_module(REPRO[argv[0]], argv[1:])
    asked = bool(argv) and argv[0] in ("-h", "--help")
    if not asked:
        named = f"unknown experiment {argv[0]!r}" if argv else "name an experiment"
        print(f"kvspec repro: {named}; {usage}", file=sys.stderr)
        return 2
    print(usage)
    for name, module_name in REPRO.items():
        summary = (importlib.import_module(module_name).__doc__ or "").strip().splitlines()[0]
        print(f"  {name:<16} {summary}")
    return 0


def trace(argv: Sequence[str]) -> int:
    from kvspec.inputs import InputError, check_trace_arguments

    try:
        check_trace_arguments(argv)
    except InputError as error:
        return fail("kvspec trace", error)
    return run_module("kvspec.experiments.trace", argv)


COMMANDS = {"check": check, "replay": replay, "engines": engines, "repro": repro, "trace": trace}


USAGE = "usage: kvspec {check,replay,engines,repro,trace} ...  (kvspec COMMAND --help for each)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"kvspec: unknown command {command!r}; {USAGE}", file=sys.stderr)
        return 2
    from kvspec.properties.profiles import hypothesis_files_in_cache

    try:
        with hypothesis_files_in_cache():  # not a .hypothesis/ in the user's directory
            return COMMANDS[command](rest)
    except KeyboardInterrupt:
        print(f"kvspec {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
