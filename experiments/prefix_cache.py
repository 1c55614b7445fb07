"""Lecture §8 by running the prefix cache: chained hashes, few-shot reuse, prefill time saved.

``kvspec repro prefix-cache [--json] [--seeds N ...]``

1. Chained hashes (B = 4): two requests sharing a system prompt; then one
   token of the system prompt changed (lecture §8.2, exercise 10).
2. Eight requests sharing a few-shot prefix (1-shot 80, 5-shot 341 tokens;
   questions of 10-30 tokens, drawn per seed; B = 16) admitted through the
   reference prefix-caching manager: prefill tokens computed with and without
   the cache (vLLM Figure 16; lecture §8.3 and exercise 7: 536 of 2,888).
3. Both shipped Mooncake traces (FAST'25 release) through one global cache
   of each capacity, LRU and LFU: their statistics, the hit rates, and the
   prefill GPU time for LLaMA2-70B on 8 x A800 with the storage each
   capacity needs (lecture §8.4-8.5).  The lecture's own trace (the arXiv
   release's) is not among them, so its statistics and Table 1's curve are
   printed as not reproduced, with why; its synthetic trace is imitated by
   ``kvspec repro mooncake``'s document stream, which reproduces §8.5's hours
   and speedups.

It closes with the lecture's figures against this run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvspec.experiments import trace as traces
from kvspec.experiments.figures import SEEDS, Spread, as_json, repro_arguments
from kvspec.experiments.verdict_table import Verdict, print_verdicts, verdict_results, within
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import chain
from kvspec.impl.prefix_caching import PrefixCachingBlockManager
from kvspec.report import emit_json, table
from kvspec.spec.block_pool import POLICIES, Policy
from kvspec.spec.prefix_cache import PrefixCachingManager

# -- 1. chained hashes ---------------------------------------------------------------

SYSTEM_PROMPT = tuple(range(101, 111))  # 10 tokens
OPENING = (7, 8)  # both users start the same way: 12 shared tokens = 3 blocks of 4


def chained_hash_demo(block_size: int = 4) -> dict[str, Any]:
    first = SYSTEM_PROMPT + OPENING + (21, 22, 23, 24)
    second = SYSTEM_PROMPT + OPENING + (31, 32, 33, 34)
    changed = list(first)
    changed[5] = 999  # block 1 of the system prompt
    a, b, c = (chain(tokens, block_size) for tokens in (first, second, changed))
    return {
        "block_size": block_size,
        "first": [h.hex()[:12] for h in a],
        "second": [h.hex()[:12] for h in b],
        "first_changed_token_5": [h.hex()[:12] for h in c],
        "shared_blocks": [x == y for x, y in zip(a, b, strict=True)],
        "unchanged_after_edit": [x == y for x, y in zip(a, c, strict=True)],
    }


def exercise_10(blocks: int = 5, changed_block: int = 3, block_size: int = 4) -> list[bool]:
    """Lecture exercise 10: a request of ``blocks`` full blocks with one token of block ``changed_block``
    (1-based) changed: which blocks' hashes change."""
    tokens = list(range(blocks * block_size))
    edited = list(tokens)
    edited[(changed_block - 1) * block_size] = -1
    return [x != y for x, y in zip(chain(tokens, block_size), chain(edited, block_size), strict=True)]


# -- 2. few-shot prefix reuse ---------------------------------------------------------


@attrs.frozen
class FewShot:
    label: str
    prefix_tokens: int
    question_lengths: tuple[int, ...]
    computed: int
    without_cache: int

    @property
    def saved(self) -> float:
        return 1 - self.computed / self.without_cache


