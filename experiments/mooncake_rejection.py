"""Lecture §9.6 and exercise 11: early and prediction-based rejection under overload, simulated.

8 prefill + 8 decode instances.  A decode instance holds at most ``SLOTS``
requests -- the batch its TBT SLO allows -- and a request decodes for
``output tokens x TOKEN_S``.  A prefill instance (``prefix_cache.PrefillModel``,
LLaMA2-70B on 8 x A800) runs its requests one of two ways:

* ``fifo``: one at a time, in admission order -- the lecture's demo 3;
* ``shared``: all at once, each at 1 / n of the instance while n run (processor
  sharing: a batched prefill, where every admission slows the others down).

A request goes to the prefill instance with the earliest predicted first
token.  Under ``fifo`` the prediction is exact; under ``shared`` it assumes no
later admission (which is what makes it optimistic); ``predictor_error``
multiplies every predicted TTFT by a log-normal factor of that sigma.
Policies, decided at arrival (``Admission``), all refusing a request whose
predicted TTFT exceeds ``margin`` x the TTFT SLO:

* ``baseline`` looks at prefill only; a request that finds every decode slot
  taken when its prefill ends is refused then, and its prefill is wasted;
* ``early`` also refuses while every decode slot is taken now;
* ``prediction`` predicts the decode load at the moment the prefill will end,
  assuming every decode takes the same t_d (the mean): running decodes that
  will not have finished, plus accepted requests whose prefill ends first;
* ``prediction (exact t_d)``: the same with each request's own decode time --
  the accurate predictor of exercise 11.

Counted: completions, completions within the TTFT SLO (goodput), P90 TTFT of
the completions, prefill seconds wasted, and the load series (sampled every
second: prefill = requests in prefill per instance, decode = share of decode
slots taken), whose correlation shows the oscillation of Mooncake Fig. 9.
Arrivals are stationary Poisson at ``overload`` x decode capacity (to separate
load swings the scheduler causes from swings in the load itself); output
lengths are log-normal (sigma 1.2: long-tailed).  The prefill / decode
capacity ratio (3 for demo 3: decode the bottleneck, as the lecture says) is
my choice.  Every figure is a mean over seeds with its spread.

Table 3: the conversation trace replayed at 2x, prefills reusing every block
seen before (Mooncake's pool, an unbounded global cache).  Calibration: the
decode pool is sized for the trace at 1x (slots per instance = the mean number
of decodes running at 1x, by Little's law, over 8 instances), so the 2x
replay overloads decode twice over -- as demo 3's Poisson load does.

Exercise 11 is answered by two runs: the ``fifo`` model over a sweep of the
prefill / decode capacity ratio (no win: a doomed prefill delays nobody
admitted, and admission on an exact TTFT prediction lets nobody miss the SLO),
and the ``shared`` model with prefill capacity 1.5x decode's (early rejection
wins: doomed prefills slow the others past the SLO), with the baseline's
admission margin tuned (the win vanishes).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import numpy as np

from kvspec.experiments import trace as traces
from kvspec.experiments.figures import SEEDS, WORKERS, Spread, parallel_map
from kvspec.experiments.prefix_cache import PrefillModel
from kvspec.experiments.verdict_table import Comparison, Verdict, print_verdicts
from kvspec.report import pyplot, table

MODEL = PrefillModel()
PREFILLS, DECODES, SLOTS, TOKEN_S, TTFT_SLO_S = 8, 8, 32, 0.05, 5.0
POLICIES = ("baseline", "early", "prediction", "prediction (exact t_d)")
REQUESTS = 6_000  # per seed
OUTPUT_SIGMA = 1.2
Prefill = Literal["fifo", "shared"]


# -- workloads ----------------------------------------------------------------------------------


@attrs.frozen
class Workload:
    name: str
    arrivals_s: tuple[float, ...]
    prefill_s: tuple[float, ...]
    decode_s: tuple[float, ...]
    slots: int = SLOTS  # per decode instance


def decode_capacity_rps(mean_decode_s: float) -> float:
    return DECODES * SLOTS / mean_decode_s


@functools.cache  # every admission policy runs on the same workload
def poisson_workload(
    requests: int = REQUESTS,
    prefill_over_decode: float = 3.0,
    overload: float = 2.0,
    seed: int = 0,
    output_sigma: float = OUTPUT_SIGMA,
) -> Workload:
    """Arrivals at ``overload`` x decode capacity; prefill capacity ``prefill_over_decode`` x decode capacity.
    Output lengths are log-normal with ``output_sigma`` (0: every request the same length), mean 300."""
    rng = np.random.default_rng(seed)
    outputs = np.maximum(1, np.round(rng.lognormal(0.0, output_sigma, requests) * 300 / np.exp(output_sigma**2 / 2)))
    decode = outputs * TOKEN_S
    capacity = decode_capacity_rps(float(decode.mean()))
    mean_prefill = PREFILLS / (prefill_over_decode * capacity)
    per_token = MODEL.seconds(1_000, 0) / 1_000
    inputs = np.maximum(16, np.round(rng.lognormal(0.0, 0.5, requests) * mean_prefill / per_token / np.exp(0.125)))
    arrivals = np.cumsum(rng.exponential(1 / (overload * capacity), requests))
    return Workload(
        name=f"Poisson at {overload:g}x decode capacity, prefill capacity {prefill_over_decode:g}x decode",
        arrivals_s=tuple(arrivals.tolist()),
        prefill_s=tuple(MODEL.seconds(inputs, 0).tolist()),
        decode_s=tuple(decode.tolist()),
    )


def trace_workload(name: str = "conversation", speed: float = 2.0) -> Workload:
    """The trace at ``speed``, its decode pool sized for the trace at 1x (Table 3's overload is the speed-up)."""
    trace = traces.load(name)
    prefill = []
    for length, hit in zip(trace.input_lengths, traces.seen_before_hits(trace.blocks), strict=True):
        cached = min(hit * traces.BLOCK_TOKENS, length - 1)
        prefill.append(MODEL.seconds(length - cached, cached))
    decode = tuple(n * TOKEN_S for n in trace.output_lengths)
    concurrent_at_1x = sum(decode) / (trace.arrivals_ms[-1] / 1000)  # decodes running on average, by Little's law
    slots = math.ceil(concurrent_at_1x / DECODES)
    return Workload(
        name=f"{trace.name} trace at {speed:g}x, {slots} decode slots each (its 1x load)",
        arrivals_s=tuple(t / 1000 / speed for t in trace.arrivals_ms),
        prefill_s=tuple(prefill),
        decode_s=decode,
        slots=slots,
    )


# -- prefill instances ----------------------------------------------------------------------------


class PrefillInstance(Protocol):
    def predict(self, now: float, work: float) -> float: ...  # when a request of ``work`` seconds would end
    def admit(self, now: float, work: float, request: int) -> None: ...
    def next_end(self) -> float: ...  # when the next prefill ends, no later admission assumed
    def pop(self) -> tuple[float, int]: ...  # that prefill: (end, request)
    def in_flight(self) -> int: ...
    def projected_ends(self, now: float) -> Iterable[tuple[float, int]]: ...  # (end, request) of each, in order


class FifoPrefill:
    """One prefill at a time, in admission order: every end is known at admission."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.queue: deque[tuple[float, int]] = deque()

    def predict(self, now: float, work: float) -> float:
        return max(now, self.free_at) + work

    def admit(self, now: float, work: float, request: int) -> None:
        self.free_at = self.predict(now, work)
        self.queue.append((self.free_at, request))

    def next_end(self) -> float:
        return self.queue[0][0] if self.queue else math.inf

    def pop(self) -> tuple[float, int]:
        return self.queue.popleft()

    def in_flight(self) -> int:
        return len(self.queue)

    def projected_ends(self, now: float) -> Iterable[tuple[float, int]]:
        return self.queue


class SharedPrefill:
    """Processor sharing: n prefills in flight each progress at 1 / n.  ``served`` is the service every one
    of them has had since the instance started (a virtual clock); a prefill of ``work`` admitted at
    served = v ends when served reaches v + work.  Ends are kept sorted, with their running sums."""

    def __init__(self) -> None:
        self.clock = self.served = 0.0
        self.active: list[tuple[float, int]] = []  # sorted: (served at its end, request)
        self.ends: list[float] = []  # the same ends, for bisection
        self.sums: list[float] = [0.0]  # sums[k]: the first k ends added up

    def _advance(self, now: float) -> None:
        if self.active:
            self.served += (now - self.clock) / len(self.active)
        self.clock = now

    def _changed(self) -> None:
        self.ends = [end for end, _ in self.active]
        self.sums = [0.0, *itertools.accumulate(self.ends)]

    def predict(self, now: float, work: float) -> float:
        # Each prefill needing less than ``work`` ends first, having shared the instance with this one; the
        # others share it with this one until it ends.
        self._advance(now)
        shorter = bisect.bisect_left(self.ends, self.served + work)
        return now + self.sums[shorter] - shorter * self.served + (len(self.ends) - shorter) * work + work

    def admit(self, now: float, work: float, request: int) -> None:
        self._advance(now)
        bisect.insort(self.active, (self.served + work, request))
        self._changed()

    def next_end(self) -> float:
        return self.clock + (self.ends[0] - self.served) * len(self.ends) if self.ends else math.inf

    def pop(self) -> tuple[float, int]:
        end = self.next_end()
        self.served, request = self.active.pop(0)
        self.clock = end
        self._changed()
        return end, request

    def in_flight(self) -> int:
        return len(self.active)

    def projected_ends(self, now: float) -> list[tuple[float, int]]:
        self._advance(now)
        ends, elapsed, previous = [], now, self.served
        for k, (end, request) in enumerate(self.active):
            elapsed += (end - previous) * (len(self.active) - k)
            previous = end
            ends.append((elapsed, request))
        return ends


PREFILL_INSTANCES: dict[str, Callable[[], PrefillInstance]] = {"fifo": FifoPrefill, "shared": SharedPrefill}


# -- the simulator --------------------------------------------------------------------------------


@attrs.frozen
class Admission:
    """How requests are let in: the policy, the prefill discipline, the SLO margin and the predictor's error."""

    policy: str
    prefill: Prefill = "fifo"
    margin: float = 1.0  # admit when the predicted TTFT is within margin x the TTFT SLO
    predictor_error: float = 0.0  # sigma of a log-normal factor on every predicted TTFT


class DecodePool:
    """The running decodes, by end (sorted) and by start (sorted too: decodes start in time order)."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, float]] = []  # (end, start)
        self.starts: list[float] = []

    def __len__(self) -> int:
        return len(self.ends)

    def next_end(self) -> float:
        return self.ends[0][0] if self.ends else math.inf

    def start(self, now: float, seconds: float) -> None:
        bisect.insort(self.ends, (now + seconds, now))
        self.starts.append(now)

    def finish(self) -> None:
        _, start = self.ends.pop(0)
        self.starts.remove(start)

    def running_at(self, moment: float, t_d: float) -> dict[str, int]:
        """Of the decodes running now, those still running at ``moment``: believed (each taking t_d), and truly."""
        return {
            "shared t_d": len(self.starts) - bisect.bisect_right(self.starts, moment - t_d),
            "exact": len(self.ends) - bisect.bisect_right(self.ends, (moment, math.inf)),
        }


def simulate(work: Workload, admission: Admission, seed: int = 0) -> dict[str, Any]:
    policy, decode_slots = admission.policy, DECODES * work.slots
    t_d = float(np.mean(work.decode_s))
    # A stream of its own: drawn from the workload's seed alone, the errors would track its output lengths.
    errors = np.random.default_rng((seed, 1)).lognormal(0.0, admission.predictor_error, len(work.arrivals_s))
    instances: list[PrefillInstance] = [PREFILL_INSTANCES[admission.prefill]() for _ in range(PREFILLS)]
    ends = [math.inf] * PREFILLS  # each instance's next prefill end: it changes only when the instance does
    decodes = DecodePool()
    admitted: dict[int, tuple[float, float, float]] = {}  # request in prefill -> (arrival, prefill s, decode s)
    ttfts: list[float] = []  # of the requests that reached decode
    refused = {"at arrival": 0, "after prefill": 0}
    wasted = 0.0
    believed = actual = 0  # decodes the shared-t_d predictor counts as running at a prefill's end, and truly
    samples: list[tuple[float, float]] = []
    next_sample = 0.0
    predicting, exact = policy.startswith("prediction"), policy.endswith("(exact t_d)")

    def prefill_ends(first: int) -> None:
        nonlocal wasted
        end, request = instances[first].pop()
        ends[first] = instances[first].next_end()
        arrival, prefill, decode = admitted.pop(request)
        if len(decodes) < decode_slots:
            decodes.start(end, decode)
            ttfts.append(end - arrival)
        else:  # the TBT SLO admits no one: the prefill was for nothing
            refused["after prefill"] += 1
            wasted += prefill

    rows = zip(work.arrivals_s, work.prefill_s, work.decode_s, errors.tolist(), strict=True)
    for request, (arrival, prefill, decode, error) in enumerate(rows):
        while True:  # every prefill end, decode end and sample before this arrival, in time order
            first_end, decode_end = min(ends), decodes.next_end()
            now = min(first_end, decode_end, next_sample)
            if now > arrival:
                break
            if now == next_sample:
                in_prefill = sum(instance.in_flight() for instance in instances)
                samples.append((in_prefill / PREFILLS, len(decodes) / decode_slots))
                next_sample += 1.0
            elif now == decode_end:
                decodes.finish()
            else:
                prefill_ends(ends.index(first_end))
        predicted = [instance.predict(arrival, prefill) for instance in instances]
        finish = min(predicted)
        if (finish - arrival) * error > admission.margin * TTFT_SLO_S:
            refused["at arrival"] += 1
            continue
        if policy == "early" and len(decodes) >= decode_slots:
            refused["at arrival"] += 1
            continue
        if predicting:
            counts = decodes.running_at(finish, t_d)
            for instance in instances:  # and the requests whose prefill ends before this one's, decoding then
                for end, other in instance.projected_ends(arrival):
                    if end > finish:
                        break
                    counts["shared t_d"] += finish < end + t_d
                    counts["exact"] += finish < end + admitted[other][2]
            believed, actual = believed + counts["shared t_d"], actual + counts["exact"]
            if counts["exact" if exact else "shared t_d"] >= decode_slots:
                refused["at arrival"] += 1
                continue
        best = predicted.index(finish)
        instances[best].admit(arrival, prefill, request)
        ends[best] = instances[best].next_end()
        admitted[request] = (arrival, prefill, decode)
    while admitted:  # what is still in prefill when the arrivals stop ends as it would, decode ends in between
        first_end = min(ends)
        while decodes.next_end() <= first_end:
            decodes.finish()
        prefill_ends(ends.index(first_end))
    served = np.array(ttfts)
    series = np.array(samples[len(samples) // 10 :])  # past the warm-up
    return {
        "workload": work.name,
        "policy": admission.policy,
        "prefill": admission.prefill,
        "margin": admission.margin,
        "predictor_error": admission.predictor_error,
        "requests": len(work.arrivals_s),
        "completed": len(served),  # every admitted decode runs to the end
        "within_slo": int((served <= TTFT_SLO_S).sum()),
        "ttft_p90_s": float(np.percentile(served, 90)) if len(served) else math.nan,
        "refused_at_arrival": refused["at arrival"],
        "refused_after_prefill": refused["after prefill"],
        "rejected": sum(refused.values()),
        "wasted_prefill_s": wasted,
        "load_correlation": float(np.corrcoef(series[:, 0], series[:, 1])[0, 1]),
        "believed_over_actual_decodes": believed / actual if actual else math.nan,
        "series": samples,
    }


# -- the experiments ------------------------------------------------------------------------------

# Lecture §9.6 (demo 3): early rejection cuts wasted prefill ~70 %; the shared-t_d prediction cuts it by about a
# third and completes ~5 % fewer.  Mooncake FAST'25 Table 3 (8P+8D, real trace at 2x): rejected requests.
LECTURE = {"early_wasted_cut": 0.70, "prediction_wasted_cut": 1 / 3, "prediction_completions": -0.05}
LECTURE_TOLERANCE = 0.25
COMPLETIONS_TOLERANCE = 0.05  # "completes almost as many"
TABLE_3 = {"baseline": 4_183, "early": 3_771, "prediction": 3_589}
EXERCISE_11_FIFO_RATIOS = (1.5, 3.0)  # prefill capacity over decode capacity: the shared model's, and demo 3's
EXERCISE_11_RATIO = 1.5  # where batched prefill makes prefill a bottleneck too
MARGINS = (0.3, 0.6, 1.0)  # admission margins tried for tuning, x the TTFT SLO
PREDICTOR_ERROR = 0.5  # sigma of the log-normal error tried on the FIFO model

# (group, prefill over decode, output sigma, admission): every Poisson run, once per seed
RUNS: tuple[tuple[str, float, float, Admission], ...] = (
    *(("demo 3", 3.0, OUTPUT_SIGMA, Admission(p)) for p in POLICIES),
    *(("equal lengths", 3.0, 0.0, Admission(p)) for p in ("baseline", "prediction")),
    *(
        ("exercise 11, fifo", ratio, OUTPUT_SIGMA, Admission(p))
        for ratio in EXERCISE_11_FIFO_RATIOS[:-1]
        for p in ("baseline", "early")
    ),
    *(
        ("exercise 11, predictor error", EXERCISE_11_RATIO, OUTPUT_SIGMA, Admission(p, predictor_error=PREDICTOR_ERROR))
        for p in ("baseline", "early")
    ),
    *(
        ("exercise 11, shared", EXERCISE_11_RATIO, OUTPUT_SIGMA, Admission(p, "shared", margin))
        for margin in MARGINS
        for p in ("baseline", "early")
    ),
)


def _job(*args: Any) -> Any:
    """One job of the pool: a Poisson run (requests, ratio, sigma, admission, seed, whether to keep its load
    series for the plot), or Table 3's (no args)."""
    if not args:
        work = trace_workload()  # replaying the trace for its hits is most of the cost: once for every policy
        return [{**simulate(work, Admission(p)), "series": []} for p in TABLE_3]
    requests, ratio, sigma, admission, seed, keep_series = args
    run = simulate(poisson_workload(requests, ratio, 2.0, seed, sigma), admission, seed)
    return run if keep_series else {**run, "series": []}


def experiments(
    requests: int = REQUESTS, seeds: Sequence[int] = SEEDS, table_3: bool = True, workers: int = WORKERS
) -> dict[str, Any]:
    """Every run, once per seed, summarised: demo 3, the predictor's diagnostic, exercise 11 and Table 3."""
    jobs: list[tuple[Any, ...]] = [()] if table_3 else []  # Table 3's first: the longest job
    jobs += [
        (requests, ratio, sigma, admission, seed, seed == seeds[0])  # the plot draws the first seed's series
        for _, ratio, sigma, admission in RUNS
        for seed in seeds
    ]
    results = iter(parallel_map(_job, jobs, "rejection runs", workers))
    table_3_runs = next(results) if table_3 else []
    runs = {(group, ratio, sigma, admission): [next(results) for _ in seeds] for group, ratio, sigma, admission in RUNS}
    by = {(group, ratio, a.policy, a.margin): seeded for (group, ratio, _, a), seeded in runs.items()}
    demo = {p: by[("demo 3", 3.0, p, 1.0)] for p in POLICIES}
    equal = {p: by[("equal lengths", 3.0, p, 1.0)] for p in ("baseline", "prediction")}
    out: dict[str, Any] = {
        "requests": requests,
        "seeds": list(seeds),
        "demo_3": {p: summary(seeded) for p, seeded in demo.items()},
        "demo_3_first_seed": [seeded[0] for seeded in demo.values()],
        "figures": {
            "early_wasted_cut": relative(demo["early"], demo["baseline"], "wasted_prefill_s", cut=True),
            "prediction_wasted_cut": relative(demo["prediction"], demo["baseline"], "wasted_prefill_s", cut=True),
            "prediction_completions": relative(demo["prediction"], demo["baseline"], "completed"),
            "early_completions": relative(demo["early"], demo["baseline"], "completed"),
            "exact_wasted_cut": relative(
                demo["prediction (exact t_d)"], demo["baseline"], "wasted_prefill_s", cut=True
            ),
        },
        "predictor": {
            "believed_over_actual": Spread.of(r["believed_over_actual_decodes"] for r in demo["prediction"]),
            "equal_lengths_believed_over_actual": Spread.of(
                r["believed_over_actual_decodes"] for r in equal["prediction"]
            ),
            "equal_lengths_wasted_cut": relative(equal["prediction"], equal["baseline"], "wasted_prefill_s", cut=True),
        },
        "exercise_11": exercise_11(by),
        "table_3": table_3_runs,
    }
    return out


def summary(seeded: Sequence[dict[str, Any]]) -> dict[str, Spread]:
    keys = ("completed", "within_slo", "ttft_p90_s", "refused_at_arrival", "refused_after_prefill", "wasted_prefill_s")
    return {key: Spread.of(r[key] for r in seeded) for key in (*keys, "load_correlation")}


def relative(runs: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]], key: str, cut: bool = False) -> Spread:
    """Per seed, ``runs``' ``key`` over ``base``'s less 1 -- or, with ``cut``, 1 less that ratio."""
    ratios = [r[key] / b[key] for r, b in zip(runs, base, strict=True)]
    return Spread.of(1 - x if cut else x - 1 for x in ratios)


