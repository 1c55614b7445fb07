"""Lecture §8.4-8.5 and §9's figures, each against its source with the tolerance stated.

The simulations are the command's, at its request counts, over the first two or three of its seeds (the
command prints all five).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from kvspec.experiments import mooncake, mooncake_conductor, mooncake_rejection
from kvspec.experiments.figures import SEEDS, Spread
from kvspec.experiments.verdict_table import tally

TEST_SEEDS = SEEDS[:3]


def test_per_token_arithmetic_is_exact() -> None:
    """Lecture exercises 8-9: KV bytes exact; 137 GFLOP / (8 x 312 T x 0.6) = 91.5 us; RDMA 3.3 us, SSD 54.6 us."""
    llama, opt = mooncake.MODELS
    assert (llama.kv_bytes_per_token, opt.kv_bytes_per_token) == (327_680, 819_200)
    assert round(llama.recompute_seconds() * 1e6, 1) == 91.5
    assert round(llama.recompute_seconds(mooncake.CONTEXT) * 1e6) == 99  # "about 99 us with attention"
    rows = {(r["model"], r["tier"]): r for r in mooncake.storage_for_compute()["rows"]}
    assert round(rows[(llama.name, "RDMA 100 GB/s")]["read_us"], 2) == 3.28
    assert round(rows[(llama.name, "SSD x1 (6 GB/s)")]["read_us"], 1) == 54.6
    for tier, published in mooncake.LECTURE_RATIO_70B.items():  # lecture: 28x, 1.7x, 7x (rounded as printed)
        assert rows[(llama.name, tier)]["ratio"] == pytest.approx(published, rel=0.05)
    assert rows[(opt.name, "SSD x4 (24 GB/s)")]["ratio"] < 1 < rows[(opt.name, "RDMA 100 GB/s")]["ratio"] < 5
    assert round(mooncake.storage_for_compute()["bytes_per_flop_ratio"]) == 13  # exercise 9: "about 13x"
    per_flop = mooncake.storage_for_compute()["bytes_per_flop"]  # exercise 9: 3.1e-5 and 2.4e-6 (+-5 %)
    assert per_flop[opt.name] == pytest.approx(3.1e-5, rel=0.05)
    assert per_flop[llama.name] == pytest.approx(2.4e-6, rel=0.05)


def test_the_ssd_aggregate_rows_are_derived_and_not_counted() -> None:
    """Lecture pitfall 8's 7x and §9.3's +60 ms from SSD both come from the four-SSD aggregate bandwidth, which
    the lecture does not give: those rows say they are derived, and the summary does not count them."""
    rows = mooncake.verdicts(mooncake.storage_for_compute(), mooncake.layer_wise())
    derived = [v for v in rows if v.fit == mooncake.SSD_AGGREGATE_FIT]
    assert len(derived) == 2 and all(v.status == "derived" for v in derived)
    assert tally(rows)["reproduced"] == sum(v.holds for v in rows) - len(derived)


def test_the_stream_rows_say_what_was_fitted() -> None:
    """Lecture §8.4-8.5: the stream's mean input (8,709), single-use share (56 %) and unbounded speedup (2.46x)
    are each fitted, the 1,000-block speedup (1.46x) by the follow-up delay, and 0.42 h is derived from the
    fitted 2.46x: none counts as reproduced.  The no-cache hours and 10,000 blocks' 2.34x are predictions.
    On the command's --quick run (one seed)."""
    rows = {v.claim: v for v in mooncake_conductor.verdicts(mooncake_conductor.experiments(800, SEEDS[:1], False, 1))}
    statuses = {claim: v.status for claim, v in rows.items() if v.source.startswith("lecture §8")}
    fitted = [claim for claim, status in statuses.items() if status in ("fitted", "derived")]
    assert len(fitted) == 5
    assert all("10,000 blocks" in claim or "no cache" in claim for claim in statuses.keys() - fitted)


def test_ten_times_from_every_tier_does_not_hold_for_the_ssd() -> None:
    """Lecture §9.3 says reading back beats recomputing by 10x or more from every tier; pitfall 8 says 7x from
    SSD.  The model agrees with the latter, and the command prints that it cannot support the former."""
    storage = mooncake.storage_for_compute()
    assert not storage["ten_x_from_every_tier"]
    assert all(v.holds == (v.claim != mooncake.TEN_X_CLAIM) for v in mooncake.verdicts(storage, mooncake.layer_wise()))


