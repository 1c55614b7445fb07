"""Lecture §7 (code 03, demos 1-2): how much faster paging serves, from one iteration-level simulator.

``kvspec repro serving [--json] [--plot FILE]`` prints the mean normalized
latency (end-to-end latency / output tokens, ms per token, as vLLM Fig. 12)
against the arrival rate for three ways of managing KV memory, then bisects
each one's highest rate with a mean of at most 50 ms per token.

The simulator here is the one every serving figure of kvspec comes from
(``kvspec repro fragmentation`` and ``kvspec repro preemption`` use it too):

* Deployment, derived: OPT-13B (40 layers, hidden 5,120, vocabulary 50,272,
  FP16) on one A100-40GB.  Its matmul weights are 12 L h^2 + h V parameters,
  25.68 GB (lecture §1: 26 GB); a token's K and V take 2 L h 2 = 819,200 B;
  vLLM gives the weights and KV 90 % of the GPU and keeps the rest for
  activations, so the KV cache holds floor((0.9 x 40e9 - weights) / 819,200)
  = 12,596 token slots (lecture §3.3).
* Time, per iteration: decode reads the weights and the KV of every token in
  the cache at the A100's 1.555 TB/s; prefill (new prompts and recomputed
  ones) costs 2 FLOPs per weight per token at 60 % of 312 TFLOPS.
* Workloads: lengths log-normal (sigma 1), clipped to OPT's 2,048-token
  context and rescaled so that the clipped means are ShareGPT's 161 in / 338
  out (vLLM §6.1) or Alpaca's 19 / 58; Poisson arrivals; seeded.
* Servers, each iteration-level and FCFS (Orca's scheduling): *Paged* is the
  project's scheduler over its block manager (B = 16: 787 blocks, recompute,
  1 % watermark); *Oracle* reserves prompt + true output length and *Max*
  reserves 2,048 slots, both in the buddy allocator of
  ``kvspec.spec.contiguous`` (a reservation never runs out, so they never
  preempt; a request waits until its whole region fits).

The paper's runs are an hour of a trace on the real system; here a few
hundred requests keep the command under a minute, so the knee is as sharp as
that many requests make it.
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvspec.impl import reference
from kvspec.report import emit_json, progress, pyplot, table
from kvspec.spec.contiguous import ContiguousAllocator, Ledger, Placement, Reservation, reserved_slots
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.scheduler import Request, Scheduler, SchedulerConfig, StepReport

LAYERS, HIDDEN, VOCAB, FP16 = 40, 5120, 50_272, 2  # OPT-13B
PARAMETERS = 12 * LAYERS * HIDDEN**2 + HIDDEN * VOCAB  # biases, norms and positions add 0.1 %
WEIGHT_BYTES = FP16 * PARAMETERS
KV_BYTES_PER_TOKEN = 2 * LAYERS * HIDDEN * FP16  # 819,200 (lecture exercise 1)
GPU_BYTES = 40e9  # A100-40GB
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share for weights and KV; the rest is for activations
KV_SLOTS = math.floor((GPU_MEMORY_UTILIZATION * GPU_BYTES - WEIGHT_BYTES) / KV_BYTES_PER_TOKEN)
MAX_LENGTH = 2048  # OPT's context: what Orca (Max) reserves
MATMUL_FLOPS_PER_TOKEN = 2 * PARAMETERS
A100_FLOPS, UTILISATION, A100_HBM_BYTES_PER_S = 312e12, 0.6, 1.555e12
BLOCK_SIZE = 16  # vLLM's default

SHAREGPT, ALPACA = (161, 338), (19, 58)  # mean input and output tokens (vLLM §6.1)
LEDGER_SHARES = ("tokens", "reserved", "internal", "external", "free")
LATENCY_BUDGET_MS = 50.0  # per output token: the lecture's bar for "the highest rate served" (demo 2)
PAPER_RATE_RATIOS = {"Oracle": (1.7, 2.7), "Max": (2.7, 8.0)}  # vLLM §6.2: Paged's rate over each, on ShareGPT


# -- workloads ---------------------------------------------------------------------------


def lognormal_workload(count: int, seed: int, means: tuple[int, int] = SHAREGPT) -> list[tuple[int, int]]:
    """(input, output) lengths: log-normal (sigma 1), scaled so that after clipping to the
    2,048-token context the sample means are exactly ``means``."""
    rng = np.random.default_rng(seed)
    prompts = clipped_lognormal(rng, means[0], count, np.full(count, MAX_LENGTH - 1))
    outputs = clipped_lognormal(rng, means[1], count, MAX_LENGTH - prompts)
    return list(zip(prompts.tolist(), outputs.tolist(), strict=True))


def sharegpt_like(count: int, seed: int) -> list[tuple[int, int]]:
    return lognormal_workload(count, seed, SHAREGPT)


def alpaca_like(count: int, seed: int) -> list[tuple[int, int]]:
    return lognormal_workload(count, seed, ALPACA)


def clipped_lognormal(rng: np.random.Generator, mean: float, count: int, upper: np.ndarray) -> np.ndarray:
    draws = rng.lognormal(0.0, 1.0, count)
    scale = mean / draws.mean()
    for _ in range(50):  # clipping lowers the mean: rescale until the clipped sample has the target mean
        lengths = np.clip(np.round(draws * scale), 1, upper).astype(int)
        if abs(lengths.mean() - mean) < 0.05:
            break
        scale *= mean / lengths.mean()
    return lengths


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Arrival times at ``rate`` per second; one seed gives the same gaps, scaled, at every rate."""
    gaps = np.random.default_rng(seed).standard_exponential(count)
    return (np.cumsum(gaps) / rate).tolist()


