"""Lecture §8 by running the prefix cache: chained hashes, few-shot reuse, prefill time saved.

``kvspec repro prefix-cache [--json] [--seed N]``

1. Chained hashes (B = 4): two requests sharing a system prompt; then one
   token of the system prompt changed (lecture §8.2, exercise 10).
2. Eight requests sharing a few-shot prefix (1-shot 80, 5-shot 341 tokens;
   questions of 10-30 tokens; B = 16) admitted through the reference
   prefix-caching manager: prefill tokens computed with and without the cache
   (vLLM Figure 16; lecture §8.3 and exercise 7: 536 of 2,888 computed).
3. Prefill GPU time of both Mooncake traces for LLaMA2-70B on 8 x A800 at
   each cache capacity, and the storage each capacity needs (lecture §8.5).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvspec.experiments import trace as traces
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
        rows.append(
            {"trace": trace.name, "capacity": 0, "prefill_gpu_hours": baseline, "speedup": 1.0, "storage_tb": 0.0}
        )
        for capacity in traces.CAPACITIES:
            hours = prefill_hours(trace, replayed[(name, capacity, policy)], model)
            distinct = len({b for r in trace.blocks for b in r})
            stored = distinct if capacity is None else min(capacity, distinct)
            rows.append(
                {
                    "trace": trace.name,
                    "capacity": capacity,
                    "prefill_gpu_hours": hours,
                    "speedup": baseline / hours,
                    "storage_tb": stored * block_bytes / 1e12,
                }
            )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvspec repro prefix-cache", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="question lengths of the few-shot experiment")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = PrefillModel()
    demo = chained_hash_demo()
    shots = few_shot_experiment(args.seed)
    gpu = gpu_time_experiment(model)
    if args.json:
        emit_json(
            {
                "chained_hashes": demo,
                "few_shot": [attrs.asdict(r) | {"saved": r.saved} for r in shots],
                "block_bytes": model.kv_bytes_per_token * traces.BLOCK_TOKENS,
                "prefill_gpu_time": gpu,
            }
        )
        return 0
    rows = [
        [i, demo["first"][i], demo["second"][i], demo["shared_blocks"][i], demo["first_changed_token_5"][i]]
        for i in range(len(demo["first"]))
    ]
    title = "1. chained block hashes, B = 4 (token 5 -- block 1 -- changed in the last column)"
    print(table(["block", "request A", "request B", "A = B", "A, token 5 changed"], rows, title=title))
    print()
    print(
        table(
            ["experiment", "prefix", "requests", "computed", "without cache", "saved %"],
            [
                [r.label, r.prefix_tokens, len(r.question_lengths), r.computed, r.without_cache, 100 * r.saved]
                for r in shots
            ],
            title="2. few-shot prefix reuse, B = 16 (prefill tokens)",
        )
    )
    print()
    print(
        table(
            ["trace", "capacity (blocks)", "prefill GPU h", "speedup", "storage TB"],
            [
                [
                    r["trace"],
                    "none" if r["capacity"] == 0 else "unbounded" if r["capacity"] is None else f"{r['capacity']:,}",
                    r["prefill_gpu_hours"],
                    r["speedup"],
                    r["storage_tb"],
                ]
                for r in gpu
            ],
            title=f"3. prefill GPU time, LLaMA2-70B on 8 x A800, LRU; one 512-token block = "
            f"{model.kv_bytes_per_token * traces.BLOCK_TOKENS / 1e6:.0f} MB",
        )
    )
    return 0
