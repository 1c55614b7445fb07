"""What every ``kvspec repro`` command shares: seeds, spreads over them, its runs and its JSON.

A simulated figure is a mean over ``SEEDS`` with its spread (``Spread``);
the runs behind it go to ``WORKERS`` processes (``parallel_map``).  The
verdict table each command ends with is ``kvspec.experiments.verdict_table``'s.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np

from kvspec.report import progress

SEEDS = (0, 1, 2, 3, 4)
WORKERS = 2  # the command runs on 2 cores alongside other work: more processes only queue
T = TypeVar("T")


@attrs.frozen
class Spread:
    """A figure over seeds: its mean, sample standard deviation and range."""

    mean: float
    std: float
    low: float
    high: float
    seeds: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        array = np.asarray(list(values), dtype=float)
        std = float(array.std(ddof=1)) if len(array) > 1 else 0.0
        return cls(float(array.mean()), std, float(array.min()), float(array.max()), len(array))

    def __str__(self) -> str:
        return f"{number_text(self.mean)} ± {number_text(self.std, 2)} ({number_text(self.low)}-{number_text(self.high)}, {self.seeds} seeds)"

    def percent(self) -> str:
        """The same for a share, in percent."""
        return (
            f"{100 * self.mean:.1f} % ± {100 * self.std:.1f} ({100 * self.low:.1f}-{100 * self.high:.1f},"
            f" {self.seeds} seeds)"
        )


def number_text(value: float, digits: int = 3) -> str:
    """``digits`` significant digits, but every digit of a whole number past them (8,709, not 8.71e+03)."""
    return f"{value:,.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"


def repro_arguments(name: str, doc: str, *, requests: int = 0, plot: str = "") -> argparse.ArgumentParser:
    """The options ``kvspec repro name`` shares with the others: ``--json`` and ``--seeds``, ``--requests``
    where it simulates that many by default, ``--plot`` where it draws ``plot``."""
    parser = argparse.ArgumentParser(prog=f"kvspec repro {name}", description=doc.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the same numbers as JSON")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    if requests:
        parser.add_argument("--requests", type=int, default=requests)
    if plot:
        parser.add_argument("--plot", type=Path, help=f"write {plot} here (needs matplotlib)")
    return parser


def parallel_map(
    function: Callable[..., T], jobs: Sequence[tuple[Any, ...]], label: str, workers: int = WORKERS
) -> list[T]:
    """``function(*job)`` for every job, in job order, with progress: on ``workers`` processes, or in this
    one when ``workers`` is 1 (the tests, which share what they compute)."""
    if workers == 1:
        return [function(*job) for job in progress(jobs, label)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(function, *job) for job in jobs]
        return [future.result() for future in progress(futures, label)]


def as_json(value: Any) -> Any:
    """``value`` with every attrs record (a ``Spread``, a ``Verdict``) turned into a dict, for ``--json``."""
    if attrs.has(type(value)):
        return attrs.asdict(value)
    if isinstance(value, dict):
        return {key: as_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(item) for item in value]
    return value
