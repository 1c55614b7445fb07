"""The verdict table every ``kvspec repro`` command ends with: a published figure against kvspec's.

A row gives the figure, its source, the published value, kvspec's, the
tolerance the tests assert and whether it holds; where it does not, the
reason is printed under the table, so that the command printing a figure also
prints why it deviates.  A kvspec value that an input was tuned to
(``fitted``), or that is computed from such values or from the published
figures themselves (``derived``), says so with a ``Fit``: its row is printed
with what it was fitted to, and the summary line under the table never counts
it as reproduced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from kvspec.experiments.figures import Spread, number_text
from kvspec.report import table

STATUSES = ("reproduced", "fitted", "derived", "not reproduced")


@attrs.frozen
class Fit:
    """How a kvspec value came to land on a published figure: ``fitted`` (an input was tuned until it does) or
    ``derived`` (it is computed from fitted values, or from the published figures themselves); ``to`` says which
    input, and to what."""

    kind: Literal["fitted", "derived"]
    to: str


@attrs.frozen
class Verdict:
    """One published figure against kvspec's; ``reason`` says why it deviates (printed when it does), ``fit``
    what made kvspec's value land on it, if anything did; ``status`` is what the summary line counts."""

    claim: str
    source: str
    published: str
    measured: str
    tolerance: str
    holds: bool
    reason: str = ""
    fit: Fit | None = None
    status: str = attrs.field(init=False)

    @status.default
    def _status(self) -> str:
        if self.fit is not None:
            return self.fit.kind
        return "reproduced" if self.holds else "not reproduced"


def within(measured: float, published: float, tolerance: float) -> bool:
    """A relative tolerance: ``measured`` within ``tolerance`` (0.2: +-20 %) of ``published``."""
    return abs(measured / published - 1) <= tolerance


@attrs.frozen
class Comparison:
    """Figures of one source, the published and kvspec's keyed alike, held to one relative tolerance (of the
    mean, for a figure over seeds): ``row`` makes one's verdict."""

    source: str
    published: Mapping[str, float]
    measured: Mapping[str, Any]  # a Spread, or a float
    tolerance: float
    unit: str = ""  # after the published value, where no text is given for it

    def row(
        self,
        claim: str,
        name: str,
        published_text: str = "",
        measured_text: str = "",
        *,
        percent: bool = False,
        reason: str = "",
        fit: Fit | None = None,
    ) -> Verdict:
        """The texts default to the published value and the measured one as a ``Spread`` prints it (in percent
        with ``percent``)."""
        published, measured = self.published[name], self.measured[name]
        if isinstance(measured, Spread):
            value, shown, over = measured.mean, measured.percent() if percent else str(measured), " (mean)"
        else:
            value, shown, over = measured, f"{measured:.1%}" if percent else number_text(measured), ""
        return Verdict(
            claim,
            self.source,
            published_text or f"{published:g}{self.unit}",
            measured_text or shown,
            f"+-{self.tolerance:.0%}{over}",
            within(value, published, self.tolerance),
            reason,
            fit,
        )


def tally(verdicts: Sequence[Verdict]) -> dict[str, int]:
    """How many rows there are of each status; a fitted or derived row is never counted as reproduced."""
    return {"rows": len(verdicts), **{status: sum(v.status == status for v in verdicts) for status in STATUSES}}


def summary_line(verdicts: Sequence[Verdict]) -> str:
    counts = tally(verdicts)
    return (
        f"{counts['reproduced']} of {counts['rows']} figures reproduced; {counts['fitted']} fitted and"
        f" {counts['derived']} derived (not counted: kvspec's value was made to land there);"
        f" {counts['not reproduced']} not reproduced (each with its reason)"
    )


def verdict_results(verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """What ``--json`` gives of the verdict table: its rows (each with its status) and the summary's counts."""
    return {"verdicts": list(verdicts), "summary": tally(verdicts)}


def print_verdicts(verdicts: Sequence[Verdict], title: str) -> None:
    print()
    print(
        table(
            ["figure", "source", "published", "kvspec", "tolerance", "holds"],
            [[v.claim, v.source, v.published, _marked(v), v.tolerance, "yes" if v.holds else "NO"] for v in verdicts],
            title=title,
        )
    )
    for v in verdicts:
        because = [f"{v.fit.kind}: {v.fit.to}"] if v.fit else []
        if v.reason:
            because.append(v.reason)
        if because:
            print(f"  {v.claim}: {'  '.join(because)}")
    print(summary_line(verdicts))


def _marked(verdict: Verdict) -> str:
    return f"{verdict.measured} ({verdict.fit.kind})" if verdict.fit else verdict.measured