def test_layer_wise_within_two_percent() -> None:
    """Lecture §9.3 demo 1: 870 ms full, 454 ms overlapped, SSD +60 ms without overlap (+-2 %)."""
    ssd = mooncake.layer_wise_ms(mooncake.TIER_BYTES_PER_S[mooncake.SSD_AGGREGATE])
    assert ssd["full_prefill_ms"] == pytest.approx(mooncake.LECTURE_LAYERWISE_MS["full"], rel=0.02)
    assert ssd["overlapped_ms"] == pytest.approx(mooncake.LECTURE_LAYERWISE_MS["overlapped"], rel=0.02)
    assert ssd["load_ms"] == pytest.approx(mooncake.LECTURE_LAYERWISE_MS["ssd_extra"], rel=0.02)


@functools.cache
def streams() -> list[mooncake_conductor.Stream]:
    """The lecture's stream at its own load, one per seed, each fitted to its seed's draws."""
    return [mooncake_conductor.document_stream(load=mooncake_conductor.lecture_load(), seed=s) for s in TEST_SEEDS]


def test_stream_has_the_lecture_statistics() -> None:
    """Lecture §8.4: mean input 8,709 tokens, 56 % of blocks seen once; §8.5: prefill 2.46x faster with an
    unbounded cache -- each within 5 % for every seed, measured on the stream.  All three are fitted (the
    lengths scaled, the last two solved in closed form), so the command never counts them as reproduced: the
    measurement checks the fit."""
    lecture = mooncake_conductor.STREAM
    for stream in streams():
        stats = mooncake_conductor.statistics(stream)
        for name in ("mean_input", "single_use_blocks", "unbounded_speedup"):
            assert stats[name] == pytest.approx(lecture[name], rel=mooncake_conductor.STREAM_TOLERANCE), name


def test_global_cache_speedups_of_section_8_5() -> None:
    """Lecture §8.5: prefill GPU time 1.05 h without a cache and 0.42 h with an unbounded one; 1.46x with 1,000
    blocks (the follow-up delay is calibrated to it) and 2.34x with 10,000 (a prediction).  Means over two
    seeds, within 10 %."""
    caches = [mooncake_conductor.global_cache(stream) for stream in streams()[:2]]
    for name, hours in mooncake_conductor.LECTURE_HOURS.items():
        assert Spread.of(c["hours"][name] for c in caches).mean == pytest.approx(hours, rel=0.1)
    for name, speedup in mooncake_conductor.LECTURE_GLOBAL_SPEEDUPS.items():
        assert Spread.of(c["speedups"][name] for c in caches).mean == pytest.approx(speedup, rel=0.1)


@functools.cache
def high_load() -> list[dict[str, dict[str, Any]]]:
    """Each policy at high load, per seed (the first two)."""
    runs = []
    for seed in TEST_SEEDS[:2]:
        stream = mooncake_conductor.document_stream(load=mooncake_conductor.HIGH_LOAD, seed=seed)
        runs.append({p: mooncake_conductor.simulate(stream, p, seed=seed) for p in mooncake_conductor.POLICIES})
    return runs


def test_conductor_within_tolerance() -> None:
    """Lecture §9.4 demo 2 (+-25 %, means over seeds): cache-aware computes ~40 % fewer tokens than random, cuts
    mean TTFT more than 10x at high load (every seed), and replication moves ~6.8 M tokens."""
    figures = [mooncake_conductor.figures(by) for by in high_load()]
    for name in ("computed_tokens_cut", "moved_tokens"):
        mean = Spread.of(f[name] for f in figures).mean
        assert mean == pytest.approx(mooncake_conductor.LECTURE[name], rel=mooncake_conductor.LECTURE_TOLERANCE), name
    assert all(f["ttft_ratio_at_high_load"] > mooncake_conductor.LECTURE["ttft_ratio_at_high_load"] for f in figures)


