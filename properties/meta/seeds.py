"""A zoo member's catch on random seeds of ``dev``: whether the search finds it, not whether one run did.

``teeth.assert_caught`` runs each catch derandomized: one fixed search, which shifts whenever any loaded
module changes (Hypothesis mixes the constants of every loaded module into what it draws).  A catch that
holds there by luck fails after an unrelated edit.  ``caught_on_seed`` runs the same catch under ``dev``'s
example and step counts from a given seed, stopping at the first failing example; a member is caught
robustly when every seed catches it.

``python -m kvspec.properties.meta.seeds [--seeds N] [--only TEXT]`` prints each member's catch rate over
N random seeds (with the seeds that missed, to run again); ``properties/meta/test_seeds.py`` asserts it
under the ``thorough`` profile.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence

from hypothesis import Verbosity
from hypothesis import seed as with_seed
from hypothesis import settings as Settings
from hypothesis.stateful import get_state_machine_test

from kvspec.impl.broken import Catch
from kvspec.properties import (
    profiles,  # noqa: F401 -- registers dev, ci and thorough
    suite,
)
from kvspec.properties.loading import load_implementation
from kvspec.properties.meta.teeth import DETECTION, zoo
from kvspec.properties.running import conformance_settings
from kvspec.report import Parser, progress, table
from kvspec.spec.invariants import InvariantViolation


def examples_to_catch(factory: str, catch: Catch, seed: int) -> int | None:
    """The examples ``catch.machine``, checking ``catch.invariant`` alone under ``dev``'s counts from ``seed``,
    runs until one shows ``factory``'s violation of it; None if none does."""
    implementation = load_implementation(factory)
    machine = suite.machine_titled(catch.machine).bind(implementation, only=frozenset({catch.invariant}))
    base = Settings(Settings.get_profile("dev"), database=None, derandomize=False, phases=DETECTION)
    settings = Settings(
        conformance_settings(base), report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet
    )
    try:
        with_seed(seed)(get_state_machine_test(machine, settings=settings))()
    except InvariantViolation as violation:
        return machine.statistics.examples if violation.invariant is catch.invariant else None
    except Exception as error:  # the member (or the machine) crashed first: a miss, said once
        print(f"{factory} on seed {seed}: {type(error).__name__}: {error}", file=sys.stderr)
    return None


def random_seeds(count: int) -> list[int]:
    return [random.SystemRandom().getrandbits(32) for _ in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="seeds", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="random seeds per member (default 3)")
    parser.add_argument("--seed", type=int, action="append", default=[], help="run this seed (repeatable)")
    parser.add_argument("--only", default="", help="only the members whose factory or invariant contains this")
    args = parser.parse_args(argv)
    chosen = [(f, c) for f, c in zoo() if args.only in f or args.only in c.invariant.name]
    rows = []
    for factory, catch in progress(chosen, "members"):
        found = {seed: examples_to_catch(factory, catch, seed) for seed in args.seed or random_seeds(args.seeds)}
        counts = sorted(n for n in found.values() if n is not None)
        missed = " ".join(str(seed) for seed, n in found.items() if n is None)
        spread = " ".join(map(str, counts))
        rows.append([factory.rpartition(".")[2], catch.invariant.name, len(counts), spread, missed])
    header = ["member", "invariant", "caught", "examples until caught", "seeds missed"]
    print(table(header, rows, title="each member's catch on seeds of dev"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
