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
requests on documents (mean input 8,709 tokens, 56 % of the blocks seen only
once), at that trace's own rate (24 minutes: about 0.31 of the cache-less
capacity) and at 1.2x the cache-less capacity ("at high load", my choice);
``document_stream`` says how, and ``statistics`` measures the stream against
the lecture's figures, including §8.5's 2.46x prefill-time saving with an
unbounded cache.  Algorithm 1's balancing threshold is not in the lecture: 1.5
is my choice.  The shipped Mooncake traces are replayed at their own
timestamps and at 2x.

Against the lecture (``kvspec repro mooncake`` prints each with its verdict):
tokens computed, TTFT at high load and replication traffic land within the
issue's +-25 % (or past "10x"); cache-aware's hit rate is about 3.5x random's,
not 2x: with about two requests per document a random placement rarely finds
the one instance that holds its document, and the stream has no prefix that
every request shares (the real trace's "blocks used tens of thousands of
times"), which would lift both policies alike.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import attrs
import numpy as np

from kvspec.experiments import trace as traces
from kvspec.experiments.prefix_cache import PrefillModel
from kvspec.impl.block_pool import BlockPool
from kvspec.report import progress, table

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
QUICK_REQUESTS = 800  # what the tests run: the same stream, a fifth of the requests
FOLLOW_UP_S = 30.0  # mean delay of a document's later requests (my choice: "within about a minute")


@attrs.frozen
class Stream:
    name: str
    arrivals_s: tuple[float, ...]
    lengths: tuple[int, ...]
    blocks: tuple[tuple[object, ...], ...]
    requests_per_document: float = 0.0  # mean; 0 for a trace


def document_stream(requests: int = LECTURE_REQUESTS, load: float = 1.0, seed: int = 0) -> Stream:
    """Requests on documents, with the statistics of the lecture's synthetic trace (§8.4).

    A document has a log-normal length (sigma 0.6, clipped to 512..32,000 tokens) and draws a
    geometric number of requests; each request is the document plus a question of its own
    (50..499 tokens), the first at the document's arrival (Poisson) and the others within about a
    minute (exponential delays, mean ``FOLLOW_UP_S``).  The lecture fixes the mean input (8,709
    tokens: the document's mean is that less the question's) and the share of blocks seen only
    once (56 %); the mean number of requests per document is solved from the latter, on the
    drawn lengths, by bisection.  ``load`` is the offered prefill work over the cache-less
    capacity of the ``INSTANCES`` instances.
    """
    rng = np.random.default_rng(seed)
    doc_mean = STREAM["mean_input"] - (QUESTION_TOKENS[0] + QUESTION_TOKENS[1] - 1) / 2
    documents = requests  # at least one request each: enough documents to draw from
    doc_tokens = np.clip(rng.lognormal(np.log(doc_mean) - 0.6**2 / 2, 0.6, documents), BLOCK, 32_000).astype(int)
    uniforms = rng.random(documents)
    questions = rng.integers(*QUESTION_TOKENS, requests)

    def asked(p: float) -> np.ndarray:
        """Requests per document, geometric with success ``p`` (mean 1 / p), the first ``requests`` in all."""
        counts = 1 + np.floor(np.log(uniforms) / np.log1p(-p)).astype(int) if p < 1 else np.ones(documents, int)
        ends = np.cumsum(counts)
        last = int(np.searchsorted(ends, requests))
        counts = counts[: last + 1]
        counts[-1] -= ends[last] - requests
        return counts

    def single_use_share(p: float) -> float:
        counts = asked(p)
        shared = doc_tokens[: len(counts)] // BLOCK
        lengths = np.repeat(doc_tokens[: len(counts)], counts) + questions
        own = -(-lengths // BLOCK) - np.repeat(shared, counts)  # the rest of the document and the question
        return float((shared[counts == 1].sum() + own.sum()) / (shared.sum() + own.sum()))

    low, high = 1e-3, 1.0  # the share grows with p (fewer requests per document)
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (low, middle) if single_use_share(middle) > STREAM["single_use_blocks"] else (middle, high)
    counts = asked(high)
    owners = np.repeat(np.arange(len(counts)), counts)
    lengths = doc_tokens[owners] + questions
    capacity = INSTANCES / cacheless_seconds(lengths)  # requests/s without any cache
    starts = np.cumsum(rng.exponential(requests / (load * capacity * len(counts)), len(counts)))
    delays = rng.exponential(FOLLOW_UP_S, requests)
    delays[np.cumsum(counts) - counts] = 0.0  # each document's first request comes with it
    rows = []
    for r, (d, length) in enumerate(zip(owners.tolist(), lengths.tolist(), strict=True)):
        doc_blocks: list[tuple[object, ...]] = [("doc", d, i) for i in range(doc_tokens[d] // BLOCK)]
        own: list[tuple[object, ...]] = [("q", r, i) for i in range(len(doc_blocks), -(-length // BLOCK))]
        rows.append((float(starts[d] + delays[r]), length, tuple(doc_blocks + own)))
    rows.sort(key=lambda row: row[0])
    return Stream(
        name=f"documents, load {load:.2g}",
        arrivals_s=tuple(row[0] for row in rows),
        lengths=tuple(row[1] for row in rows),
        blocks=tuple(row[2] for row in rows),
        requests_per_document=1 / high,
    )


def cacheless_seconds(lengths: Sequence[int] | np.ndarray) -> float:
    """Mean prefill seconds without a cache (attention is quadratic: not the mean length's time)."""
    return float(np.mean([MODEL.seconds(int(n), 0) for n in lengths]))


def lecture_load() -> float:
    """The load of the lecture's synthetic trace: 4,157 requests in 24 minutes, on ``INSTANCES``."""
    return STREAM["requests"] / STREAM["minutes"] / 60 * cacheless_seconds(document_stream().lengths) / INSTANCES


def statistics(stream: Stream) -> dict[str, float]:
    """The figures §8.4-8.5 give for the lecture's trace, measured on ``stream``."""
    uses = Counter(block for blocks in stream.blocks for block in blocks)
    seen: set[object] = set()
    cacheless = unbounded = 0.0
    for length, blocks in zip(stream.lengths, stream.blocks, strict=True):
        hit = next((i for i, block in enumerate(blocks) if block not in seen), len(blocks))
        seen.update(blocks)
        cacheless += prefill_seconds(length, 0)
        unbounded += prefill_seconds(length, hit)
    return {
        "requests": len(stream.lengths),
        "minutes": stream.arrivals_s[-1] / 60,
        "mean_input": float(np.mean(stream.lengths)),
        "single_use_blocks": sum(1 for n in uses.values() if n == 1) / len(uses),
        "unbounded_speedup": cacheless / unbounded,
        "requests_per_document": stream.requests_per_document,
    }


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

    def prefix(self, blocks: Sequence[object]) -> int:
        """Blocks of ``blocks`` cached here, from the start; touches nothing."""
        for hits, block in enumerate(blocks):
            if self.cache.lookup(block) is None:
                return hits
        return len(blocks)

    def keep(self, blocks: Sequence[object], present: int) -> None:
        """Cache ``blocks``: touch the first ``present``, store the rest (LRU eviction), hold none."""
        held = [block for block in map(self.cache.lookup, blocks[:present]) if block is not None]
        self.cache.share(held)
        missing = blocks[present : present + self.cache.num_free()]
        fresh = self.cache.allocate(len(missing))
        for block, key in zip(fresh, missing, strict=True):
            self.cache.register(block, key)
        self.cache.release((held + fresh)[::-1])


def prefill_seconds(length: int, cached_blocks: int) -> float:
    cached = min(cached_blocks * BLOCK, length - 1)
    return MODEL.seconds(length - cached, cached)


def transfer_seconds(blocks: int) -> float:
    return blocks * BLOCK * MODEL.kv_bytes_per_token / RDMA_BYTES_PER_S


def simulate(stream: Stream, policy: str, reject: bool = False, seed: int = 0) -> dict[str, Any]:
    instances = [Instance() for _ in range(INSTANCES)]
    rng = random.Random(seed)
    ttfts: list[float] = []
    hit_blocks = all_blocks = computed = moved = rejected = 0
    for arrival, length, blocks in zip(stream.arrivals_s, stream.lengths, stream.blocks, strict=True):
        queue = [max(0.0, i.free_at - arrival) for i in instances]
        local = [i.prefix(blocks) for i in instances]
        best = max(local)
        options = []  # (predicted TTFT, instance, blocks reused, blocks pulled)
        for n in range(INSTANCES):
            pull = policy.endswith("replication") and best > THRESHOLD * local[n]
            reused = best if pull else local[n]
            extra = transfer_seconds(best - local[n]) if pull else 0.0
            options.append((queue[n] + extra + prefill_seconds(length, reused), n, reused, reused - local[n]))
        if policy == "random":
            choice = options[rng.randrange(INSTANCES)]
        elif policy == "least-loaded":
            choice = min(options, key=lambda o: (queue[o[1]], o[1]))
        else:
            choice = min(options)
        ttft, n, reused, pulled = choice
        if reject and ttft > TTFT_SLO_S:
            rejected += 1
            continue
        instance = instances[n]
        instance.free_at = arrival + ttft
        instance.keep(blocks, reused - pulled)
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
        "slo_attainment": float((served <= TTFT_SLO_S).mean()) * (len(served) / len(stream.lengths)),
        "rejected": rejected,
        "tokens_transferred": moved,
    }


def _job(kind: str, argument: float, policy: str, reject: bool, scale: int) -> dict[str, Any]:
    if kind == "documents":
        stream = document_stream(requests=scale, load=argument)
    else:
        stream = trace_stream(kind, argument)
    return simulate(stream, policy, reject)


def experiments(quick: bool = False) -> dict[str, Any]:
    """The lecture's stream at its own load (4,157 requests in 24 min) and at ``HIGH_LOAD``."""
    scale = QUICK_REQUESTS if quick else LECTURE_REQUESTS
    loads = (lecture_load(), HIGH_LOAD)
    jobs: dict[str, list[tuple[str, float, str, bool, int]]] = {
        "lecture": [("documents", load, p, False, scale) for load in loads for p in POLICIES],
        "slo_429": [("documents", loads[-1], p, True, scale) for p in POLICIES],
        "traces": [] if quick else [(n, s, p, False, 0) for n in traces.SHIPPED for s in (1.0, 2.0) for p in POLICIES],
    }
    flat = [job for group in jobs.values() for job in group]
    with ProcessPoolExecutor(max_workers=traces.WORKERS) as workers:
        futures = [workers.submit(_job, *job) for job in flat]
        results = [future.result() for future in progress(futures, "conductor runs")]
    out: dict[str, Any] = {"stream": statistics(document_stream(requests=scale, load=loads[0]))}
    start = 0
    for group, members in jobs.items():
        out[group] = results[start : start + len(members)]
        start += len(members)
    out["figures"] = figures(out["lecture"])
    return out


def figures(lecture: list[dict[str, Any]]) -> dict[str, float]:
    """The lecture's four comparisons, at the higher load."""
    by = {r["policy"]: r for r in lecture if r["stream"] == lecture[-1]["stream"]}
    random, aware = by["random"], by["cache-aware"]
    return {
        "hit_rate_ratio": aware["hit_rate"] / random["hit_rate"],
        "computed_tokens_cut": 1 - aware["tokens_computed"] / random["tokens_computed"],
        "ttft_ratio_at_high_load": random["ttft_mean_s"] / aware["ttft_mean_s"],
        "moved_tokens": by["cache-aware + replication"]["tokens_transferred"],
    }


def within(measured: float, published: float, tolerance: float = 0.25) -> bool:
    """The issue's tolerance on a simulated ratio: +-25 % of the published figure."""
    return abs(measured / published - 1) <= tolerance


def print_tables(results: dict[str, Any]) -> None:
    headers = [
        "stream",
        "policy",
        "hit rate",
        "tokens computed",
        "TTFT mean s",
        "TTFT P90 s",
        "SLO met",
        "429s",
        "tokens moved",
    ]
    keys = [
        "stream",
        "policy",
        "hit_rate",
        "tokens_computed",
        "ttft_mean_s",
        "ttft_p90_s",
        "slo_attainment",
        "rejected",
        "tokens_transferred",
    ]
    titles = {
        "lecture": f"3. Conductor: {INSTANCES} prefill instances x {CACHE_BLOCKS:,} blocks, TTFT SLO {TTFT_SLO_S:g} s "
        "(load = offered work over the cache-less prefill capacity; the first is the lecture trace's rate)",
        "slo_429": "3b. The same at the higher load, refusing (429) requests predicted to miss the TTFT SLO",
        "traces": "3c. The shipped Mooncake traces at their own timestamps and at 2x (no target: real data)",
    }
    for group, title in titles.items():
        rows = results[group]
        if rows:
            print()
            print(table(headers, [[r[k] for k in keys] for r in rows], title=title))
    stream = results["stream"]
    print(
        table(
            ["figure", "lecture", "this stream"],
            [[name.replace("_", " "), STREAM[name], stream[name]] for name in STREAM]
            + [["requests per document (solved)", "-", stream["requests_per_document"]]],
            title="3d. The stream against the lecture's synthetic trace (§8.4-8.5; its rate is the first load above)",
        )
    )
    rows = []
    for name, published in LECTURE.items():
        measured = results["figures"][name]
        at_least = name == "ttft_ratio_at_high_load"  # the lecture says "more than an order of magnitude"
        holds = measured > published if at_least else within(measured, published)
        rows.append([name.replace("_", " "), published, measured, "yes" if holds else "NO (ordering only)"])
    print()
    print(
        table(
            ["cache-aware vs random, load " + f"{HIGH_LOAD:g}", "lecture", "measured", "within +-25 %"],
            rows,
            title="3e. Conductor figures (hit rate x2, ~40 % fewer tokens, TTFT > 10x, replication moves 6.8 M)",
        )
    )
