"""The verdict table's rules (``experiments/verdict_table.py``): a relative tolerance fails outside it, and a row
whose value was fitted or derived is printed as such and never counted as reproduced, in the table and in JSON."""

from __future__ import annotations

import pytest

from kvspec.experiments.figures import Spread, as_json
from kvspec.experiments.verdict_table import Comparison, Fit, print_verdicts, tally, verdict_results

TUNED = Fit("fitted", "an input tuned until the figure is 2")
SAME = Comparison("a source", {"figure": 2.0}, {"figure": 2.0}, 0.1)


def test_a_relative_tolerance_holds_inside_and_fails_outside() -> None:
    """Of the mean, for a figure over seeds: 2.15 is 7.5 % from 2, 2.25 is 12.5 %, against 10 %."""
    inside = Comparison("a source", {"figure": 2.0}, {"figure": Spread.of([2.1, 2.2])}, 0.1).row("inside", "figure")
    outside = Comparison("a source", {"figure": 2.0}, {"figure": Spread.of([2.2, 2.3])}, 0.1).row("outside", "figure")
    assert inside.holds and inside.tolerance == "+-10% (mean)"
    assert not outside.holds and outside.status == "not reproduced"


def test_a_fitted_or_derived_row_never_counts_as_reproduced() -> None:
    rows = [
        SAME.row("as published", "figure"),
        SAME.row("tuned to land there", "figure", fit=TUNED),
        SAME.row("computed from a tuned figure", "figure", fit=Fit("derived", "the tuned figure, halved twice")),
    ]
    assert all(row.holds for row in rows)
    assert tally(rows) == {"rows": 3, "reproduced": 1, "fitted": 1, "derived": 1, "not reproduced": 0}


def test_the_table_and_the_json_say_what_was_fitted(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [SAME.row("as published", "figure"), SAME.row("tuned to land there", "figure", fit=TUNED)]
    print_verdicts(rows, "a title")
    printed = capsys.readouterr().out
    assert "2 (fitted)" in printed and f"tuned to land there: fitted: {TUNED.to}" in printed
    assert "1 of 2 figures reproduced; 1 fitted and 0 derived" in printed
    data = as_json(verdict_results(rows))
    assert [row["status"] for row in data["verdicts"]] == ["reproduced", "fitted"]
    assert data["verdicts"][1]["fit"] == {"kind": "fitted", "to": TUNED.to}
    assert data["summary"]["reproduced"] == 1