def exercise_11(by: dict[tuple[str, float, str, float], list[dict[str, Any]]]) -> dict[str, Any]:
    """Early rejection against the baseline: completions on the FIFO model (per ratio, with and without a
    predictor error), goodput and P90 TTFT on the shared model, and the two with their margins tuned."""
    fifo = {
        ratio: relative(
            by[("demo 3" if ratio == 3.0 else "exercise 11, fifo", ratio, "early", 1.0)],
            by[("demo 3" if ratio == 3.0 else "exercise 11, fifo", ratio, "baseline", 1.0)],
            "completed",
        )
        for ratio in EXERCISE_11_FIFO_RATIOS
    }
    erred = {p: by[("exercise 11, predictor error", EXERCISE_11_RATIO, p, 1.0)] for p in ("early", "baseline")}
    shared = {
        (p, m): by[("exercise 11, shared", EXERCISE_11_RATIO, p, m)] for p in ("baseline", "early") for m in MARGINS
    }
    goodput = {key: Spread.of(r["within_slo"] for r in seeded) for key, seeded in shared.items()}
    tuned = {p: max(MARGINS, key=lambda m: goodput[(p, m)].mean) for p in ("baseline", "early")}
    return {
        "fifo_completions": fifo,
        "fifo_with_error_completions": relative(erred["early"], erred["baseline"], "completed"),
        "fifo_with_error_goodput": relative(erred["early"], erred["baseline"], "within_slo"),
        "shared": {f"{p} x{m:g}": summary(seeded) for (p, m), seeded in shared.items()},
        "goodput_win": relative(shared[("early", 1.0)], shared[("baseline", 1.0)], "within_slo"),
        "p90_ttft_s": {p: Spread.of(r["ttft_p90_s"] for r in shared[(p, 1.0)]) for p in ("baseline", "early")},
        "tuned_margin": tuned,
        "tuned_goodput_win": relative(
            shared[("early", tuned["early"])], shared[("baseline", tuned["baseline"])], "within_slo"
        ),
    }


