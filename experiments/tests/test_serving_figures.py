"""Lecture §7's figures, computed by ``kvspec.experiments.serving``'s simulator (small but faithful runs)."""

from __future__ import annotations

import math

from kvspec.experiments import serving


def test_sharegpt_like_lengths_have_the_papers_means_within_the_context() -> None:
    """vLLM §6.1: ShareGPT's mean input 161 and output 338 tokens; OPT's context is 2,048."""
    lengths = serving.sharegpt_like(1500, seed=0)
    assert abs(sum(p for p, _ in lengths) / 1500 - 161) < 0.05
    assert abs(sum(o for _, o in lengths) / 1500 - 338) < 0.05
    assert all(p >= 1 and o >= 1 and p + o <= serving.MAX_LENGTH for p, o in lengths)


def test_every_policy_finishes_every_request_without_leaking() -> None:
    workload = serving.sharegpt_like(60, seed=1)
    for policy in serving.POLICIES:
        run = serving.serve(policy, workload, math.inf, seed=1)
        assert run["leaked_slots"] == 0 and run["throughput_rps"] > 0
        assert run["preemptions"] == 0 or policy == "Paged"  # a reservation never runs out


def test_latency_is_flat_then_rises_sharply() -> None:
    """Lecture §7 demo 1 (vLLM Fig. 12's shape): flat at low rates, a knee past each policy's capacity."""
    workload = serving.sharegpt_like(150, seed=0)
    low, high = (serving.serve("Max", workload, rate, seed=0)["mean_normalized_latency_ms"] for rate in (0.3, 2.0))
    assert low < serving.LATENCY_BUDGET_MS < 5 * serving.LATENCY_BUDGET_MS < high


def test_paged_sustains_about_twice_oracle_and_three_times_max() -> None:
    """Lecture §7 demo 2: the highest rate within 50 ms/token is ~2x Oracle's and > 3x Max's for Paged
    (vLLM §6.2: 1.7-2.7x and 2.7-8x).  Within 20 % of 2 and of 3 (the lecture's figures), bisected
    over brackets that the full command's grid finds."""
    workload = serving.sharegpt_like(200, seed=0)
    brackets = {"Paged": (2.0, 4.0), "Oracle": (1.0, 2.0), "Max": (0.5, 1.5)}
    highest = {
        policy: serving.highest_rate_within_budget(policy, workload, low, high, seed=0, steps=4)
        for policy, (low, high) in brackets.items()
    }
    assert abs(highest["Paged"] / highest["Oracle"] / 2 - 1) <= 0.2
    assert highest["Paged"] / highest["Max"] >= 3 * 0.8
