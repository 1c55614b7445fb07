"""Lecture §6: swap vs recompute, overload with recompute, and why preemption avoids deadlock.

``kvspec repro preemption [--json]`` prints three tables, every figure computed here:

1. The swap-vs-recompute cost model of lecture §6.2 / exercise 6 for OPT-13B
   (40 layers, hidden 5120, FP16), over block sizes 1..256, and the crossover.
   Assumptions: PCIe 25 GB/s effective and 10 us per copy (the lecture's);
   each layer's K and V in separate blocks, so a sequence of b blocks takes
   40 x 2 x b copies; recompute is a prefill at 60 % of the A100's 312 TFLOPS
   (the utilisation lecture exercise 8 assumes), counting 2 FLOPs per weight
   of the 40 layers and the LM head (vocabulary 50,272) per token plus causal
   attention (4 x layers x hidden FLOPs per earlier position).  That gives
   142.8 ms for 1,024 tokens against the lecture's 143.77 ms (0.7 % apart).
2. Overload (lecture §6.3): 1,500 ShareGPT-like requests on OPT-13B / A100-40GB
   (12,596 token slots, B = 16: 787 blocks; 1 % watermark), preempting by
   recompute, at arrival rates from just above capacity to heavy overload.
   Lengths are log-normal (sigma 1), clipped to [1, 2048] and to 2,048 tokens
   in all (OPT's context), scaled so that the clipped sample means are
   ShareGPT's 161 (input) and 338 (output) as in the vLLM paper; arrivals
   are Poisson; seeded.  Time advances per iteration by a step-time model:
   decode reads the 26 GB of weights and every held KV slot (819,200 B) at the
   A100's 1.555 TB/s; prefill (new prompts and recomputation) costs the matmul
   FLOPs per token at 60 % of 312 TFLOPS.  Capacity is the throughput with
   every request queued at time 0; rates are multiples of it (``--multiples``).
3. Lecture exercise 12: arrivals that deadlock a scheduler without preemption
   complete under FCFS preemption, within the spec's step bound.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import numpy as np

from kvspec.experiments.report import emit_json, progress, table
from kvspec.impl import reference
from kvspec.impl.broken.scheduler import NeverPreempts
from kvspec.impl.scheduler import Scheduler
from kvspec.spec.scheduler import Request, SchedulerConfig, deadline

LAYERS, HIDDEN, VOCAB, FP16 = 40, 5120, 50_272, 2  # OPT-13B
KV_BYTES_PER_TOKEN = 2 * LAYERS * HIDDEN * FP16  # 819,200 (lecture exercise 1)
WEIGHT_BYTES = 26e9  # lecture §1: OPT-13B's weights on the A100
PCIE_BYTES_PER_S = 25e9
COPY_OVERHEAD_S = 10e-6
A100_FLOPS, UTILISATION, A100_HBM_BYTES_PER_S = 312e12, 0.6, 1.555e12
TOKEN_SLOTS = 12_596  # lecture §3.3 / exercise 1: KV slots of OPT-13B on an A100-40GB
LECTURE_RECOMPUTE_1024_MS = 143.77  # lecture exercise 6
MATMUL_FLOPS_PER_TOKEN = 2 * (12 * LAYERS * HIDDEN**2 + HIDDEN * VOCAB)
MEAN_INPUT, MEAN_OUTPUT, CONTEXT = 161, 338, 2048  # ShareGPT as in the vLLM paper (§6.1); OPT's context
DEFAULT_MULTIPLES = (0.9, 1.1, 1.5, 4.0)  # one below capacity shows where preemption starts


# -- 1. swap vs recompute ------------------------------------------------------------------


def bytes_per_copy(block_size: int) -> int:
    """One layer's K (or V) of one block."""
    return block_size * HIDDEN * FP16


def seconds_per_copy(block_size: int) -> float:
    return COPY_OVERHEAD_S + bytes_per_copy(block_size) / PCIE_BYTES_PER_S


def copies(tokens: int, block_size: int) -> int:
    return LAYERS * 2 * math.ceil(tokens / block_size)


def swap_out_seconds(tokens: int, block_size: int) -> float:
    return copies(tokens, block_size) * seconds_per_copy(block_size)


def recompute_seconds(tokens: int) -> float:
    """Prefill of ``tokens``: matmuls per token plus causal attention over the earlier positions."""
    attention = 4 * LAYERS * HIDDEN * tokens * (tokens + 1) // 2
    return (tokens * MATMUL_FLOPS_PER_TOKEN + attention) / (A100_FLOPS * UTILISATION)