def test_conductor_order_and_refusals() -> None:
    """Mooncake Fig. 8's order on every seed (blind < cache-aware <= with replication in hit rate, TTFT the
    other way); HTTP 429s: refusing the requests predicted to miss the SLO serves the rest within it, and
    random placement, which queues more, refuses more than cache-aware placement."""
    assert all(mooncake_conductor.ordered(mooncake_conductor.figures(by)) for by in high_load())
    stream = mooncake_conductor.document_stream(load=mooncake_conductor.HIGH_LOAD, seed=TEST_SEEDS[0])
    refusing = {p: [mooncake_conductor.simulate(stream, p, reject=True)] for p in mooncake_conductor.REFUSING}
    refusals = mooncake_conductor.refusals(refusing)
    assert refusals["longest_served_ttft_s"] <= mooncake_conductor.TTFT_SLO_S
    assert refusals["rejected_share"]["cache-aware"].mean < refusals["rejected_share"]["random"].mean


def test_conductor_order_on_a_shipped_trace() -> None:
    """Lecture §9.4: the order is Mooncake Fig. 8's on real requests too -- the shipped synthetic trace at its
    own timestamps."""
    by = {
        p: mooncake_conductor.simulate(mooncake_conductor.trace_stream("synthetic", 1.0), p)
        for p in mooncake_conductor.POLICIES
    }
    assert mooncake_conductor.ordered(mooncake_conductor.figures(by))


def test_hit_rate_ratio_deviates_and_the_sensitivity_shows_why() -> None:
    """Lecture §9.4: cache-aware's hit rate "doubles" random's.  Here about 3x, outside +-25 %, and printed
    with its reason: the ratio falls toward 2 only as requests per reused document grow (8 here), and by then
    the stream's unbounded speedup is far past the lecture's 2.46x."""
    fitted = [mooncake_conductor.figures(by)["hit_rate_ratio"] for by in high_load()]
    assert Spread.of(fitted).mean > 2 * (1 + mooncake_conductor.LECTURE_TOLERANCE)
    shape = mooncake_conductor.fit_shape(reused_requests=8.0)
    stream = mooncake_conductor.document_stream(load=mooncake_conductor.HIGH_LOAD, shape=shape)
    by = {p: mooncake_conductor.simulate(stream, p) for p in mooncake_conductor.SENSITIVITY_POLICIES}
    assert mooncake_conductor.figures(by)["hit_rate_ratio"] < fitted[0]
    speedup = mooncake_conductor.statistics(stream)["unbounded_speedup"]
    assert speedup > (1 + mooncake_conductor.LECTURE_TOLERANCE) * mooncake_conductor.STREAM["unbounded_speedup"]


def rejection_runs(
    policy: str, ratio: float = 3.0, sigma: float = mooncake_rejection.OUTPUT_SIGMA, **admission: Any
) -> list[dict[str, Any]]:
    """One admission over the first two seeds, at the command's request count."""
    return [
        mooncake_rejection.simulate(
            mooncake_rejection.poisson_workload(prefill_over_decode=ratio, seed=seed, output_sigma=sigma),
            mooncake_rejection.Admission(policy, **admission),
            seed,
        )
        for seed in TEST_SEEDS[:2]
    ]


rejection_runs = functools.cache(rejection_runs)


def test_early_rejection_wastes_less_and_anti_correlates() -> None:
    """Lecture §9.6 demo 3 (means over seeds): early rejection cuts wasted prefill (lecture ~70 %; +-25 % of
    the cut), completes about as many (within 5 %), and the load series turn anti-correlated."""
    early, base = rejection_runs("early"), rejection_runs("baseline")
    cut = mooncake_rejection.relative(early, base, "wasted_prefill_s", cut=True)
    assert cut.mean == pytest.approx(mooncake_rejection.LECTURE["early_wasted_cut"], rel=0.25)
    completions = mooncake_rejection.relative(early, base, "completed")
    assert abs(completions.mean) <= mooncake_rejection.COMPLETIONS_TOLERANCE
    assert Spread.of(r["load_correlation"] for r in early).mean < 0