# -- what the command prints --------------------------------------------------------------------------


def verdicts(results: dict[str, Any]) -> list[Verdict]:
    figures, predictor, ex11 = results["figures"], results["predictor"], results["exercise_11"]
    demo = results["demo_3"]
    early, baseline = demo["early"], demo["baseline"]
    fifo_gains = [s.mean for s in ex11["fifo_completions"].values()]
    believed = predictor["believed_over_actual"].mean
    misses = (
        f"the shared-t_d predictor, deciding, counts {believed:.2f} of the decodes that will still be running"
        " when the prefill ends: the long-tailed decodes still running are the long ones, which it believes"
        " finished, so it admits nearly everyone.  With equal output lengths it is exact"
        f" ({predictor['equal_lengths_believed_over_actual'].mean:.2f}) and cuts the wasted prefill by"
        f" {predictor['equal_lengths_wasted_cut'].mean:.0%}."
    )

    demo_3 = Comparison("lecture §9.6 demo 3", LECTURE, figures, LECTURE_TOLERANCE)
    rows = [
        demo_3.row(
            "early rejection: wasted prefill cut",
            "early_wasted_cut",
            f"about {LECTURE['early_wasted_cut']:.0%}",
            percent=True,
        ),
        Verdict(
            "early rejection: completions against the baseline",
            "lecture §9.6 demo 3",
            "almost the same",
            figures["early_completions"].percent(),
            f"+-{COMPLETIONS_TOLERANCE:.0%} (mean)",
            abs(figures["early_completions"].mean) <= COMPLETIONS_TOLERANCE,
        ),
        Verdict(
            "early rejection: prefill and decode loads anti-correlated",
            "lecture §9.6, Mooncake Fig. 9-10a",
            "negative",
            f"{early['load_correlation']} (baseline {baseline['load_correlation'].mean:.2f})",
            "< 0 (mean)",
            early["load_correlation"].mean < 0,
        ),
        demo_3.row(
            "shared-t_d prediction: wasted prefill cut",
            "prediction_wasted_cut",
            "about a third",
            percent=True,
            reason=misses,
        ),
        demo_3.row(
            "shared-t_d prediction: completions against the baseline",
            "prediction_completions",
            f"{LECTURE['prediction_completions']:.0%}",
            percent=True,
            reason=(
                "the two predictors err in opposite directions: the lecture's turns away requests that could have"
                f" completed, so it completes fewer; kvspec's counts only {believed:.2f} of the decodes still"
                " running (above), so it lets nearly all in -- it refuses"
                f" {demo['prediction']['refused_at_arrival'].mean:,.0f} requests at arrival where early rejection"
                f" refuses {early['refused_at_arrival'].mean:,.0f} -- and completes as many as the baseline.  The"
                " lecture does not say what makes its predictor refuse too many."
            ),
        ),
        Verdict(
            "exercise 11: no win while a doomed prefill delays nobody (FIFO prefill, exact TTFT prediction)",
            "lecture §14 exercise 11",
            "decode-bound: no change",
            f"{min(fifo_gains):+.1%} to {max(fifo_gains):+.1%} over prefill / decode capacity"
            f" {', '.join(f'{r:g}' for r in EXERCISE_11_FIFO_RATIOS)}",
            f"|mean| <= {COMPLETIONS_TOLERANCE:.0%}",
            max(map(abs, fifo_gains)) <= COMPLETIONS_TOLERANCE,
        ),
        Verdict(
            "exercise 11: early rejection completes more within the TTFT SLO when doomed prefills slow the others"
            f" (batched prefill, capacity {EXERCISE_11_RATIO:g}x decode's)",
            "lecture §14 exercise 11",
            "more completions",
            f"goodput {ex11['goodput_win'].mean + 1:.2f}x (± {ex11['goodput_win'].std:.2f}); P90 TTFT"
            f" {ex11['p90_ttft_s']['baseline'].mean:.1f} -> {ex11['p90_ttft_s']['early'].mean:.1f} s",
            "goodput > 1.5x (mean)",
            ex11["goodput_win"].mean > 0.5,
        ),
        Verdict(
            "exercise 11: ... and the win vanishes once the baseline's admission margin is tuned too",
            "lecture §14 exercise 11",
            "(the caveat)",
            f"tuned margins x{ex11['tuned_margin']['baseline']:g} / x{ex11['tuned_margin']['early']:g}:"
            f" early {ex11['tuned_goodput_win'].percent()}",
            f"|mean| <= {COMPLETIONS_TOLERANCE:.0%}",
            abs(ex11["tuned_goodput_win"].mean) <= COMPLETIONS_TOLERANCE,
        ),
    ]
    if results["table_3"]:
        table_3 = {r["policy"]: r for r in results["table_3"]}
        rejected = [table_3[p]["rejected"] for p in TABLE_3]
        rows.append(
            Verdict(
                "rejected requests: baseline > early > prediction",
                "Mooncake Table 3 (measured)",
                " > ".join(f"{n:,}" for n in TABLE_3.values()),
                " / ".join(f"{n:,}" for n in rejected),
                "ordering",
                rejected[0] > rejected[1] > rejected[2],
                reason=(
                    "decode is the bottleneck here, so every policy refuses about what decode cannot take, only at"
                    " a different moment: at arrival (on a predicted TTFT past the SLO -- the baseline refuses"
                    f" {table_3['baseline']['refused_at_arrival']:,} so -- and, for early rejection, on a full"
                    " decode pool) or after a wasted prefill.  What this model lacks is the paper's decode"
                    " admission by the TBT SLO, the per-token latency the batch would have: a decode instance"
                    " here takes a fixed number of requests, whatever their lengths."
                ),
            )
        )
    return rows