def request(request_id: int, prompt_len: int, output_len: int) -> Request:
    """A request whose prompt is ``prompt_len`` tokens: only lengths matter to memory and time."""
    prompt = tuple(range(prompt_len))
    return Request(request_id, prompt, output_len)  # type: ignore[arg-type]  # mypy cannot type attrs' tuple converter


# -- time ---------------------------------------------------------------------------------


def step_seconds(kv_tokens_read: int, prefill_tokens: int) -> float:
    decode = (WEIGHT_BYTES + kv_tokens_read * KV_BYTES_PER_TOKEN) / A100_HBM_BYTES_PER_S
    return decode + prefill_tokens * MATMUL_FLOPS_PER_TOKEN / (A100_FLOPS * UTILISATION)


# -- servers ------------------------------------------------------------------------------


class Server(Protocol):
    name: str

    def arrive(self, request_id: int, prompt_len: int, output_len: int) -> None: ...
    def step(self) -> StepReport: ...
    def kv_tokens_read(self) -> int: ...  # what this iteration's decode reads
    def ledger(self) -> Ledger: ...
    def held_slots(self) -> int: ...
    def waiting(self) -> int: ...  # arrived requests not running: memory is what they wait for


class PagedServer:
    """The project's FCFS scheduler over its block manager: vLLM."""

    name = "Paged"

    def __init__(
        self, slots: int = KV_SLOTS, block_size: int = BLOCK_SIZE, implementation: Implementation | None = None
    ) -> None:
        impl = (implementation or reference()).complete_with(reference())
        assert impl.scheduler is not None and impl.block_manager is not None and impl.block_pool is not None
        self.slots, self.block_size = slots, block_size
        blocks = slots // block_size
        self.scheduler: Scheduler = impl.scheduler(
            impl.block_manager(impl.block_pool(blocks, "lru"), block_size),
            impl.block_manager(impl.block_pool(1, "lru"), block_size),
            SchedulerConfig(preemption="recompute", watermark=blocks // 100),
        )
        self.pool = self.scheduler.gpu.pool
        self.lengths: dict[int, int] = {}  # tokens so far (prompt + generated) of every unfinished request
        self.running: set[int] = set()

    def arrive(self, request_id: int, prompt_len: int, output_len: int) -> None:
        self.scheduler.arrive(request(request_id, prompt_len, output_len))
        self.lengths[request_id] = prompt_len

    def step(self) -> StepReport:
        report = self.scheduler.step()
        self.running -= {rid for rid, _ in report.preempted}
        for rid in self.running:  # every running group that was not preempted decoded one token
            self.lengths[rid] += 1
        for rid in report.finished:
            self.running.discard(rid)
            del self.lengths[rid]
        self.running.update(report.admitted)
        return report

    def kv_tokens_read(self) -> int:
        return (self.pool.capacity - self.pool.num_free()) * self.block_size  # the kernel walks whole blocks

    def waiting(self) -> int:
        return len(self.lengths) - len(self.running)

    def held_slots(self) -> int:
        return self.kv_tokens_read() + (self.scheduler.cpu.pool.capacity - self.scheduler.cpu.pool.num_free())

    def ledger(self) -> Ledger:
        tokens = sum(self.lengths[rid] for rid in self.running)
        allocated = self.kv_tokens_read()
        return Ledger(
            tokens=tokens,
            reserved=0,
            internal=allocated - tokens,  # the unfilled tail of each sequence's last block
            external=self.slots - self.pool.capacity * self.block_size,  # slots too few to make a block
            free=self.pool.num_free() * self.block_size,
        )


class ContiguousServer:
    """Orca: each request reserves one contiguous region at admission and keeps it to the end."""

    def __init__(
        self,
        reservation: Reservation,
        placement: Placement = "buddy",
        slots: int = KV_SLOTS,
        max_length: int = MAX_LENGTH,
        implementation: Implementation | None = None,
    ) -> None:
        impl = (implementation or reference()).complete_with(reference())
        assert impl.contiguous_allocator is not None
        self.name = {"max": "Max", "exact": "Oracle"}[reservation]
        self.reservation, self.max_length = reservation, max_length
        self.arena: ContiguousAllocator = impl.contiguous_allocator(slots, placement)
        self.waiting_requests: deque[tuple[int, int, int]] = deque()
        self.running: dict[int, list[int]] = {}  # request -> [prompt, output, generated]
        self.tokens = 0

    def arrive(self, request_id: int, prompt_len: int, output_len: int) -> None:
        self.waiting_requests.append((request_id, prompt_len, output_len))

    def step(self) -> StepReport:
        finished = []
        for rid, request in list(self.running.items()):
            self.arena.append(rid, 1)
            request[2] += 1
            if request[2] == request[1]:
                self.arena.free(rid)
                del self.running[rid]
                self.tokens -= request[0] + request[1]
                finished.append(rid)
        decoded = len(finished) + len(self.running)
        self.tokens += len(self.running)
        admitted, prefill = [], 0
        while self.waiting_requests:  # FCFS: nobody overtakes a request whose region does not fit yet
            rid, prompt, output = self.waiting_requests[0]
            try:
                self.arena.allocate(rid, reserved_slots(self.reservation, prompt, output, self.max_length))
            except OutOfBlocks:
                break
            self.waiting_requests.popleft()
            self.arena.append(rid, prompt)
            self.running[rid] = [prompt, output, 0]
            self.tokens += prompt
            admitted.append(rid)
            prefill += prompt
        return StepReport(
            admitted=tuple(admitted), finished=tuple(finished), decode_tokens=decoded, prefill_tokens=prefill
        )

    def kv_tokens_read(self) -> int:
        return self.tokens

    def waiting(self) -> int:
        return len(self.waiting_requests)

    def held_slots(self) -> int:
        return sum(region.size for region in self.arena.snapshot().regions)

    def ledger(self) -> Ledger:
        return self.arena.ledger({rid: prompt + output for rid, (prompt, output, _) in self.running.items()})


POLICIES: dict[str, Callable[[], Server]] = {
    "Paged": PagedServer,
    "Oracle": lambda: ContiguousServer("exact"),
    "Max": lambda: ContiguousServer("max"),
}


# -- the simulator ----------------------------------------------------------------------------


def simulate(
    server: Server, workload: Sequence[tuple[int, int]], arrivals: Sequence[float], track_ledger: bool = False
) -> dict[str, Any]:
    """Serve ``workload`` arriving at ``arrivals`` one iteration at a time; what it took, and where memory went."""
    count = len(workload)
    order = sorted(range(count), key=lambda i: arrivals[i])
    finish = [0.0] * count
    clock, arrived, finished = 0.0, 0, 0
    totals = {"steps": 0, "batched": 0, "preemptions": 0, "recomputed_tokens": 0}
    ledger_sums = {"all iterations": np.zeros(6), "memory-bound": np.zeros(6)}  # the five shares, and a count
    while finished < count:
        if finished == arrived:  # nothing unfinished: the GPU idles until the next arrival
            clock = max(clock, arrivals[order[arrived]])
        while arrived < count and arrivals[order[arrived]] <= clock:
            rid = order[arrived]
            server.arrive(rid, *workload[rid])
            arrived += 1
        report = server.step()
        clock += step_seconds(server.kv_tokens_read(), report.prefill_tokens + report.recomputed_tokens)
        for rid in report.finished:
            finish[rid] = clock
        finished += len(report.finished)
        totals["steps"] += 1
        totals["batched"] += report.decode_tokens + len(report.admitted)
        totals["preemptions"] += len(report.preempted)
        totals["recomputed_tokens"] += report.recomputed_tokens
        if track_ledger:
            ledger = server.ledger()
            shares = np.array([ledger.tokens, ledger.reserved, ledger.internal, ledger.external, ledger.free, 1])
            ledger_sums["all iterations"] += shares
            if server.waiting():
                ledger_sums["memory-bound"] += shares
    input_tokens = sum(p for p, _ in workload)
    normalized = [(finish[i] - arrivals[i]) / workload[i][1] for i in range(count)]
    run: dict[str, Any] = {
        "policy": server.name,
        "requests": count,
        "steps": totals["steps"],
        "makespan_s": clock,
        "throughput_rps": count / clock,
        "mean_normalized_latency_ms": 1e3 * float(np.mean(normalized)),
        "mean_batched_requests": totals["batched"] / totals["steps"],
        "preemptions": totals["preemptions"],
        "recomputed_tokens": totals["recomputed_tokens"],
        "input_tokens": input_tokens,
        "recomputed_over_input": totals["recomputed_tokens"] / input_tokens,
        "leaked_slots": server.held_slots(),
    }
    if track_ledger:
        run["ledger"] = {
            over: dict(zip(LEDGER_SHARES, (sums[:5] / max(sums[5], 1) / KV_SLOTS).tolist(), strict=True))
            for over, sums in ledger_sums.items()
        }
        run["memory_bound_share_of_iterations"] = ledger_sums["memory-bound"][5] / totals["steps"]
    return run


def serve(
    policy: str, workload: Sequence[tuple[int, int]], rate: float, seed: int, track_ledger: bool = False
) -> dict[str, Any]:
    """``policy`` serving ``workload`` at ``rate`` req/s (``math.inf``: everything queued at time 0)."""
    arrivals = [0.0] * len(workload) if math.isinf(rate) else poisson_arrivals(len(workload), rate, seed)
    return {"rate_rps": rate, **simulate(POLICIES[policy](), workload, arrivals, track_ledger)}


# -- demos 1-2: latency against rate, and the highest rate within the budget ----------------------


def latency_curves(workload: Sequence[tuple[int, int]], rates: Sequence[float], seed: int) -> list[dict[str, Any]]:
    jobs = [(policy, rate) for policy in POLICIES for rate in rates]
    return [serve(policy, workload, rate, seed) for policy, rate in progress(jobs, "latency vs rate")]


def highest_rate_within_budget(
    policy: str, workload: Sequence[tuple[int, int]], low: float, high: float, seed: int, steps: int
) -> float:
    """Bisect the highest rate whose mean normalized latency is within ``LATENCY_BUDGET_MS``."""
    for _ in range(steps):
        middle = (low + high) / 2
        if serve(policy, workload, middle, seed)["mean_normalized_latency_ms"] <= LATENCY_BUDGET_MS:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def sustainable_rates(
    curves: list[dict[str, Any]], workload: Sequence[tuple[int, int]], seed: int, steps: int
) -> dict[str, float]:
    """Bisect between the grid's last rate within the budget and its first rate over it."""
    found = {}
    for policy in progress(list(POLICIES), "bisection"):
        points = [(r["rate_rps"], r["mean_normalized_latency_ms"]) for r in curves if r["policy"] == policy]
        low = max((rate for rate, ms in points if ms <= LATENCY_BUDGET_MS), default=0.0)
        high = min((rate for rate, ms in points if ms > LATENCY_BUDGET_MS and rate > low), default=2 * low)
        found[policy] = highest_rate_within_budget(policy, workload, low, high, seed, steps)
    return found


DEFAULT_RATES = (0.5, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5)


def run(
    count: int = 400, seed: int = 0, rates: Sequence[float] = DEFAULT_RATES, bisection_steps: int = 5
) -> dict[str, Any]:
    workload = sharegpt_like(count, seed)
    curves = latency_curves(workload, rates, seed)
    highest = sustainable_rates(curves, workload, seed, bisection_steps)
    ratios = {other: highest["Paged"] / highest[other] for other in ("Oracle", "Max")}
    return {
        "requests": count,
        "kv_slots": KV_SLOTS,
        "latency_budget_ms": LATENCY_BUDGET_MS,
        "curves": curves,
        "highest_rate_rps": highest,
        "paged_rate_over": ratios,
        "paper_paged_rate_over": PAPER_RATE_RATIOS,
    }


def plot(curves: list[dict[str, Any]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(6, 4))
    for policy in POLICIES:
        points = [r for r in curves if r["policy"] == policy]
        axes.plot(
            [r["rate_rps"] for r in points], [r["mean_normalized_latency_ms"] for r in points], marker="o", label=policy
        )
    axes.axhline(LATENCY_BUDGET_MS, color="grey", linestyle=":", label=f"{LATENCY_BUDGET_MS:.0f} ms/token")
    axes.set(
        xlabel="request rate (req/s)",
        ylabel="normalized latency (ms/token)",
        yscale="log",
        title="OPT-13B, A100-40GB, ShareGPT-like (cf. vLLM Fig. 12)",
    )
    axes.legend()
    figure.savefig(path, bbox_inches="tight")
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvspec repro serving", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the same numbers as JSON")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="req/s")
    parser.add_argument("--plot", type=Path, help="write latency vs rate here (needs matplotlib)")
    args = parser.parse_args(argv)
    results = run(args.requests, args.seed, args.rates)
    if args.json:
        emit_json(results)
        return 0
    latency = {(r["policy"], r["rate_rps"]): r["mean_normalized_latency_ms"] for r in results["curves"]}
    print(
        table(
            ["rate req/s", *POLICIES],
            [[rate, *(latency[(policy, rate)] for policy in POLICIES)] for rate in args.rates],
            title=(
                f"Demo 1: mean normalized latency, ms/token ({results['requests']:,} ShareGPT-like requests,"
                f" OPT-13B on A100-40GB, {KV_SLOTS:,} KV slots)"
            ),
        )
    )
    highest = results["highest_rate_rps"]
    print()
    print(
        table(
            ["policy", "highest rate req/s", "Paged / this", "paper (vLLM §6.2)"],
            [
                [policy, highest[policy], highest["Paged"] / highest[policy], _paper_range(policy)]
                for policy in POLICIES
            ],
            title=f"Demo 2: highest rate with mean latency <= {LATENCY_BUDGET_MS:.0f} ms/token (bisected)",
        )
    )
    if args.plot:
        print(
            f"\nplot: {args.plot}"
            if plot(results["curves"], args.plot)
            else "\nplot skipped: matplotlib is not installed"
        )
    return 0


def _paper_range(policy: str) -> str:
    if policy not in PAPER_RATE_RATIOS:
        return "1"
    low, high = PAPER_RATE_RATIOS[policy]
    return f"{low}-{high}x"