def few_shot(
    label: str,
    prefix_tokens: int,
    question_lengths: Sequence[int],
    block_size: int = 16,
    manager_factory: Callable[[int, int], PrefixCachingManager] | None = None,
) -> FewShot:
    """Admit one request per question, each prompt = shared prefix + question, and count computed tokens.

    ``manager_factory(capacity, block_size)`` builds the manager: the reference one by default.
    """
    prefix = list(range(1, prefix_tokens + 1))
    total = sum(prefix_tokens + q for q in question_lengths)
    capacity = 2 * total // block_size + len(question_lengths)
    manager = (manager_factory or _reference_manager)(capacity, block_size)
    computed = 0
    for request, length in enumerate(question_lengths):
        question = [50_000 + 100 * request + i for i in range(length)]
        plan = manager.add_sequence(request, prefix + question)
        computed += prefix_tokens + length - plan.cached_tokens
    return FewShot(label, prefix_tokens, tuple(question_lengths), computed, total)


def _reference_manager(capacity: int, block_size: int) -> PrefixCachingManager:
    return PrefixCachingBlockManager(BlockPool(capacity, "lru"), block_size)


def few_shot_experiment(seed: int, requests: int = 8) -> list[FewShot]:
    rng = np.random.default_rng(seed)
    rows = [
        few_shot(f"{shots}-shot, questions 10-30", tokens, rng.integers(10, 31, size=requests).tolist())
        for shots, tokens in ((1, 80), (5, 341))
    ]
    rows.append(few_shot("5-shot, questions of 20 (exercise 7)", 341, [20] * requests))
    return rows


# -- 3. prefill GPU time (LLaMA2-70B on 8 x A800) -------------------------------------


@attrs.frozen
class PrefillModel:
    """Lecture exercise 8: 137 GFLOP of matmuls per token, attention ~ 4 L d per earlier token, 60 % of peak."""

    linear_flops_per_token: float = 137e9
    layers: int = 80
    d_model: int = 8192
    gpus: int = 8
    peak_flops: float = 312e12  # A800 BF16 dense
    utilisation: float = 0.6
    kv_bytes_per_token: int = 2 * 80 * 8 * 128 * 2  # K and V, 80 layers, 8 KV heads, d_h 128, BF16

    def seconds(self, new_tokens: Any, cached_tokens: Any) -> Any:
        """Prefill of ``new_tokens`` after ``cached_tokens`` of reused prefix (elementwise over arrays)."""
        end = cached_tokens + new_tokens
        attention = 4 * self.layers * self.d_model * (end * (end - 1) - cached_tokens * (cached_tokens - 1)) / 2
        return (self.linear_flops_per_token * new_tokens + attention) / (self.gpus * self.peak_flops * self.utilisation)


def prefill_hours(trace: traces.Trace, hits: Sequence[int], model: PrefillModel) -> float:
    total = 0.0
    for length, hit in zip(trace.input_lengths, hits, strict=True):
        cached = min(hit * traces.BLOCK_TOKENS, length - 1)
        total += model.seconds(length - cached, cached)
    return total / 3600


Replayed = dict[tuple[str, int | None, Policy], tuple[int, ...]]  # (trace, capacity, policy) -> hits per request


def replay_shipped(policies: Sequence[Policy] = POLICIES) -> Replayed:
    """Both shipped traces through one global cache of each of ``traces.CAPACITIES``, under each policy."""
    jobs = [(name, capacity, p) for name in traces.SHIPPED for p in policies for capacity in traces.CAPACITIES]
    return dict(zip(jobs, traces.replay_all(jobs, "replaying the shipped traces"), strict=True))


def hit_rates(replayed: Replayed) -> list[dict[str, Any]]:
    return [
        {
            "trace": name,
            "policy": policy,
            "capacity": capacity,
            "hit_rate": traces.hit_rate(traces.load_once(name), hits),
        }
        for (name, capacity, policy), hits in replayed.items()
    ]