def swap_table(tokens: int = 1024, block_sizes: Sequence[int] = tuple(2**i for i in range(9))) -> dict:
    recompute_ms = recompute_seconds(tokens) * 1e3
    rows = []
    for b in block_sizes:
        out_ms = swap_out_seconds(tokens, b) * 1e3
        rows.append(
            {
                "block_size": b,
                "bytes_per_copy": bytes_per_copy(b),
                "us_per_copy": seconds_per_copy(b) * 1e6,
                "copies": copies(tokens, b),
                "swap_out_ms": out_ms,
                "swap_out_in_ms": 2 * out_ms,
                "recompute_ms": recompute_ms,
                "faster": "swap" if 2 * out_ms < recompute_ms else "recompute",
            }
        )
    first_swap = next((i for i, r in enumerate(rows) if r["faster"] == "swap"), None)
    crossover = None if not first_swap else (rows[first_swap - 1]["block_size"], rows[first_swap]["block_size"])
    return {"tokens": tokens, "recompute_ms": recompute_ms, "rows": rows, "crossover_between": crossover}


# -- 2. overload ------------------------------------------------------------------------------


def sharegpt_like(count: int, seed: int) -> list[tuple[int, int]]:
    """(input, output) lengths: log-normal (sigma 1), scaled so that after clipping to OPT's
    2,048-token context the sample means are exactly ShareGPT's 161 and 338."""
    rng = np.random.default_rng(seed)
    prompts = _clipped_lognormal(rng, MEAN_INPUT, count, np.full(count, CONTEXT - 1))
    outputs = _clipped_lognormal(rng, MEAN_OUTPUT, count, CONTEXT - prompts)
    return list(zip(prompts.tolist(), outputs.tolist(), strict=True))


def _clipped_lognormal(rng: np.random.Generator, mean: float, count: int, upper: np.ndarray) -> np.ndarray:
    draws = rng.lognormal(0.0, 1.0, count)
    scale = mean / draws.mean()
    for _ in range(50):  # clipping lowers the mean: rescale until the clipped sample has the target mean
        lengths = np.clip(np.round(draws * scale), 1, upper).astype(int)
        if abs(lengths.mean() - mean) < 0.05:
            break
        scale *= mean / lengths.mean()
    return lengths


def step_seconds(held_tokens: int, prefill_tokens: int) -> float:
    decode = (WEIGHT_BYTES + held_tokens * KV_BYTES_PER_TOKEN) / A100_HBM_BYTES_PER_S
    return decode + prefill_tokens * MATMUL_FLOPS_PER_TOKEN / (A100_FLOPS * UTILISATION)


