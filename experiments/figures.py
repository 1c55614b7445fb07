"""What every ``kvspec repro`` command shares: seeds, spreads over them, and its verdict table.

A simulated figure is a mean over ``SEEDS`` with its spread (``Spread``); a
verdict row puts a published figure beside kvspec's, with the tolerance the
tests assert and, where it does not hold, the reason -- so that the command
printing a figure also prints why it deviates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import attrs
import numpy as np

from kvspec.report import progress, table

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
        return f"{_number(self.mean)} ± {_number(self.std, 2)} ({_number(self.low)}-{_number(self.high)}, {self.seeds} seeds)"

    def percent(self) -> str:
        """The same for a share, in percent."""
        return (
            f"{100 * self.mean:.1f} % ± {100 * self.std:.1f} ({100 * self.low:.1f}-{100 * self.high:.1f},"
            f" {self.seeds} seeds)"
        )


def _number(value: float, digits: int = 3) -> str:
    """``digits`` significant digits, but every digit of a whole number past them (8,709, not 8.71e+03)."""
    return f"{value:,.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"


def within(measured: float, published: float, tolerance: float) -> bool:
    """A relative tolerance: ``measured`` within ``tolerance`` (0.2: +-20 %) of ``published``."""
    return abs(measured / published - 1) <= tolerance


@attrs.frozen
class Verdict:
    """One published figure against kvspec's; ``reason`` says why it deviates (printed when it does)."""

    claim: str
    source: str
    published: str
    measured: str
    tolerance: str
    holds: bool
    reason: str = ""


def print_verdicts(verdicts: Sequence[Verdict], title: str) -> None:
    print()
    print(
        table(
            ["figure", "source", "published", "kvspec", "tolerance", "holds"],
            [[v.claim, v.source, v.published, v.measured, v.tolerance, "yes" if v.holds else "NO"] for v in verdicts],
            title=title,
        )
    )
    for v in verdicts:
        if v.reason:
            print(f"  {v.claim}: {v.reason}")


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
