"""The members whose bugs need a searched shape are caught on every random seed of ``dev``, not by luck.

Each shape is one a bug needs several steps to reach: a refused admission retried after its cached blocks
changed, two requests passed over in one pass, a grant taken from a victim, a partial swap-in over a
resident prefix.  A derandomized ``ci`` run (``test_zoo``) shows one search that catches each; this test
draws fresh seeds, so it is not deterministic and runs only under the ``thorough`` profile
(``HYPOTHESIS_PROFILE=thorough pytest -q properties/meta/test_seeds.py``); ``python -m
kvspec.properties.meta.seeds --only NAME`` prints the same catch rates as a table.
"""

from __future__ import annotations

import pytest
from hypothesis import settings as Settings

from kvspec.impl.broken import Catch
from kvspec.properties.meta.seeds import examples_to_catch, random_seeds
from kvspec.properties.meta.teeth import zoo

SEEDS = 3
SEARCHED_SHAPES = {
    "reuses_hits_of_refused_write": "refusal, a cache change, the same request again",
    "reports_first_probe_hits": "refusal, a cache change, the same request again",
    "reverses_passed_over": "two requests passed over in one pass",
    "keeps_grant_of_victim": "a grant taken from a victim",
    "loads_over_resident_prefix": "a partial swap-in over a resident prefix",
    "skips_every_resident_block": "a partial swap-in over a resident prefix",
}
MEMBERS = [(f, c) for f, c in zoo() if f.rpartition(":")[2] in SEARCHED_SHAPES]


def test_every_searched_shape_has_members() -> None:
    found = {f.rpartition(":")[2] for f, _ in MEMBERS}
    assert found == set(SEARCHED_SHAPES), f"members missing from the zoo: {sorted(set(SEARCHED_SHAPES) - found)}"


@pytest.mark.skipif(
    Settings.get_current_profile_name() != "thorough", reason="random seeds: run under HYPOTHESIS_PROFILE=thorough"
)
@pytest.mark.parametrize(("factory", "catch"), MEMBERS, ids=[f.rpartition(":")[2] for f, _ in MEMBERS])
def test_caught_on_every_seed(factory: str, catch: Catch) -> None:
    seeds = random_seeds(SEEDS)
    missed = [seed for seed in seeds if examples_to_catch(factory, catch, seed) is None]
    assert not missed, f"{factory} escaped on seeds {missed} (rerun: python -m kvspec.properties.meta.seeds --seed N)"