def serve(lengths: Sequence[tuple[int, int]], arrival_times: Sequence[float], block_size: int = 16) -> dict:
    impl = reference()
    blocks = TOKEN_SLOTS // block_size
    scheduler = impl.scheduler(
        impl.block_manager(impl.block_pool(blocks, "lru"), block_size),
        impl.block_manager(impl.block_pool(1, "lru"), block_size),
        SchedulerConfig(preemption="recompute", watermark=blocks // 100),
    )
    pending = sorted(range(len(lengths)), key=lambda i: arrival_times[i])
    clock, nxt, totals = 0.0, 0, {"preemptions": 0, "recomputed_tokens": 0, "steps": 0, "finished": 0}
    while totals["finished"] < len(lengths):
        if totals["finished"] == nxt:  # nothing unfinished: the GPU idles until the next arrival
            clock = max(clock, arrival_times[pending[nxt]])
        while nxt < len(pending) and arrival_times[pending[nxt]] <= clock:
            rid = pending[nxt]
            prompt_len, output_len = lengths[rid]
            scheduler.arrive(Request(rid, tuple(range(prompt_len)), output_len))
            nxt += 1
        gpu = scheduler.gpu.pool
        report = scheduler.step()
        held = (gpu.capacity - gpu.num_free()) * block_size
        clock += step_seconds(held, report.prefill_tokens + report.recomputed_tokens)
        totals["steps"] += 1
        totals["preemptions"] += len(report.preempted)
        totals["recomputed_tokens"] += report.recomputed_tokens
        totals["finished"] += len(report.finished)
    leaked = gpu.capacity - gpu.num_free() + scheduler.cpu.pool.capacity - scheduler.cpu.pool.num_free()
    input_tokens = sum(p for p, _ in lengths)
    return {
        **totals,
        "input_tokens": input_tokens,
        "recomputed_over_input": totals["recomputed_tokens"] / input_tokens,
        "makespan_s": clock,
        "throughput_rps": len(lengths) / clock,
        "leaked_blocks": leaked,
    }


def overload(count: int = 1500, seed: int = 0, multiples: Sequence[float] = DEFAULT_MULTIPLES) -> dict:
    lengths = sharegpt_like(count, seed)
    saturated = serve(lengths, [0.0] * count)
    capacity = saturated["throughput_rps"]
    runs = []
    for multiple in progress(list(multiples), "overload runs"):
        rng = np.random.default_rng(seed + 1)
        times = np.cumsum(rng.exponential(1 / (multiple * capacity), count)).tolist()
        runs.append({"rate_rps": multiple * capacity, "times_capacity": multiple, **serve(lengths, times)})
    runs.append({"rate_rps": math.inf, "times_capacity": math.inf, **saturated})
    mean_in = sum(p for p, _ in lengths) / count
    mean_out = sum(o for _, o in lengths) / count
    return {"requests": count, "mean_input": mean_in, "mean_output": mean_out, "capacity_rps": capacity, "runs": runs}


# -- 3. exercise 12 ---------------------------------------------------------------------------


def exercise_12(max_steps: int = 100) -> dict:
    """Two requests that fit alone (6 of 8 blocks at their longest) but not together."""
    requests = [Request(i, tuple(range(12)), 12) for i in range(2)]
    impl = reference()
    outcomes = []
    for name, scheduler_class in (("no preemption", NeverPreempts), ("FCFS preemption", Scheduler)):
        scheduler = scheduler_class(
            impl.block_manager(impl.block_pool(8, "lru"), 4), impl.block_manager(impl.block_pool(8, "lru"), 4)
        )
        for request in requests:
            scheduler.arrive(request)
        finished_at: dict[int, int] = {}
        preemptions, stalled_since = 0, None
        for step in range(1, max_steps + 1):
            report = scheduler.step()
            preemptions += len(report.preempted)
            finished_at.update({rid: step for rid in report.finished})
            progressed = report.decode_tokens or report.admitted or report.finished
            stalled_since = None if progressed else (stalled_since or step)
            if len(finished_at) == len(requests):
                break
        bound = max(deadline(0, len(requests), r.max_new_tokens) for r in requests)
        outcomes.append(
            {
                "scheduler": name,
                "finished": len(finished_at),
                "last_finish_step": max(finished_at.values(), default=None),
                "spec_bound": bound,
                "preemptions": preemptions,
                "stalled_since_step": stalled_since,
                "gpu_blocks_in_use": 8 - scheduler.gpu.pool.num_free(),
            }
        )
    return {
        "gpu_blocks": 8,
        "block_size": 4,
        "prompt": 12,
        "max_new_tokens": 12,
        "steps_run": max_steps,
        "runs": outcomes,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvspec repro preemption", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the same numbers as JSON")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--multiples",
        type=float,
        nargs="+",
        default=list(DEFAULT_MULTIPLES),
        help="arrival rates, as multiples of capacity",
    )
    args = parser.parse_args(argv)
    results = {
        "swap_vs_recompute": swap_table(),
        "overload": overload(args.requests, args.seed, args.multiples),
        "exercise_12": exercise_12(),
    }
    if args.json:
        emit_json(results)
        return 0
    swap = results["swap_vs_recompute"]
    print(
        table(
            ["B", "bytes/copy", "us/copy", "copies", "out ms", "out+in ms", "recompute ms", "faster"],
            [list(r.values()) for r in swap["rows"]],
            title=f"Swap vs recompute, OPT-13B, {swap['tokens']:,} tokens (crossover between B = {swap['crossover_between']})",
        )
    )
    load = results["overload"]
    print()
    print(
        table(
            [
                "rate req/s",
                "x capacity",
                "preemptions",
                "recomputed tok",
                "input tok",
                "recomputed/input",
                "makespan s",
                "leaked blocks",
                "finished",
            ],
            [
                [
                    r["rate_rps"],
                    r["times_capacity"],
                    r["preemptions"],
                    r["recomputed_tokens"],
                    r["input_tokens"],
                    r["recomputed_over_input"],
                    r["makespan_s"],
                    r["leaked_blocks"],
                    r["finished"],
                ]
                for r in load["runs"]
            ],
            title=(
                f"Overload, {load['requests']:,} requests (mean input {load['mean_input']:.1f}, output {load['mean_output']:.1f}),"
                f" recompute, capacity {load['capacity_rps']:.2f} req/s"
            ),
        )
    )
    ex12 = results["exercise_12"]
    print()
    print(
        table(
            [
                "scheduler",
                "finished",
                "last finish step",
                "spec bound",
                "preemptions",
                "stalled since step",
                "GPU blocks in use",
            ],
            [list(r.values()) for r in ex12["runs"]],
            title=f"Exercise 12: 2 requests of 12 + 12 tokens, GPU of 8 blocks of 4, {ex12['steps_run']} steps at most",
        )
    )
    return 0
