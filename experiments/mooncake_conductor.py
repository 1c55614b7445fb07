"""Lecture §9.4: Conductor's KV-aware prefill scheduling (Mooncake Algorithm 1), simulated.

Prefill instances (8 x A800 each, LLaMA2-70B, ``prefix_cache.PrefillModel``)
each keep a local prefix cache -- the reference block pool, LRU, 512-token
blocks -- and a FIFO queue.  A request's blocks are cached on its instance
when it is placed (requests after it on that instance run after it).
Placement policies:

* ``random``; ``least-loaded`` (shortest queue, in predicted seconds);
* ``cache-aware``: minimise queue time + predicted prefill time given the
  instance's local prefix hit;
* ``cache-aware + replication`` (Algorithm 1): when the longest prefix held
  anywhere is longer than an instance's by more than ``THRESHOLD`` times, that
  instance may pull the difference over RDMA (100 GB/s, paying the transfer
  time before its prefill) and keeps the pulled blocks: hot prefixes spread.

TTFT = queueing + transfer + prefill.  With ``reject`` on, a request whose
best predicted TTFT exceeds the SLO is refused (HTTP 429) instead of queued.

The lecture's stream (demo 2) imitates its synthetic trace of §8.4: 4,157
requests on documents, at that trace's own rate (24 minutes: about 0.32 of the
cache-less capacity) and at 1.2x the cache-less capacity ("at high load", my
choice).  ``Documents`` and ``document_stream`` say how; its shape -- the
share of documents asked once and the requests per reused document -- is
solved per seed (``fit_shape``) for the lecture's 56 % of blocks seen once
and 2.46x unbounded-cache prefill speedup (§8.5), the mean input is scaled to
8,709 tokens, and the delay of follow-up requests is calibrated to §8.5's
1.46x with one global cache of 1,000 blocks.  ``statistics`` and
``global_cache`` measure the stream against those figures, and 10,000 blocks'
2.34x, which nothing was fitted to.  Algorithm 1's balancing threshold is not
in the lecture: 1.5 is my choice.  The shipped Mooncake traces are replayed
at their own timestamps.  Every figure is a mean over seeds with its spread.

Against the lecture (``kvspec repro mooncake`` prints each with its verdict
and, where it deviates, why): tokens computed, TTFT at high load and
replication traffic land within +-25 % (or past "10x"); cache-aware's hit rate
is about 3x random's, not 2x: with about four requests per reused document a
random placement rarely finds the one instance that holds a document, and a
stream with 2x needs about eight, which breaks the 2.46x (the sensitivity
table shows it).
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvspec.experiments import trace as traces
from kvspec.experiments.figures import SEEDS, WORKERS, Spread, parallel_map
from kvspec.experiments.prefix_cache import PrefillModel, prefill_hours
from kvspec.experiments.verdict_table import Comparison, Fit, Verdict, print_verdicts
from kvspec.impl.block_pool import BlockPool
from kvspec.report import table

BLOCK = traces.BLOCK_TOKENS
MODEL = PrefillModel()
RDMA_BYTES_PER_S = 100e9
THRESHOLD = 1.5  # Algorithm 1's kvcache_balancing_threshold: pull only a prefix this many times longer
POLICIES = ("random", "least-loaded", "cache-aware", "cache-aware + replication")
INSTANCES, CACHE_BLOCKS, TTFT_SLO_S = 8, 3_000, 5.0  # lecture demo 2
# Lecture §9.4 / §12 point 8 (demo 2): cache-aware vs random, the replication traffic.
LECTURE = {
    "hit_rate_ratio": 2.0,
    "computed_tokens_cut": 0.40,
    "ttft_ratio_at_high_load": 10.0,
    "moved_tokens": 6_800_000,
}
# Lecture §8.4 (code 04 demo 3): the synthetic trace the stream imitates; §8.5: its prefill GPU time
# falls 2.46x with an unbounded cache.
LECTURE_REQUESTS = 4_157
STREAM: dict[str, float] = {
    "requests": LECTURE_REQUESTS,
    "mean_input": 8_709,
    "single_use_blocks": 0.56,
    "unbounded_speedup": 2.46,
    "minutes": 24,
}
QUESTION_TOKENS = (50, 500)  # a question's length, uniform (my choice)
HIGH_LOAD = 1.2  # "at high load": offered work 1.2x the cache-less capacity (my choice)
# Mean delay of a document's later requests: how far apart reuses are, which sets what a small cache keeps.
# Calibrated once (seed 0) so that one global cache of 1,000 blocks speeds prefill up 1.46x (lecture §8.5; 30 s
# gave 2.0x); 10,000 blocks' 2.34x is then a prediction.
FOLLOW_UP_S = 80.0


@attrs.frozen
class Stream:
    name: str
    arrivals_s: tuple[float, ...]
    lengths: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    shape: StreamShape | None = None  # None for a trace


@attrs.frozen
class StreamShape:
    """How requests fall on documents: ``one_off_share`` of the documents are asked once, each of the others
    ``reused_requests`` times on average (two, plus a geometric number more)."""

    one_off_share: float
    reused_requests: float


class Documents:
    """One seed's draws for a stream of ``requests``: every shape reuses them, so fitting a shape is smooth.

    A document has a log-normal length (sigma 0.6, clipped to 512..32,000 tokens, scaled so that the
    requests' mean input is the lecture's 8,709) and each request is the document plus a question of its
    own (50..499 tokens).  Its blocks: the document's full blocks, shared by its requests, then the
    request's own (the rest of the document and the question).
    """

    def __init__(self, requests: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.requests = requests
        self.draws = rng.lognormal(0.0, 0.6, requests)  # at least one request each: enough documents
        self.one_off = rng.random(requests)
        self.more = rng.random(requests)
        self.questions = rng.integers(*QUESTION_TOKENS, requests)
        self.rng = rng  # what remains of the stream: arrival times

    def counts(self, shape: StreamShape) -> np.ndarray:
        """Requests per document, the first ``requests`` in all."""
        extra = shape.reused_requests - 2
        more = np.floor(np.log(self.more) / np.log1p(-1 / (1 + extra))).astype(int) if extra > 0 else 0
        counts = np.where(self.one_off < shape.one_off_share, 1, 2 + more)
        ends = np.cumsum(counts)
        last = int(np.searchsorted(ends, self.requests))
        counts = counts[: last + 1]
        counts[-1] -= ends[last] - self.requests
        return counts

    def document_tokens(self, counts: np.ndarray) -> np.ndarray:
        """Each document's length, scaled until the requests' mean input is the lecture's."""
        draws, target = self.draws[: len(counts)], STREAM["mean_input"] - self.questions.mean()
        scale = target / np.repeat(draws, counts).mean()
        for _ in range(20):  # clipping moves the mean: rescale until it lands
            tokens = np.clip(np.round(draws * scale), BLOCK, 32_000).astype(int)
            mean = np.repeat(tokens, counts).mean()
            if abs(mean - target) < 0.5:
                break
            scale *= target / mean
        return tokens

    def statistics(self, shape: StreamShape) -> tuple[float, float]:
        """The share of blocks seen once and the unbounded-cache prefill speedup, in closed form: a
        document's first request comes first and finds nothing, the others find its shared blocks."""
        counts = self.counts(shape)
        tokens = self.document_tokens(counts)
        shared = tokens // BLOCK
        lengths = np.repeat(tokens, counts) + self.questions
        held = np.repeat(shared, counts)
        own = -(-lengths // BLOCK) - held
        single_use = float((shared[counts == 1].sum() + own.sum()) / (shared.sum() + own.sum()))
        first = np.zeros(self.requests, dtype=bool)
        first[np.cumsum(counts) - counts] = True
        cached = np.where(first, 0, np.minimum(held * BLOCK, lengths - 1))
        speedup = float(MODEL.seconds(lengths, 0).sum() / MODEL.seconds(lengths - cached, cached).sum())
        return single_use, speedup


@functools.cache
def fit_shape(requests: int = LECTURE_REQUESTS, seed: int = 0, reused_requests: float | None = None) -> StreamShape:
    """The shape whose stream has the lecture's 56 % of single-use blocks and 2.46x unbounded-cache speedup
    (§8.4-8.5), both solved by bisection: the one-off share for the former (more one-offs, more single use)
    at each number of requests per reused document, and that number for the latter (more requests, more
    reuse).  Given ``reused_requests``, only the one-off share is solved."""
    documents = Documents(requests, seed)

    def one_off_share(reused: float) -> StreamShape:
        low, high = 0.0, 1.0
        for _ in range(25):
            middle = (low + high) / 2
            shape = StreamShape(middle, reused)
            low, high = (
                (low, middle) if documents.statistics(shape)[0] > STREAM["single_use_blocks"] else (middle, high)
            )
        return StreamShape(high, reused)

    if reused_requests is not None:
        return one_off_share(reused_requests)
    low, high = 2.0, 16.0
    for _ in range(25):
        middle = (low + high) / 2
        speedup = documents.statistics(one_off_share(middle))[1]
        low, high = (middle, high) if speedup < STREAM["unbounded_speedup"] else (low, middle)
    return one_off_share((low + high) / 2)


@functools.cache  # each policy runs on the same stream
def document_stream(
    requests: int = LECTURE_REQUESTS, load: float = 1.0, seed: int = 0, shape: StreamShape | None = None
) -> Stream:
    """Requests on documents with the statistics of the lecture's synthetic trace (§8.4): ``Documents``'
    draws in ``shape`` (by default ``fit_shape``'s).  A document's first request arrives with it (Poisson)
    and the others within about a minute (exponential delays, mean ``FOLLOW_UP_S``).  ``load`` is the
    offered prefill work over the cache-less capacity of the ``INSTANCES`` instances."""
    shape = shape or fit_shape(requests, seed)
    documents = Documents(requests, seed)
    counts = documents.counts(shape)
    tokens = documents.document_tokens(counts)
    owners = np.repeat(np.arange(len(counts)), counts)
    lengths = tokens[owners] + documents.questions
    capacity = INSTANCES / cacheless_seconds(lengths)  # requests/s without any cache
    rng = documents.rng
    starts = np.cumsum(rng.exponential(requests / (load * capacity * len(counts)), len(counts)))
    delays = rng.exponential(FOLLOW_UP_S, requests)
    delays[np.cumsum(counts) - counts] = 0.0  # each document's first request comes with it
    shared = tokens // BLOCK
    first_own = BLOCK_IDS * len(counts)  # a document's blocks are numbered below, every request's own above
    rows = []
    for r, (d, length) in enumerate(zip(owners.tolist(), lengths.tolist(), strict=True)):
        own = range(first_own + BLOCK_IDS * r + int(shared[d]), first_own + BLOCK_IDS * r + -(-length // BLOCK))
        rows.append(
            (float(starts[d] + delays[r]), length, (*range(BLOCK_IDS * d, BLOCK_IDS * d + int(shared[d])), *own))
        )
    rows.sort(key=lambda row: row[0])
    return Stream(
        name=f"documents, load {load:.2g}",
        arrivals_s=tuple(row[0] for row in rows),
        lengths=tuple(row[1] for row in rows),
        blocks=tuple(row[2] for row in rows),
        shape=shape,
    )


BLOCK_IDS = 64  # block numbers per document and per request: more than 32,500 / 512 blocks


def cacheless_seconds(lengths: Sequence[int] | np.ndarray) -> float:
    """Mean prefill seconds without a cache (attention is quadratic: not the mean length's time)."""
    return float(np.mean(MODEL.seconds(np.asarray(lengths, dtype=np.int64), 0)))


@functools.cache
def lecture_load() -> float:
    """The load of the lecture's synthetic trace: 4,157 requests in 24 minutes, on ``INSTANCES``."""
    return STREAM["requests"] / STREAM["minutes"] / 60 * cacheless_seconds(document_stream().lengths) / INSTANCES


def statistics(stream: Stream) -> dict[str, float]:
    """The figures §8.4-8.5 give for the lecture's trace, measured on ``stream``."""
    uses = Counter(block for blocks in stream.blocks for block in blocks)
    cacheless = unbounded = 0.0
    for length, hit in zip(stream.lengths, traces.seen_before_hits(stream.blocks), strict=True):
        cacheless += prefill_seconds(length, 0)
        unbounded += prefill_seconds(length, hit)
    return {
        "requests": len(stream.lengths),
        "minutes": stream.arrivals_s[-1] / 60,
        "mean_input": float(np.mean(stream.lengths)),
        "single_use_blocks": sum(1 for n in uses.values() if n == 1) / len(uses),
        "unbounded_speedup": cacheless / unbounded,
    }


def as_trace(stream: Stream) -> traces.Trace:
    return traces.Trace(
        name=stream.name,
        arrivals_ms=tuple(round(t * 1000) for t in stream.arrivals_s),
        input_lengths=stream.lengths,
        output_lengths=(0,) * len(stream.lengths),
        blocks=stream.blocks,
    )


def global_cache(stream: Stream) -> dict[str, dict[str, float]]:
    """Lecture §8.5 on the stream: prefill GPU hours with no cache and with one global LRU cache of each of
    ``LECTURE_GLOBAL_CACHE``'s capacities, and the speedups."""
    trace = as_trace(stream)
    hours = {"none": prefill_hours(trace, (0,) * len(trace.blocks), MODEL)}
    for name, capacity in LECTURE_GLOBAL_CACHE.items():
        hits = traces.seen_before_hits(trace.blocks) if capacity is None else traces.replay(trace, capacity, "lru")
        hours[name] = prefill_hours(trace, hits, MODEL)
    return {"hours": hours, "speedups": {name: hours["none"] / hours[name] for name in LECTURE_GLOBAL_CACHE}}


def trace_stream(name: str, speed: float) -> Stream:
    trace = traces.load(name)
    return Stream(
        name=f"{trace.name} trace at {speed:g}x",
        arrivals_s=tuple(t / 1000 / speed for t in trace.arrivals_ms),
        lengths=trace.input_lengths,
        blocks=trace.blocks,
    )


class Instance:
    def __init__(self) -> None:
        self.cache = BlockPool(CACHE_BLOCKS, "lru")
        self.free_at = 0.0

    def prefix(self, blocks: Sequence[int]) -> int:
        """Blocks of ``blocks`` cached here, from the start; touches nothing."""
        if self.cache.lookup(blocks[0]) is None:  # most instances hold nothing of a request: say so at once
            return 0
        return len(self.cache.lookup_prefix(blocks))

    def keep(self, blocks: Sequence[int]) -> None:
        """Cache ``blocks``: touch the cached prefix, store the rest (LRU eviction), hold none."""
        traces.replay_requests(self.cache, (blocks,))


def prefill_seconds(length: int, cached_blocks: int) -> float:
    cached = min(cached_blocks * BLOCK, length - 1)
    return MODEL.seconds(length - cached, cached)


def transfer_seconds(blocks: int) -> float:
    return blocks * BLOCK * MODEL.kv_bytes_per_token / RDMA_BYTES_PER_S


NO_PULLS = [0] * INSTANCES


def simulate(stream: Stream, policy: str, reject: bool = False, seed: int = 0) -> dict[str, Any]:
    instances = [Instance() for _ in range(INSTANCES)]
    rng = random.Random(seed)
    ttfts: list[float] = []
    hit_blocks = all_blocks = computed = moved = rejected = 0
    replicating = policy == REPLICATING
    for arrival, length, blocks in zip(stream.arrivals_s, stream.lengths, stream.blocks, strict=True):
        queue = [max(0.0, i.free_at - arrival) for i in instances]
        local = [i.prefix(blocks) for i in instances]
        best = max(local)
        prefill = {hit: prefill_seconds(length, hit) for hit in {*local, best}}  # a few distinct hits
        # An instance pulls the longest prefix held anywhere when it is THRESHOLD times longer than its own.
        pulls = [best - hit if best > THRESHOLD * hit else 0 for hit in local] if replicating else NO_PULLS
        predicted = [  # each instance's TTFT for this request
            waited + (transfer_seconds(pull) if pull else 0.0) + prefill[hit + pull]
            for waited, hit, pull in zip(queue, local, pulls, strict=True)
        ]
        if policy == "random":
            n = rng.randrange(INSTANCES)
        elif policy == "least-loaded":
            n = queue.index(min(queue))
        else:  # the least predicted TTFT, the first instance of those
            n = predicted.index(min(predicted))
        ttft, pulled = predicted[n], pulls[n]
        reused = local[n] + pulled
        if reject and ttft > TTFT_SLO_S:
            rejected += 1
            continue
        instance = instances[n]
        instance.free_at = arrival + ttft
        instance.keep(blocks)
        ttfts.append(ttft)
        hit_blocks += reused
        all_blocks += len(blocks)
        computed += length - min(reused * BLOCK, length - 1)
        moved += pulled * BLOCK
    served = np.array(ttfts)
    return {
        "stream": stream.name,
        "policy": policy,
        "requests": len(stream.lengths),
        "hit_rate": hit_blocks / all_blocks,
        "tokens_computed": computed,
        "ttft_mean_s": float(served.mean()),
        "ttft_p90_s": float(np.percentile(served, 90)),
        "ttft_max_s": float(served.max()),
        "slo_attainment": float((served <= TTFT_SLO_S).mean()) * (len(served) / len(stream.lengths)),
        "rejected": rejected,
        "tokens_transferred": moved,
    }


def _job(kind: str, *args: Any) -> dict[str, Any]:
    """One job of the pool: a run on the documents (shape, load, policy, reject, requests, seed) or on a trace
    (name, policy), or a stream's own figures (shape, load, requests, seed)."""
    if kind == "documents":
        shape, load, policy, reject, requests, seed = args
        return simulate(document_stream(requests, load, seed, shape), policy, reject, seed)
    if kind == "trace":
        name, policy = args
        return simulate(trace_stream(name, 1.0), policy)
    shape, load, requests, seed = args
    stream = document_stream(requests, load, seed, shape)
    return {"statistics": statistics(stream), "global_cache": global_cache(stream)}


def experiments(
    requests: int = LECTURE_REQUESTS, seeds: Sequence[int] = SEEDS, with_traces: bool = True, workers: int = WORKERS
) -> dict[str, Any]:
    """The lecture's stream, fitted per seed, at ``HIGH_LOAD``, also refusing 429s, and its own figures at the
    lecture's load; the hit-rate ratio's sensitivity to requests per reused document (the first seed); the
    shipped synthetic trace at its own timestamps."""
    first = seeds[0]
    shapes = {seed: fit_shape(requests, seed) for seed in seeds}
    groups = {"high load": (POLICIES, False), "high load, 429s": (REFUSING, True)}  # (policies, reject)
    sensitivity_shapes = [fit_shape(requests, first, reused) for reused in SENSITIVITY_REUSE]
    jobs: list[tuple[Any, ...]] = [
        ("documents", shapes[seed], HIGH_LOAD, p, reject, requests, seed)
        for policies, reject in groups.values()
        for p in policies
        for seed in seeds
    ]
    jobs += [
        ("documents", shape, HIGH_LOAD, p, False, requests, first)
        for shape in sensitivity_shapes
        for p in SENSITIVITY_POLICIES
    ]
    jobs += [("stream", shapes[seed], lecture_load(), requests, seed) for seed in seeds]
    jobs += [("trace", name, p) for name in REPLAYED_TRACES for p in POLICIES] if with_traces else []
    results = iter(parallel_map(_job, jobs, "conductor runs", workers))
    runs = {group: {p: [next(results) for _ in seeds] for p in policies} for group, (policies, _) in groups.items()}
    sensitivity = [{p: next(results) for p in SENSITIVITY_POLICIES} for _ in sensitivity_shapes]
    sensitivity.append({p: runs["high load"][p][0] for p in SENSITIVITY_POLICIES})
    sensitivity_shapes.append(shapes[first])
    own = [next(results) for _ in seeds]
    trace_runs = list(results)
    per_seed = [figures({p: seeded[i] for p, seeded in runs["high load"].items()}) for i in range(len(seeds))]
    caches = [figures["global_cache"] for figures in own]
    return {
        "requests": requests,
        "seeds": list(seeds),
        "shapes": shapes,
        "lecture_load": lecture_load(),
        "table": {group: {p: run_summary(seeded) for p, seeded in by.items()} for group, by in runs.items()},
        "stream": {key: Spread.of(s["statistics"][key] for s in own) for key in STREAM},
        "global_cache": {
            kind: {name: Spread.of(c[kind][name] for c in caches) for name in caches[0][kind]}
            for kind in ("hours", "speedups")
        },
        "figures": {name: Spread.of(f[name] for f in per_seed) for name in LECTURE},
        "ordering": [ordered(f) for f in per_seed],
        "refusals": refusals(runs["high load, 429s"]),
        "sensitivity": sorted(
            (
                {"shape": shape, **statistics(document_stream(requests, HIGH_LOAD, first, shape)), **figures(by)}
                for shape, by in zip(sensitivity_shapes, sensitivity, strict=True)
            ),
            key=lambda row: row["shape"].reused_requests,
        ),
        "traces": trace_runs,
        "traces_ordered": [
            ordered(figures({r["policy"]: r for r in trace_runs if r["stream"] == name}))
            for name in dict.fromkeys(r["stream"] for r in trace_runs)
        ],
    }


# Fig. 8's order on real requests: the synthetic trace (3,993 requests); replaying the conversation trace's
# 12,031 four times would double the command's time, and it is replayed for Table 3 (kvspec repro mooncake, 4d).
REPLAYED_TRACES = ("synthetic",)


def run_summary(seeded: Sequence[dict[str, Any]]) -> dict[str, Spread]:
    return {key: Spread.of(r[key] for r in seeded) for key in SUMMARY_KEYS}


SUMMARY_COLUMNS = {  # a run's figure: its column in the tables
    "hit_rate": "hit rate",
    "tokens_computed": "tokens computed",
    "ttft_mean_s": "TTFT mean s",
    "ttft_p90_s": "TTFT P90 s",
    "slo_attainment": "SLO met",
    "rejected": "429s",
    "tokens_transferred": "tokens moved",
}
SUMMARY_KEYS = tuple(SUMMARY_COLUMNS)
TRACE_KEYS = tuple(key for key in SUMMARY_KEYS if key != "rejected")  # a trace replays without 429s


def figures(by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The lecture's four comparisons of one run: cache-aware against random, and replication's traffic."""
    random, aware = by["random"], by["cache-aware"]
    return {
        "hit_rate_ratio": aware["hit_rate"] / random["hit_rate"],
        "computed_tokens_cut": 1 - aware["tokens_computed"] / random["tokens_computed"],
        "ttft_ratio_at_high_load": random["ttft_mean_s"] / aware["ttft_mean_s"],
        "moved_tokens": by["cache-aware + replication"]["tokens_transferred"] if REPLICATING in by else math.nan,
        "hit_rates": {p: r["hit_rate"] for p, r in by.items()},
        "ttfts": {p: r["ttft_mean_s"] for p, r in by.items()},
    }


def ordered(figure: dict[str, Any]) -> bool:
    """Mooncake Fig. 8's order: load balancing alone < cache-aware <= with replication, in hit rate and (the
    other way round) in TTFT."""
    hits, ttfts = figure["hit_rates"], figure["ttfts"]
    blind = ("random", "least-loaded")
    return (
        max(hits[p] for p in blind) < hits["cache-aware"] <= hits["cache-aware + replication"]
        and min(ttfts[p] for p in blind) > ttfts["cache-aware"] >= ttfts["cache-aware + replication"]
    )


def refusals(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Refusing (429) requests predicted to miss the TTFT SLO: how many, and whether every served one met it."""
    return {
        "rejected_share": {p: Spread.of(r["rejected"] / r["requests"] for r in seeded) for p, seeded in runs.items()},
        "longest_served_ttft_s": max(r["ttft_max_s"] for seeded in runs.values() for r in seeded),
    }


LECTURE_TOLERANCE = 0.25  # simulated against simulated: the issue's +-25 %
STREAM_TOLERANCE = 0.05
LECTURE_GLOBAL_CACHE = {"1,000 blocks": 1_000, "10,000 blocks": 10_000, "unbounded": None}
LECTURE_GLOBAL_SPEEDUPS = {"1,000 blocks": 1.46, "10,000 blocks": 2.34, "unbounded": 2.46}  # lecture §8.5
LECTURE_HOURS = {"none": 1.05, "unbounded": 0.42}  # lecture §8.5: prefill GPU hours
SENSITIVITY_REUSE = (2.0, 3.0, 6.0, 8.0)  # requests per reused document, besides the fitted
SENSITIVITY_POLICIES = ("random", "cache-aware")
REFUSING = ("random", "cache-aware")  # the policies run with 429s
REPLICATING = "cache-aware + replication"


def verdicts(results: dict[str, Any]) -> list[Verdict]:
    stream, cache, figure = results["stream"], results["global_cache"], results["figures"]
    refused = results["refusals"]["rejected_share"]
    fitted = results["shapes"][results["seeds"][0]]
    near_two = min(results["sensitivity"], key=lambda row: abs(row["hit_rate_ratio"] - LECTURE["hit_rate_ratio"]))
    the_stream = Comparison("lecture §8.4-8.5", STREAM, stream, STREAM_TOLERANCE)
    hours = Comparison("lecture §8.5 demo 4", LECTURE_HOURS, cache["hours"], GLOBAL_CACHE_TOLERANCE, unit=" h")
    speedups = Comparison(
        "lecture §8.5 demo 4", LECTURE_GLOBAL_SPEEDUPS, cache["speedups"], GLOBAL_CACHE_TOLERANCE, unit="x"
    )
    demo_2 = Comparison("lecture §9.4 demo 2", LECTURE, figure, LECTURE_TOLERANCE)
    rows = [
        the_stream.row(f"the stream: {name.replace('_', ' ')}", name, f"{STREAM[name]:,}", fit=fit)
        for name, fit in STREAM_FITS.items()
    ]
    rows += [
        hours.row(f"prefill GPU hours of its {STREAM['requests']:,} requests, no cache", "none"),
        hours.row("prefill GPU hours, unbounded cache", "unbounded", fit=UNBOUNDED_HOURS_FIT),
        speedups.row("prefill speedup, one global LRU cache of 1,000 blocks", "1,000 blocks", fit=FOLLOW_UP_FIT),
        speedups.row("prefill speedup, one global LRU cache of 10,000 blocks", "10,000 blocks"),
        Comparison("lecture §9.4 demo 2, §12.8", LECTURE, figure, LECTURE_TOLERANCE).row(
            "cache-aware over random: hit rate",
            "hit_rate_ratio",
            "doubles",
            reason=(
                f"with {fitted.reused_requests:.1f} requests per reused document (fitted, with"
                f" {fitted.one_off_share:.0%} of the documents asked once, to the stream's 56 % and 2.46x), a"
                " random placement rarely finds the one instance that holds a document.  Near 2x the stream needs"
                f" about {near_two['shape'].reused_requests:g} requests per reused document, and then its unbounded"
                f" speedup is {near_two['unbounded_speedup']:.2f}x, not 2.46x (sensitivity table 3f): 2x is not"
                " reachable jointly with the lecture's other stream figures."
            ),
        ),
        demo_2.row(
            "cache-aware over random: tokens computed",
            "computed_tokens_cut",
            f"about {LECTURE['computed_tokens_cut']:.0%} fewer",
            percent=True,
        ),
        Verdict(
            f"random over cache-aware: mean TTFT at load {HIGH_LOAD:g}",
            "lecture §9.4 demo 2",
            "more than 10x",
            str(figure["ttft_ratio_at_high_load"]),
            "> 10 (every seed)",
            figure["ttft_ratio_at_high_load"].low > LECTURE["ttft_ratio_at_high_load"],
            reason=(
                f"'high load' is no number in the lecture: {HIGH_LOAD:g}x the cache-less capacity is kvspec's"
                " choice, and the ratio grows steeply with the load (random placement, hitting less, saturates first)."
            ),
        ),
        demo_2.row(
            "tokens moved by replication",
            "moved_tokens",
            f"{LECTURE['moved_tokens'] / 1e6:g} M",
            f"{figure['moved_tokens'].mean / 1e6:.2f} M ± {figure['moved_tokens'].std / 1e6:.2f}",
        ),
        Verdict(
            "blind < cache-aware <= with replication (hit rate; TTFT the other way)",
            "lecture §9.4, Mooncake Fig. 8",
            "ordering",
            f"{sum(results['ordering'])} of {len(results['ordering'])} seeds",
            "every seed",
            all(results["ordering"]),
        ),
        Verdict(
            "the same order on the shipped synthetic trace, replayed at its own timestamps",
            "lecture §9.4, Mooncake Fig. 8 (real trace)",
            "ordering",
            "holds" if all(results["traces_ordered"]) else "does not hold",
            "exact",
            all(results["traces_ordered"]),
        ),
        Verdict(
            "HTTP 429: requests no instance can serve within the SLO are refused, the rest meet it",
            "lecture §9.4",
            "refuse, don't queue",
            f"refused: random {refused['random'].mean:.0%}, cache-aware {refused['cache-aware'].mean:.0%};"
            f" longest TTFT served {results['refusals']['longest_served_ttft_s']:.2f} s",
            f"TTFT <= {TTFT_SLO_S:g} s; cache-aware refuses fewer",
            results["refusals"]["longest_served_ttft_s"] <= TTFT_SLO_S
            and refused["cache-aware"].mean < refused["random"].mean,
        ),
    ]
    return rows


# What makes the stream land on the lecture's figures: each is fitted, so none counts as reproduced.
STREAM_FITS = {
    "mean_input": Fit("fitted", "the documents' lengths are scaled, per seed, until the requests' mean is 8,709."),
    "single_use_blocks": Fit("fitted", "the share of documents asked once is solved per seed for 56 %."),
    "unbounded_speedup": Fit("fitted", "the requests per reused document are solved per seed for 2.46x."),
}
UNBOUNDED_HOURS_FIT = Fit("derived", "the hours without a cache over the unbounded speedup, fitted to 2.46x.")
FOLLOW_UP_FIT = Fit(
    "fitted",
    f"the follow-up delay ({FOLLOW_UP_S:g} s) is calibrated on seed 0 to land on 1.46x (30 s gives 2.0x);"
    " 10,000 blocks' 2.34x is a prediction.",
)
GLOBAL_CACHE_TOLERANCE = 0.1


def print_tables(results: dict[str, Any]) -> None:
    seeds = f"means over seeds {', '.join(map(str, results['seeds']))}"
    print()
    print(
        table(
            ["runs", "policy", *SUMMARY_COLUMNS.values()],
            [
                [group, p, *(s[k].mean for k in SUMMARY_KEYS)]
                for group, by in results["table"].items()
                for p, s in by.items()
            ],
            title=f"3. Conductor: {INSTANCES} prefill instances x {CACHE_BLOCKS:,} blocks, TTFT SLO {TTFT_SLO_S:g} s,"
            f" {results['requests']:,} requests on documents, {seeds}; load {HIGH_LOAD:g} of the cache-less"
            f" capacity (the lecture's trace ran at {results['lecture_load']:.2f})",
        )
    )
    shapes = results["shapes"].values()
    print(
        f"  The stream's shape, fitted per seed: {np.mean([s.one_off_share for s in shapes]):.0%} of the documents"
        f" asked once, the others {np.mean([s.reused_requests for s in shapes]):.2f} times on average."
    )
    cache = results["global_cache"]
    print()
    print(
        table(
            ["global LRU cache", "prefill GPU h", "speedup", "lecture"],
            [["none", cache["hours"]["none"].mean, 1.0, f"{LECTURE_HOURS['none']} h"]]
            + [
                [name, cache["hours"][name].mean, str(cache["speedups"][name]), f"{LECTURE_GLOBAL_SPEEDUPS[name]}x"]
                for name in LECTURE_GLOBAL_CACHE
            ],
            title=f"3b. Lecture §8.5 on the stream: prefill GPU time (LLaMA2-70B on 8 x A800), one global cache, {seeds}",
        )
    )
    print()
    print(
        table(
            ["requests per reused doc", "asked once", "unbounded speedup", "hit rate x", "tokens cut", "TTFT x"],
            [
                [
                    f"{row['shape'].reused_requests:.2f}"
                    + (" (fitted)" if row["shape"] == results["shapes"][results["seeds"][0]] else ""),
                    f"{row['shape'].one_off_share:.0%}",
                    row["unbounded_speedup"],
                    row["hit_rate_ratio"],
                    f"{row['computed_tokens_cut']:.0%}",
                    row["ttft_ratio_at_high_load"],
                ]
                for row in results["sensitivity"]
            ],
            title=f"3f. Sensitivity (seed {results['seeds'][0]}, load {HIGH_LOAD:g}): cache-aware against random as"
            " requests per reused document vary, the one-off share refitted to 56 % single-use blocks",
        )
    )
    if results["traces"]:
        print()
        print(
            table(
                ["stream", "policy", *(SUMMARY_COLUMNS[k] for k in TRACE_KEYS)],
                [[r["stream"], r["policy"], *(r[k] for k in TRACE_KEYS)] for r in results["traces"]],
                title="3c. The shipped synthetic Mooncake trace at its own timestamps (real data: only Fig. 8's order"
                " is a target)",
            )
        )
    print_verdicts(verdicts(results), "Lecture §8.4-8.5 and §9.4 against this run (means over seeds)")
