"""Lecture §8 by running the prefix cache: chained hashes, few-shot reuse, prefill time saved.

``kvspec repro prefix-cache [--json] [--seeds N ...]``

1. Chained hashes (B = 4): two requests sharing a system prompt; then one
   token of the system prompt changed (lecture §8.2, exercise 10).
2. Eight requests sharing a few-shot prefix (1-shot 80, 5-shot 341 tokens;
   questions of 10-30 tokens, drawn per seed; B = 16) admitted through the
   reference prefix-caching manager: prefill tokens computed with and without
   the cache (vLLM Figure 16; lecture §8.3 and exercise 7: 536 of 2,888).
3. Prefill GPU time of both Mooncake traces for LLaMA2-70B on 8 x A800 at
   each cache capacity, the hit rate and the storage each capacity needs
   (lecture §8.4-8.5; the lecture's own synthetic trace is imitated by
   ``kvspec repro mooncake``'s document stream, which reproduces §8.5's
   hours and speedups).

It closes with the lecture's figures against this run.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvspec.experiments import trace as traces
from kvspec.experiments.figures import SEEDS, Spread, Verdict, as_json, print_verdicts
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import chain
from kvspec.impl.prefix_caching import PrefixCachingBlockManager
from kvspec.report import emit_json, table
from kvspec.spec.block_pool import Policy
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


def gpu_time_experiment(model: PrefillModel, policy: Policy = "lru") -> list[dict[str, Any]]:
    block_bytes = model.kv_bytes_per_token * traces.BLOCK_TOKENS
    jobs = [(name, capacity, policy) for name in traces.SHIPPED for capacity in traces.CAPACITIES]
    replayed = dict(zip(jobs, traces.replay_all(jobs, "prefill time"), strict=True))
    rows = []
    for name in traces.SHIPPED:
        trace = traces.load(name)
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
        "prefill_gpu_time": gpu_time_experiment(model),
    }
    results["ceilings"] = hit_rate_ceilings(results["prefill_gpu_time"])
    results["verdicts"] = verdicts(results)
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvspec repro prefix-cache", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=list(SEEDS), help="question lengths of the few-shot runs"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
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
            title=f"3. prefill GPU time of the shipped traces, LLaMA2-70B on 8 x A800, LRU; one 512-token block = "
            f"{results['storage']['block_mb']:.0f} MB (the lecture's synthetic trace: kvspec repro mooncake, 3b)",
        )
    )
    print_verdicts(results["verdicts"], "Lecture §8 against this run")
    return 0