def test_shared_t_d_predictor_misses_for_the_reason_printed() -> None:
    """Lecture §9.6: the shared-t_d predictor cuts wasted prefill by ~1/3 and completes ~5 % fewer (it turns away
    requests that could have completed).  Here it errs the other way, as the printed reasons say: deciding, it
    counts under 3/4 of the decodes that will still be running (the long ones, believed finished), refuses at
    arrival under a tenth of what early rejection refuses, cuts almost no wasted prefill and completes as many
    as the baseline (within 5 %); with equal output lengths it counts them exactly and cuts more than early
    rejection does."""
    predicted, base, early = rejection_runs("prediction"), rejection_runs("baseline"), rejection_runs("early")
    early_cut = mooncake_rejection.relative(early, base, "wasted_prefill_s", cut=True)
    assert mooncake_rejection.relative(predicted, base, "wasted_prefill_s", cut=True).mean < 0.1
    assert (
        abs(mooncake_rejection.relative(predicted, base, "completed").mean) <= mooncake_rejection.COMPLETIONS_TOLERANCE
    )
    refusals = {
        p: Spread.of(r["refused_at_arrival"] for r in runs).mean
        for p, runs in (("prediction", predicted), ("early", early))
    }
    assert refusals["prediction"] < refusals["early"] / 10
    assert max(r["believed_over_actual_decodes"] for r in predicted) < 0.75
    equal = rejection_runs("prediction", sigma=0.0)
    assert all(r["believed_over_actual_decodes"] == pytest.approx(1.0) for r in equal)
    equal_cut = mooncake_rejection.relative(equal, rejection_runs("baseline", sigma=0.0), "wasted_prefill_s", cut=True)
    assert equal_cut.low > early_cut.high


def test_exercise_11_answered_by_a_run() -> None:
    """Lecture §14 exercise 11: early rejection completes more only where a doomed prefill costs others theirs.
    FIFO prefill with exact TTFT prediction: no win (within 5 %) at prefill capacity 1.5x or 3x decode's.
    Batched (processor-sharing) prefill at 1.5x: more than 1.5x the completions within the TTFT SLO on every
    seed, and a lower P90 TTFT; with both admission margins tuned (x0.3 of the SLO) the two are within 5 %."""
    ratio = mooncake_rejection.EXERCISE_11_RATIO
    for prefill_capacity in (ratio, 3.0):
        gain = mooncake_rejection.relative(
            rejection_runs("early", prefill_capacity), rejection_runs("baseline", prefill_capacity), "completed"
        )
        assert abs(gain.mean) <= mooncake_rejection.COMPLETIONS_TOLERANCE
    early, base = rejection_runs("early", ratio, prefill="shared"), rejection_runs("baseline", ratio, prefill="shared")
    assert mooncake_rejection.relative(early, base, "within_slo").low > 0.5
    assert Spread.of(r["ttft_p90_s"] for r in early).mean < Spread.of(r["ttft_p90_s"] for r in base).mean
    tuned = {
        p: rejection_runs(p, ratio, prefill="shared", margin=min(mooncake_rejection.MARGINS))
        for p in ("early", "baseline")
    }
    assert abs(mooncake_rejection.relative(tuned["early"], tuned["baseline"], "within_slo").mean) <= 0.05


def test_table_3_decode_is_the_bottleneck() -> None:
    """Table 3 calibration: decode sized for the conversation trace at 1x, so at 2x requests are refused
    after prefill (decode full).  The paper's ordering (Mooncake FAST'25 Table 3: 4,183 > 3,771 > 3,589) does
    not hold, and ``kvspec repro mooncake`` prints why; what the reason says is asserted here: every policy
    refuses about what decode cannot take (totals within 2 % of each other), and the baseline refuses some
    requests at arrival, on their predicted TTFT."""
    work = mooncake_rejection.trace_workload()
    concurrent = sum(work.decode_s) / work.arrivals_s[-1]  # at 2x; slots round up, hence ~1.8x, not 2x
    assert concurrent > 1.75 * mooncake_rejection.DECODES * work.slots
    runs = {p: mooncake_rejection.simulate(work, mooncake_rejection.Admission(p)) for p in mooncake_rejection.TABLE_3}
    rejected = [run["rejected"] for run in runs.values()]
    assert max(rejected) <= 1.02 * min(rejected)
    assert runs["baseline"]["refused_at_arrival"] > 0