def gpu_time_experiment(model: PrefillModel, replayed: Replayed, policy: Policy = "lru") -> list[dict[str, Any]]:
    block_bytes = model.kv_bytes_per_token * traces.BLOCK_TOKENS
    rows = []
    for name in traces.SHIPPED:
        trace = traces.load_once(name)
        baseline = prefill_hours(trace, (0,) * len(trace.blocks), model)
        stats = traces.statistics(trace)
        rows.append(
            {
                "trace": trace.name,
                "capacity": 0,
                "prefill_gpu_hours": baseline,
                "speedup": 1.0,
                "storage_tb": 0.0,
                "hit_rate": 0.0,
                "first_sightings": stats["distinct_blocks"] / stats["blocks"],
            }
        )
        for capacity in traces.CAPACITIES:
            hits = replayed[(name, capacity, policy)]
            hours = prefill_hours(trace, hits, model)
            stored = stats["distinct_blocks"] if capacity is None else min(capacity, stats["distinct_blocks"])
            rows.append(
                {
                    **rows[-1],
                    "capacity": capacity,
                    "prefill_gpu_hours": hours,
                    "speedup": baseline / hours,
                    "storage_tb": stored * block_bytes / 1e12,
                    "hit_rate": traces.hit_rate(trace, hits),
                }
            )
    return rows


