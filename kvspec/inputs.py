"""What a kvspec command is given, checked where it enters, before the command starts its work.

Rules:

* Every argument and file a command reads is checked before anything runs or
  is written; a bad one raises ``InputError``, whose message names the input
  and says what is wrong with it, and the command line prints that one line
  and exits 2 (``kvspec.cli``).  Nothing has been changed by then.
* What is checked is what the command's code relies on, so that a value that
  passes never ends in a traceback half-way: a trace is read whole, line by
  line, as ``kvspec trace`` will read it; a number is in the range the
  simulation can run; a file to be written can be written, and a plot can be
  drawn (matplotlib installed, a format it knows).
* ``kvspec trace`` and ``kvspec repro NAME`` keep their own parsers
  (``kvspec.experiments``): their arguments are parsed here first by a parser
  of the same options, types and counts, so that what passes here parses
  there alike.  ``-h`` is left to the command's own parser.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvspec.properties.loading import UsageError
from kvspec.report import pyplot
from kvspec.spec.block_pool import POLICIES

MAX_REQUESTS = 1_000_000  # a repro run grows linearly with it: fragmentation takes ~15 min a seed at a million
TRACE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class InputError(UsageError):
    """An argument, file or value given to a command that it cannot use: one line, exit status 2."""


class HelpAsked(Exception):
    """``-h`` was given: the command's own parser prints its help."""


class DeferHelp(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS)

    def __call__(self, *args: Any) -> NoReturn:
        raise HelpAsked


class Arguments(argparse.ArgumentParser):
    """A parser whose errors are ``InputError`` (one line) and whose ``-h`` defers to the command's parser."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog=prog, add_help=False)
        self.add_argument("-h", "--help", action=DeferHelp)

    def error(self, message: str) -> NoReturn:
        raise InputError(message)

    def read(self, argv: Sequence[str]) -> argparse.Namespace | None:
        """The arguments parsed, or None when help was asked for."""
        try:
            return self.parse_args(list(argv))
        except HelpAsked:
            return None


# ---- kvspec repro NAME: each experiment's options, as its own parser declares them ----

OPTIONS: dict[str, dict[str, Any]] = {
    "--json": {"action": "store_true"},
    "--quick": {"action": "store_true"},
    "--requests": {"type": int},
    "--seeds": {"type": int, "nargs": "+"},
    "--rates": {"type": float, "nargs": "+"},
    "--multiples": {"type": float, "nargs": "+"},
    "--plot": {"type": Path},
}
REPRO_OPTIONS = {
    "paged-attention": ("--json", "--seeds"),
    "prefix-cache": ("--seeds", "--json"),
    "preemption": ("--json", "--requests", "--seeds", "--multiples"),
    "fragmentation": ("--json", "--requests", "--seeds", "--plot"),
    "serving": ("--json", "--requests", "--seeds", "--rates", "--plot"),
    "mooncake": ("--json", "--plot", "--seeds", "--quick"),
}


def repro_parser(name: str) -> Arguments:
    """The options of ``kvspec repro NAME``, as its experiment's parser declares them."""
    parser = Arguments(f"kvspec repro {name}")
    for option in REPRO_OPTIONS[name]:
        parser.add_argument(option, **OPTIONS[option])
    return parser


def check_repro(name: str, argv: Sequence[str]) -> None:
    """Raise ``InputError`` for an argument of ``kvspec repro NAME`` that its experiment cannot run with."""
    args = repro_parser(name).read(argv)
    if args is None:
        return
    requests = getattr(args, "requests", None)
    if requests is not None and not 1 <= requests <= MAX_REQUESTS:
        raise InputError(f"--requests {requests}: give 1 to {MAX_REQUESTS:,}")
    negative = [seed for seed in getattr(args, "seeds", None) or () if seed < 0]
    if negative:
        raise InputError(f"--seeds {negative[0]}: a seed is a non-negative integer")
    for option in ("rates", "multiples"):
        bad = [value for value in getattr(args, option, None) or () if not (math.isfinite(value) and value > 0)]
        if bad:
            raise InputError(f"--{option} {bad[0]}: a rate is a positive finite number")
    if getattr(args, "plot", None) is not None:
        check_plot_file(args.plot)


# ---- kvspec trace ----


def trace_parser() -> Arguments:
    """The options of ``kvspec trace``, as ``kvspec.experiments.trace`` declares them."""
    parser = Arguments("kvspec trace")
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--policy", choices=POLICIES, action="append")
    parser.add_argument("--capacity", type=int, action="append")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--json", action="store_true")
    return parser