def print_tables(results: dict[str, Any]) -> None:
    seeds = f"{results['requests']:,} requests per seed, mean ± sd over seeds {', '.join(map(str, results['seeds']))}"
    headers = ["policy", "completed", "refused at arrival", "refused after prefill", "wasted prefill s", "load corr."]
    keys = ["completed", "refused_at_arrival", "refused_after_prefill", "wasted_prefill_s", "load_correlation"]
    print()
    print(
        table(
            headers,
            [[policy, *(s[k].mean for k in keys)] for policy, s in results["demo_3"].items()],
            title=f"4. Overload, {PREFILLS}P + {DECODES}D, {SLOTS} decode slots each, FIFO prefill:"
            f" {poisson_workload(10).name} ({seeds})",
        )
    )
    predictor = results["predictor"]
    print(
        f"  The shared-t_d predictor believes {predictor['believed_over_actual']} of the decodes still running"
        f" when a prefill ends are; with equal output lengths {predictor['equal_lengths_believed_over_actual']},"
        f" and it then cuts the wasted prefill by {predictor['equal_lengths_wasted_cut'].percent()}."
    )
    ex11 = results["exercise_11"]
    print()
    print(
        table(
            ["prefill", "prefill / decode capacity", "TTFT predictor", "early vs baseline, completions", "goodput"],
            [
                ["FIFO", ratio, "exact", gain.percent(), "= completions"]
                for ratio, gain in ex11["fifo_completions"].items()
            ]
            + [
                [
                    "FIFO",
                    EXERCISE_11_RATIO,
                    f"log-normal error, sigma {PREDICTOR_ERROR:g}",
                    ex11["fifo_with_error_completions"].percent(),
                    ex11["fifo_with_error_goodput"].percent(),
                ]
            ],
            title="4b. Exercise 11 on the FIFO model (arrivals at 2x decode capacity): early rejection against the baseline",
        )
    )
    print()
    print(
        table(
            ["policy, margin x SLO", "completed", "within TTFT SLO", "P90 TTFT s", "wasted prefill s"],
            [
                [name, s["completed"].mean, str(s["within_slo"]), s["ttft_p90_s"].mean, s["wasted_prefill_s"].mean]
                for name, s in ex11["shared"].items()
            ],
            title=f"4c. Exercise 11 on batched (processor-sharing) prefill at {EXERCISE_11_RATIO:g}x decode capacity,"
            f" arrivals at 2x: admission on a TTFT prediction that assumes no later admission ({seeds})",
        )
    )
    print(
        f"  Early rejection completes {ex11['goodput_win'].mean + 1:.2f}x as many requests within the TTFT SLO"
        f" ({ex11['goodput_win']} more) and cuts P90 TTFT from {ex11['p90_ttft_s']['baseline'].mean:.1f} s to"
        f" {ex11['p90_ttft_s']['early'].mean:.1f} s: every doomed prefill the baseline admits slows the prefills"
        " sharing its instance past the SLO.  Tuned, the baseline's best margin"
        f" (x{ex11['tuned_margin']['baseline']:g}) does as well as early rejection's"
        f" (x{ex11['tuned_margin']['early']:g}): {ex11['tuned_goodput_win'].percent()}.  On the FIFO model"
        " nothing changes: a doomed prefill delays nobody already admitted, and an exact TTFT prediction lets"
        " nobody admitted miss the SLO; an erring predictor errs for both policies alike."
    )
    if results["table_3"]:
        print()
        print(
            table(
                [*headers, "rejected"],
                [[r["policy"], *(r[k] for k in keys), r["rejected"]] for r in results["table_3"]],
                title=f"4d. Mooncake Table 3 setting: {results['table_3'][0]['workload']}"
                " (paper: rejected 4,183 / 3,771 / 3,589)",
            )
        )
    print_verdicts(verdicts(results), "Lecture §9.6 and exercise 11 against this run (means over seeds)")


def plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    runs = results["demo_3_first_seed"]
    figure, axes = plt.subplots(len(runs), 1, figsize=(8, 2.2 * len(runs)), sharex=True)
    for ax, run in zip(axes, runs, strict=True):
        series = np.array(run["series"][:600])
        ax.plot(series[:, 0] / max(series[:, 0].max(), 1e-9), label="prefill load (normalised)")
        ax.plot(series[:, 1], label="decode slots taken")
        ax.set_title(f"{run['policy']} (correlation {run['load_correlation']:.2f})", fontsize=9)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("seconds")
    figure.savefig(path, bbox_inches="tight")
    return True