def hit_rate_ceilings(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Lecture §8.4: an unbounded cache's hit rate is set by the blocks seen for the first time -- with chained
    hashes a block seen before comes with its whole prefix, so every later sighting is a hit."""
    return {
        r["trace"]: {"unbounded_hit_rate": r["hit_rate"], "one_less_first_sightings": 1 - r["first_sightings"]}
        for r in rows
        if r["capacity"] is None
    }


# -- the verdicts --------------------------------------------------------------------------------

LECTURE_FEW_SHOT_SAVED = 0.82  # lecture §8.3 demo 2: 5-shot, questions of 10-30 tokens
FEW_SHOT_POINTS = 0.015
A800_HBM_BYTES = 80e9
LECTURE_STORAGE = {"block_mb": 168, "10,000 blocks_tb": 1.68, "machine_hbm_tb": 0.64}  # lecture §8.5


def storage(model: PrefillModel) -> dict[str, float]:
    """Lecture §8.5: a 512-token block of LLaMA2-70B's KV, 10,000 of them, and one 8-GPU machine's HBM."""
    block = model.kv_bytes_per_token * traces.BLOCK_TOKENS
    return {
        "block_mb": block / 1e6,
        "10,000 blocks_tb": 10_000 * block / 1e12,
        "machine_hbm_tb": model.gpus * A800_HBM_BYTES / 1e12,
    }


# Lecture §8.4: the arXiv release's trace (1 hour) and Mooncake Table 1's LRU hit rates of one global cache on it.
LECTURE_TRACE = {"requests": 23_608, "mean_input": 8_590, "mean_output": 182}
LECTURE_LRU_CURVE = {1_000: 0.34, 50_000: 0.55}
CURVE_POINTS = 0.05  # each end of the curve
SATURATION_TOLERANCE = 0.05  # "barely grows past 50,000 blocks": within 5 % of the unbounded hit rate
MOSTLY_SINGLE_USE = 0.5  # "more than half of the blocks are never used again"


def trace_verdicts(stats: dict[str, dict[str, float]], rates: list[dict[str, Any]]) -> list[Verdict]:
    """Lecture §8.4 on the shipped traces: what they are, the LRU curve and its ceiling, LRU against LFU."""
    hit = {(r["trace"], r["policy"], r["capacity"]): r["hit_rate"] for r in rates}
    low, high = LECTURE_LRU_CURVE
    curve = {name: (hit[(name, "lru", low)], hit[(name, "lru", high)]) for name in stats}
    unbounded = {name: hit[(name, "lru", None)] for name in stats}
    lead = {
        "LRU": [(n, c) for (n, p, c), rate in hit.items() if p == "lru" and rate > hit[(n, "lfu", c)]],
        "LFU": [(n, c) for (n, p, c), rate in hit.items() if p == "lru" and rate < hit[(n, "lfu", c)]],
    }
    return [
        Verdict(
            "the lecture's trace: requests in an hour, mean input, mean output",
            "lecture §8.4 (Mooncake's arXiv trace)",
            ", ".join(f"{n:,}" for n in LECTURE_TRACE.values()),
            "; ".join(
                f"{name} {s['requests']:,} in {s['duration_s'] / 60:.0f} min, {s['mean_input']:,.0f},"
                f" {s['mean_output']:,.0f} (a block used {s['most_uses']:,} times at most)"
                for name, s in stats.items()
            ),
            "exact, some shipped trace",
            any(tuple(round(s[k]) for k in LECTURE_TRACE) == tuple(LECTURE_TRACE.values()) for s in stats.values()),
            reason=(
                "the lecture's trace is the arXiv release's, which the FAST'25 release shipped here does not hold"
                " (experiments/data/README.md); the shipped traces are measured instead, and they are the ones"
                " FAST'25 Table 2 describes (next row)."
            ),
        ),
        Verdict(
            "the shipped traces: requests, mean input, mean output",
            "Mooncake FAST'25 Table 2",
            "; ".join(f"{name} " + ", ".join(f"{n:,}" for n in traces.TABLE_2[name]) for name in stats),
            "; ".join(
                f"{name} {s['requests']:,}, {s['mean_input']:,.0f}, {s['mean_output']:,.0f}"
                for name, s in stats.items()
            ),
            "exact (means rounded)",
            all(traces.matches_table_2(name, s) for name, s in stats.items()),
        ),
        Verdict(
            "more than half of the blocks are never used again",
            "lecture §8.4",
            f"> {MOSTLY_SINGLE_USE:.0%}",
            ", ".join(f"{name} {s['seen_once_share']:.0%}" for name, s in stats.items()),
            f"> {MOSTLY_SINGLE_USE:.0%}, every shipped trace",
            all(s["seen_once_share"] > MOSTLY_SINGLE_USE for s in stats.values()),
        ),
        Verdict(
            f"LRU hit rate of one global cache, {low:,} -> {high:,} blocks",
            "lecture §8.4, Mooncake Table 1",
            " -> ".join(f"{rate:.2f}" for rate in LECTURE_LRU_CURVE.values()),
            ", ".join(f"{name} {a:.3f} -> {b:.3f}" for name, (a, b) in curve.items()),
            f"each end +-{CURVE_POINTS:.2f}, some shipped trace",
            any(
                abs(a - LECTURE_LRU_CURVE[low]) <= CURVE_POINTS and abs(b - LECTURE_LRU_CURVE[high]) <= CURVE_POINTS
                for a, b in curve.values()
            ),
            reason=(
                "Table 1 replays the lecture's (arXiv) trace, which is not shipped; on the shipped traces the"
                " curve rises to their own ceilings, 1 - the share of first sightings: "
                + ", ".join(f"{name} {rate:.3f}" for name, rate in unbounded.items())
                + " (the ceiling's row checks them)."
            ),
        ),
        Verdict(
            f"... and barely grows past {high:,} blocks",
            "lecture §8.4",
            "flat",
            ", ".join(f"{name} {curve[name][1]:.3f} of {rate:.3f}" for name, rate in unbounded.items()),
            f"within {SATURATION_TOLERANCE:.0%} of the unbounded, every shipped trace",
            all(within(curve[name][1], rate, SATURATION_TOLERANCE) for name, rate in unbounded.items()),
        ),
        Verdict(
            "LRU beats LFU",
            "lecture §8.4, §13 pitfall 10, Mooncake Table 1",
            "LRU higher",
            f"LRU higher at {len(lead['LRU'])} of {len(lead['LRU']) + len(lead['LFU'])} (trace, capacity) where"
            " they differ",
            "LRU >= LFU at every capacity, every shipped trace",
            not lead["LFU"],
            reason=(
                f"on the shipped traces it holds at some capacities only: LRU is higher at {_places(lead['LRU'])},"
                f" LFU at {_places(lead['LFU'])} (they are equal where the cache holds every block reused).  The"
                " lecture's and Table 1's comparison is on the arXiv trace, which is not shipped."
            ),
        ),
    ]


def _places(places: Sequence[tuple[str, int | None]]) -> str:
    by_trace: dict[str, list[str]] = {}
    for name, capacity in places:
        by_trace.setdefault(name, []).append("unbounded" if capacity is None else f"{capacity:,}")
    return "; ".join(f"{name} {', '.join(capacities)}" for name, capacities in by_trace.items()) or "none"


def verdicts(results: dict[str, Any]) -> list[Verdict]:
    demo, shots, sizes, ceilings = (results[k] for k in ("chained_hashes", "few_shot", "storage", "ceilings"))
    five_shot = Spread.of(run[1].saved for run in shots)
    one_shot = Spread.of(run[0].saved for run in shots)
    exercise = shots[0][2]
    return [
        Verdict(
            "two requests sharing a system prompt and opening share blocks 1-3, not block 4",
            "lecture §8.2 demo 1",
            "3 shared",
            str(demo["shared_blocks"]),
            "exact",
            demo["shared_blocks"] == [True, True, True, False],
        ),
        Verdict(
            "one token of block 2 changed: that block's hash and every later one change",
            "lecture §8.2 demo 1",
            "block 2 on",
            str([not same for same in demo["unchanged_after_edit"]]),
            "exact",
            demo["unchanged_after_edit"] == [True, False, False, False],
        ),
        Verdict(
            "exercise 10: a token of block 3 of 5 changed",
            "lecture §14 exercise 10",
            "blocks 3, 4, 5 change",
            str(results["exercise_10"]),
            "exact",
            results["exercise_10"] == [False, False, True, True, True],
        ),
        Verdict(
            "exercise 7: 5-shot prefix of 341, 8 requests, 20-token questions",
            "lecture §14 exercise 7",
            "536 of 2,888 computed (81 %)",
            f"{exercise.computed} of {exercise.without_cache:,} ({exercise.saved:.0%})",
            "exact",
            (exercise.computed, exercise.without_cache) == (536, 2888),
        ),
        Verdict(
            "5-shot, questions of 10-30 tokens: prefill tokens saved",
            "lecture §8.3 demo 2",
            f"{LECTURE_FEW_SHOT_SAVED:.0%}",
            five_shot.percent(),
            f"+-{100 * FEW_SHOT_POINTS:.1f} points (mean)",
            abs(five_shot.mean - LECTURE_FEW_SHOT_SAVED) <= FEW_SHOT_POINTS,
        ),
        Verdict(
            "a longer shared prefix saves more: 5-shot against 1-shot",
            "lecture §8.3",
            "more",
            f"{five_shot.mean:.0%} against {one_shot.mean:.0%}",
            "every seed",
            all(run[1].saved > run[0].saved for run in shots),
        ),
        Verdict(
            "an unbounded cache's hit rate = 1 - blocks seen for the first time (the ceiling)",
            "lecture §8.4, §13 pitfall 7",
            "set by first sightings",
            "; ".join(
                f"{name} {c['unbounded_hit_rate']:.4f} = {c['one_less_first_sightings']:.4f}"
                for name, c in ceilings.items()
            ),
            "exact, every shipped trace",
            all(math.isclose(c["unbounded_hit_rate"], c["one_less_first_sightings"]) for c in ceilings.values()),
        ),
        *trace_verdicts(results["trace_statistics"], results["hit_rates"]),
        Verdict(
            "a 512-token block of LLaMA2-70B KV; 10,000 of them; the HBM of one 8-GPU machine",
            "lecture §8.5",
            "168 MB; 1.68 TB; 0.64 TB",
            f"{sizes['block_mb']:.0f} MB; {sizes['10,000 blocks_tb']:.2f} TB; {sizes['machine_hbm_tb']:.2f} TB",
            "as rounded",
            (round(sizes["block_mb"]), round(sizes["10,000 blocks_tb"], 2), round(sizes["machine_hbm_tb"], 2))
            == tuple(LECTURE_STORAGE.values()),
        ),
    ]


def run(seeds: Sequence[int] = SEEDS) -> dict[str, Any]:
    model = PrefillModel()
    results: dict[str, Any] = {
        "chained_hashes": chained_hash_demo(),
        "exercise_10": exercise_10(),
        "few_shot": [few_shot_experiment(seed) for seed in seeds],
        "seeds": list(seeds),
        "storage": storage(model),
        "trace_statistics": {name: traces.statistics(traces.load_once(name)) for name in traces.SHIPPED},
    }
    replayed = replay_shipped()
    results["hit_rates"] = hit_rates(replayed)
    results["prefill_gpu_time"] = gpu_time_experiment(model, replayed)
    results["ceilings"] = hit_rate_ceilings(results["prefill_gpu_time"])
    return results | verdict_results(verdicts(results))


def main(argv: list[str]) -> int:
    args = repro_arguments("prefix-cache", __doc__).parse_args(argv)
    results = run(args.seeds)
    if args.json:
        emit_json(
            as_json(
                {
                    **results,
                    "few_shot": [[attrs.asdict(r) | {"saved": r.saved} for r in rows] for rows in results["few_shot"]],
                }
            )
        )
        return 0
    demo = results["chained_hashes"]
    rows = [
        [i, demo["first"][i], demo["second"][i], demo["shared_blocks"][i], demo["first_changed_token_5"][i]]
        for i in range(len(demo["first"]))
    ]
    title = "1. chained block hashes, B = 4 (token 5 -- block 1 -- changed in the last column)"
    print(table(["block", "request A", "request B", "A = B", "A, token 5 changed"], rows, title=title))
    print(f"Exercise 10: a token of block 3 of 5 changed; hashes changed: {results['exercise_10']}")
    print()
    shots = results["few_shot"]
    print(
        table(
            ["experiment", "prefix", "requests", "computed", "without cache", "saved %", "saved % over seeds"],
            [
                [
                    r.label,
                    r.prefix_tokens,
                    len(r.question_lengths),
                    r.computed,
                    r.without_cache,
                    100 * r.saved,
                    Spread.of(run[i].saved for run in shots).percent(),
                ]
                for i, r in enumerate(shots[0])
            ],
            title=f"2. few-shot prefix reuse, B = 16 (prefill tokens; seed {results['seeds'][0]}, and the mean over"
            f" seeds {', '.join(map(str, results['seeds']))})",
        )
    )
    print()
    stats = results["trace_statistics"]
    print(
        table(
            ["trace", "requests", "minutes", "mean input", "mean output", "blocks seen once", "most uses of a block"],
            [
                [name, s["requests"], s["duration_s"] / 60, s["mean_input"], s["mean_output"]]
                + [s["seen_once_share"], s["most_uses"]]
                for name, s in stats.items()
            ],
            title="3. the shipped Mooncake traces (FAST'25 release; the lecture's arXiv trace is not among them)",
        )
    )
    hit = {(r["trace"], r["policy"], r["capacity"]): r["hit_rate"] for r in results["hit_rates"]}
    columns = [(name, policy) for name in stats for policy in POLICIES]
    print()
    print(
        table(
            ["capacity (blocks)", *(f"{name} {policy}" for name, policy in columns)],
            [
                ["unbounded" if c is None else f"{c:,}", *(hit[(name, policy, c)] for name, policy in columns)]
                for c in traces.CAPACITIES
            ],
            title="3a. hit rate of one global cache (blocks hit before the first miss / all blocks)",
        )
    )
    print()
    gpu = results["prefill_gpu_time"]
    print(
        table(
            ["trace", "capacity (blocks)", "hit rate", "prefill GPU h", "speedup", "storage TB"],
            [
                [
                    r["trace"],
                    "none" if r["capacity"] == 0 else "unbounded" if r["capacity"] is None else f"{r['capacity']:,}",
                    r["hit_rate"],
                    r["prefill_gpu_hours"],
                    r["speedup"],
                    r["storage_tb"],
                ]
                for r in gpu
            ],
            title=f"3b. prefill GPU time of the shipped traces, LLaMA2-70B on 8 x A800, LRU; one 512-token block = "
            f"{results['storage']['block_mb']:.0f} MB (the lecture's synthetic trace: kvspec repro mooncake, 3b)",
        )
    )
    print_verdicts(results["verdicts"], "Lecture §8 against this run")
    return 0
