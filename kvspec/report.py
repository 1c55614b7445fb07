"""Printing for the command line: aligned tables, ``--json`` output, progress on stderr, plots."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: message``) and exit 2, as every kvspec command's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e-3 and value != 0 else f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> str:
    """An aligned text table: text columns left-aligned, numbers right-aligned."""
    raw = [list(row) for row in rows]
    cells = [[format_cell(v) for v in row] for row in raw]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [
        all(isinstance(r[i], int | float) and not isinstance(r[i], bool) for r in raw) for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(s.rstrip() for s in out)


def pyplot() -> Any | None:
    """matplotlib's pyplot drawing to files (the ``plots`` extra), or None when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def emit_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def progress(items: Sequence[T], label: str) -> Iterator[T]:
    """Yield items while showing progress on stderr.

    On a terminal with the ``progress`` extra installed, a tqdm bar; elsewhere (CI, a log
    file, a pipe) one plain line per tenth of the work, never carriage returns.
    """
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            yield from tqdm(items, desc=label, file=sys.stderr, leave=False)
            return
    total = len(items)
    reported = 0
    for i, item in enumerate(items, 1):
        yield item
        if 10 * i // total > reported or i == total:
            reported = 10 * i // total
            print(f"{label}: {i}/{total}", file=sys.stderr, flush=True)