def check_trace_arguments(argv: Sequence[str]) -> None:
    """Raise ``InputError`` for an argument of ``kvspec trace`` (``kvspec.experiments.trace``) it cannot run
    with: every trace file is read and checked whole, and every capacity against the traces."""
    from kvspec.experiments import trace

    args = trace_parser().read(argv)
    if args is None:
        return
    if args.plot is not None:
        check_plot_file(args.plot)
    largest = max(distinct_blocks(trace.SHIPPED.get(path, Path(path))) for path in args.paths or trace.SHIPPED)
    for capacity in args.capacity or ():
        if capacity < 1:
            raise InputError(f"--capacity {capacity}: a pool holds at least one block")
        if capacity > largest:
            raise InputError(
                f"--capacity {capacity}: more than the {largest:,} distinct blocks of the traces given "
                "(a pool that large never evicts: its hit rate is the unbounded one, in the default sweep)"
            )


def distinct_blocks(path: Path) -> int:
    """Read a Mooncake-format trace as ``kvspec.experiments.trace.load`` does (JSON lines, gzipped when the
    name ends in .gz) and check every request; its distinct blocks.  ``InputError`` names the file, the line
    and what is wrong."""
    opener: Callable[..., Any] = gzip.open if str(path).endswith(".gz") else open
    requests = 0
    distinct: set[int] = set()
    try:
        with opener(path, "rt") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    distinct.update(request_blocks(path, number, line))
                    requests += 1
    except OSError as error:  # missing, a directory, unreadable, not gzip
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
    except (EOFError, zlib.error) as error:
        raise InputError(f"{path}: a damaged or truncated gzip file ({error})") from None
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not text: bytes that are not {error.encoding}") from None
    if not requests:
        raise InputError(f"{path}: no requests (an empty trace)")
    if not distinct:
        raise InputError(f"{path}: no blocks (every request's hash_ids is empty)")
    return len(distinct)


def request_blocks(path: Path, number: int, line: str) -> list[int]:
    """One trace line checked as a request; its blocks' hashes."""
    where = f"{path}: line {number}"
    try:
        request = json.loads(line)
    except ValueError as error:
        raise InputError(f"{where}: not JSON ({getattr(error, 'msg', error)})") from None
    except RecursionError:
        raise InputError(f"{where}: not JSON kvspec can read (nested too deeply)") from None
    if not isinstance(request, dict):
        raise InputError(f"{where}: a request is a JSON object, not {json_kind(request)}")
    missing = [key for key in TRACE_KEYS if key not in request]
    if missing:
        has = ", ".join(map(shown, request)) or "nothing"
        raise InputError(f"{where}: missing {', '.join(missing)} (it has {has})")
    timestamp = request["timestamp"]
    if not (is_number(timestamp) and math.isfinite(timestamp)):
        raise InputError(f"{where}: timestamp is {shown(timestamp)}, not a number of milliseconds")
    for key in ("input_length", "output_length"):
        if not (is_integer(request[key]) and request[key] >= 0):
            raise InputError(f"{where}: {key} is {shown(request[key])}, not a count of tokens")
    hash_ids = request["hash_ids"]
    if not isinstance(hash_ids, list):
        raise InputError(f"{where}: hash_ids is {shown(hash_ids)}, not a list of block hashes")
    for hash_id in hash_ids:
        if not is_integer(hash_id):
            raise InputError(f"{where}: hash_ids holds {shown(hash_id)}, not an integer block hash")
    return hash_ids


def json_kind(value: object) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def shown(value: object) -> str:
    """A JSON value as a message shows it: one line, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---- files a command writes ----


def check_output_file(path: Path, option: str) -> None:
    """Raise ``InputError`` unless ``path`` can be written (created or replaced); nothing is written now."""
    named = f"{option} {path}"
    if path.is_dir():
        raise InputError(f"{named}: is a directory")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise InputError(f"{named}: not writable")
        return
    parent = path.parent
    if not parent.is_dir():
        raise InputError(f"{named}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{named}: directory {parent} is not writable")


def check_plot_file(path: Path) -> None:
    """A plot can be drawn into ``path``: matplotlib is installed, knows the format, and the file can be written."""
    plt = pyplot()
    if plt is None:
        raise InputError(f"--plot {path}: matplotlib is not installed (pip install 'kvspec[plots]')")
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = path.suffix.lstrip(".").lower()
    if suffix and suffix not in formats:
        raise InputError(f"--plot {path}: matplotlib writes {', '.join(sorted(formats))}, not {suffix}")
    check_output_file(path, "--plot")
