"""Layer 4 in vLLM v1's shape: a token budget, chunked prefill, recompute-only preemption.

Rules (vLLM v1 ``Scheduler.schedule`` and ``update_from_output``).  The records ``Request``,
``sampled_token`` and ``rank`` are ``kvspec.spec.scheduler``'s; the shape replaces the layer's
step (``kvspec.spec.admission.step``: the decode phase of ``kvspec.spec.preemption``, the admission
phase of ``kvspec.spec.admission``) with
``kvspec.spec.scheduler_v1_model.step``, and keeps the layer's safety rules over memory and
preemption, checked through ``as_layer``:

* **No phases.**  A request has tokens -- its prompt, then one sampled token per step that
  catches it up -- and ``computed`` tokens whose KV is written.  A step hands out at most
  ``token_budget`` tokens in all, each request's share catching its ``computed`` up with its
  tokens: a prefill longer than what is left of the budget is cut (*chunked prefill*), or,
  with ``chunked_prefill`` off, waits whole.  At most ``max_running`` requests run.
* One device: a prefix-caching manager (``kvspec.spec.prefix_cache``, blocks committed as they
  fill); a request holds one sequence, ``(request_id, 0)``.  Parallel samples are sibling
  requests sharing through the cache, so ``n`` is 1; requests arrive ready.  A request must fit
  alone -- ``len(prompt) + max_new_tokens`` tokens in the device, and in one step without
  chunked prefill -- or it is refused (``RequestTooLarge``).
* A step first serves the **running** requests, in the order they were admitted: each takes
  ``min(tokens - computed, budget left)`` tokens, its slots allocated (``append``).  While they
  do not fit, the lowest-ranked running request -- under ``fcfs`` the last admitted, under
  ``priority`` the highest (priority, arrival) -- is **preempted by recompute**: its blocks are
  freed, ``computed`` drops to 0 and it rejoins the waiting queue at its head (``priority``: in
  rank order); a victim already served in this step gives its tokens back to the budget.  A
  request that preempts itself is served nothing: under ``fcfs`` the running pass ends there.
* Then, **only if nobody was preempted**, the waiting queue in order, while budget is left and
  fewer than ``max_running`` run: its head's hits are probed now (``cached_prefix``, capped at
  ``len(tokens) - 1``) and it takes ``min(tokens - hits, budget left)`` tokens -- its prefix to
  there is admitted (``add_sequence``); short of blocks for that prefix, or (``reserve_full_sequence``,
  vLLM's default) for all its tokens, admission stops.
* The forward: each served request's ``computed`` grows by its share; one that caught up with its
  tokens samples the next (``sampled_token``) and, at ``max_new_tokens``, finishes and frees its
  blocks, in the order served.  ``abort(request_id)`` drops an unfinished request and its blocks.

Deadlock freedom.  Under ``fcfs`` the running requests, then the waiting queue, are in arrival
order (a victim is the latest running one, and goes to the head of the queue), so the oldest
unfinished request, when waiting, waits on an idle device and is admitted; running, it is
served first with the whole budget and never preempted (it fits alone).  Once oldest it
finishes within ``ceil(L / T) + M`` steps (``L`` the most tokens of a request, prompt and
output; ``M`` the largest ``max_new_tokens``; ``T`` the budget), so a request that arrives after
step ``a`` with ``k`` unfinished requests, itself included, finishes by ``deadline(a, k, L, M, T)``.

Invariants (tier in brackets):

* ``invariant_token_budget_kept`` [safety] -- a step serves at most ``token_budget`` tokens, each
  share at least one and no more than the tokens its request lacks, and no more requests run than
  ``max_running``.
* ``invariant_kv_holds_computed_tokens`` [safety] -- a running request's KV holds exactly its
  ``computed`` tokens; a waiting one has none computed.
* ``invariant_queue_in_arrival_order`` [convention] -- under ``fcfs``, running then waiting is
  arrival order.
* ``invariant_preemption_stops_admission`` [convention] -- a step that preempts admits nobody.
* ``invariant_budget_scheduler_refines_spec`` [convention] -- the implementation is in the
  model's state, block numbers aside.
* Reused through ``as_layer`` (``kvspec.spec.scheduler``, ``preemption``, ``admission``): memory
  never overcommitted, no leak across preemption, the oldest never preempted (``fcfs``, judged
  while the implementation's running then waiting requests are in arrival order:
  ``in_arrival_order``), a victim keeps no grant (a running request's share is its grant, an
  admission's its prefill), victims rank below survivors, hits probed at admission (the cached
  tokens the manager's plan supplied), finishes within the bound (``fcfs``); and every pool and
  manager rule on the device's memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol, runtime_checkable

import attrs

from kvspec.spec import scheduler
from kvspec.spec.block_manager import ManagerState, SeqId, blocks_for
from kvspec.spec.block_pool import PoolState
from kvspec.spec.components import component_kind, optional_operation
from kvspec.spec.errors import InvalidOperation, RequestTooLarge
from kvspec.spec.invariants import invariant, refinement
from kvspec.spec.scheduler import QueuePolicy, Request, RequestId, sampled_token

Place = Literal["waiting", "running"]


@attrs.frozen
class BudgetConfig:
    token_budget: int  # vLLM's max_num_batched_tokens
    max_running: int  # vLLM's max_num_seqs
    chunked_prefill: bool = True
    reserve_full_sequence: bool = True  # vLLM's scheduler_reserve_full_isl: admit only if all its tokens fit
    policy: QueuePolicy = "fcfs"


class Tracked:
    """What is read of a request the scheduler tracks, whichever record holds it (the spec's ``Entry``, an
    implementation's own): its id, and its one sequence (``n`` is 1)."""

    __slots__ = ()
    request: Request

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id

    @property
    def seq(self) -> SeqId:
        return (self.request.request_id, 0)


@attrs.frozen
class Entry(Tracked):
    """An unfinished request as the scheduler tracks it."""

    request: Request
    arrival: int
    place: Place = "waiting"
    computed: int = 0  # tokens whose KV is written
    generated: int = 0
    preemptions: int = 0

    def tokens(self) -> tuple[int, ...]:
        sampled = (sampled_token(self.request_id, 0, i) for i in range(self.generated))
        return self.request.prompt + tuple(sampled)


@attrs.frozen
class BudgetState:
    """What ``snapshot()`` returns: unfinished requests in arrival order, both queues, the device's memory."""

    config: BudgetConfig
    steps: int
    arrived: tuple[RequestId, ...]
    entries: tuple[Entry, ...]
    running: tuple[RequestId, ...]  # in the order admitted
    waiting: tuple[RequestId, ...]  # in queue order, the head first
    finished: tuple[RequestId, ...]
    memory: ManagerState


@attrs.frozen
class BudgetReport:
    """One step: the tokens served per request (in the order served), victims, admissions, finishes."""

    served: tuple[tuple[RequestId, int], ...] = ()
    preempted: tuple[RequestId, ...] = ()  # by request id
    admitted: tuple[RequestId, ...] = ()
    cached_tokens: tuple[tuple[RequestId, int], ...] = ()  # per admission: prompt tokens the cache supplied
    finished: tuple[RequestId, ...] = ()


@runtime_checkable
class BudgetScheduler(Protocol):
    """``token_budget_scheduler(manager, config)``: ``manager`` an empty ``PrefixCachingManager``."""

    def arrive(self, request: Request) -> None: ...
    def step(self) -> BudgetReport: ...
    def abort(self, request_id: RequestId) -> None: ...
    def snapshot(self) -> BudgetState: ...


class PriorityBudgetScheduler(BudgetScheduler, Protocol):
    """A mode: run with ``config.policy == "priority"``, victims and the waiting queue go by rank."""


TOKEN_BUDGET_SCHEDULER = component_kind(
    "token_budget_scheduler", BudgetScheduler, builds="token_budget_scheduler(manager, config)"
)
PRIORITY = optional_operation("priority", PriorityBudgetScheduler, kinds=(TOKEN_BUDGET_SCHEDULER.name,))


# -- what the model and implementations share -------------------------------------


def check_config(config: object) -> BudgetConfig:
    if not isinstance(config, BudgetConfig) or config.policy not in ("fcfs", "priority"):
        raise InvalidOperation(f"unusable token-budget scheduler config {config!r}")
    for count in (config.token_budget, config.max_running):
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InvalidOperation(f"unusable token-budget scheduler config {config!r}")
    if config.token_budget < config.max_running:
        raise InvalidOperation(f"a budget of {config.token_budget} cannot serve {config.max_running} running requests")
    return config


def check_fits_alone(request: Request, config: BudgetConfig, capacity: int, block_size: int) -> None:
    """A request runs alone to its end: its tokens in the device, and in one step without chunked prefill."""
    longest = len(request.prompt) + request.max_new_tokens
    if blocks_for(longest, block_size) > capacity or (not config.chunked_prefill and longest > config.token_budget):
        raise RequestTooLarge(f"request {request.request_id!r} of up to {longest} tokens could never run alone")


def group(entry: Entry) -> scheduler.Group:
    return scheduler.Group(entry.request, entry.arrival, entry.place, entry.generated, entry.preemptions)


def deadline(
    arrived_after_step: int, unfinished_at_arrival: int, longest: int, longest_output: int, budget: int
) -> int:
    """The step by which a request must be finished under ``fcfs`` (see the module docstring)."""
    return arrived_after_step + unfinished_at_arrival * (-(-longest // budget) + longest_output)


# -- the layer's rules, through its records ----------------------------------------


def as_layer(state: BudgetState) -> scheduler.SchedulerState:
    """The state in the layer's records: its groups, the device as the GPU, an empty CPU."""
    memory = state.memory
    cpu = ManagerState(memory.block_size, PoolState(0, (), (), (), {}), {}, {}, {})
    config = scheduler.SchedulerConfig(preemption="recompute", policy=state.config.policy)
    groups = tuple(group(entry) for entry in state.entries)
    return scheduler.SchedulerState(config, state.steps, state.arrived, groups, state.finished, memory, cpu)


def as_layer_report(report: BudgetReport) -> scheduler.StepReport:
    """The report in the layer's records: the running requests' shares are its grants; an admission's share is
    its prefill, as the layer's admissions are (a victim admitted again in the step is served over new blocks)."""
    return scheduler.StepReport(
        preempted=tuple((rid, "recompute") for rid in report.preempted),
        granted=tuple((rid, share) for rid, share in report.served if rid not in report.admitted),
        admitted=report.admitted,
        cached_tokens=report.cached_tokens,
        finished=report.finished,
    )


# -- invariants ------------------------------------------------------------------


@invariant(
    "a step larger than its budget overruns the batch the model runner was sized for, and a share past "
    "the tokens a request has computes KV for tokens that do not exist",
    "safety",
)
def invariant_token_budget_kept(before: BudgetState, after: BudgetState, report: BudgetReport) -> str | None:
    config, lacking = before.config, {e.request_id: len(e.tokens()) - e.computed for e in before.entries}
    total = sum(share for _, share in report.served)
    if total > config.token_budget:
        return f"the step served {total} tokens, the budget is {config.token_budget}"
    for rid, share in report.served:
        if not 1 <= share <= lacking.get(rid, 0):
            return f"request {rid!r} was served {share} tokens, it lacked {lacking.get(rid, 0)}"
    if len(after.running) > config.max_running:
        return f"{len(after.running)} requests run, at most {config.max_running} may"
    return None


@invariant(
    "recompute is invisible only if a running request's KV is exactly the tokens it computed, and a "
    "preempted one keeps none",
    "safety",
)
def invariant_kv_holds_computed_tokens(state: BudgetState) -> str | None:
    for entry in state.entries:
        if entry.place == "waiting" and entry.computed:
            return f"waiting request {entry.request_id!r} counts {entry.computed} tokens computed"
        held = state.memory.tokens.get(entry.seq)
        if entry.place == "running" and held != entry.tokens()[: entry.computed]:
            return f"running request {entry.request_id!r} computed {entry.computed} tokens, its KV holds {held}"
    return None


@invariant(
    "first come, first served: a victim goes back to the head of the queue, or a later request overtakes "
    "it and the oldest can be preempted",
    "convention",
)
def invariant_queue_in_arrival_order(state: BudgetState) -> str | None:
    if state.config.policy == "fcfs" and not in_arrival_order(state):
        return f"running {list(state.running)} then waiting {list(state.waiting)} is not arrival order"
    return None


def in_arrival_order(state: BudgetState) -> bool:
    """Whether the running requests, then the waiting queue, are in arrival order: under ``fcfs``, the premise of
    deadlock freedom (the oldest is running first, or at the head of the queue)."""
    arrival = {entry.request_id: entry.arrival for entry in state.entries}
    order = [arrival[rid] for rid in (*state.running, *state.waiting)]
    return order == sorted(order)


@invariant("a step that preempted is short of memory: admitting then takes what the victims just gave up", "convention")
def invariant_preemption_stops_admission(report: BudgetReport) -> str | None:
    if report.preempted and report.admitted:
        return f"preempted {list(report.preempted)} and admitted {list(report.admitted)} in one step"
    return None


@attrs.frozen
class View:
    """What refinement compares: everything but which physical blocks hold what."""

    config: BudgetConfig
    steps: int
    arrived: tuple[RequestId, ...]
    entries: tuple[Entry, ...]
    running: tuple[RequestId, ...]
    waiting: tuple[RequestId, ...]
    finished: tuple[RequestId, ...]
    tokens: Mapping[SeqId, tuple[int, ...]]
    blocks_in_use: int


def view(state: BudgetState) -> View:
    pool = state.memory.pool
    return View(
        state.config,
        state.steps,
        state.arrived,
        state.entries,
        state.running,
        state.waiting,
        state.finished,
        dict(state.memory.tokens),
        pool.capacity - pool.num_free,
    )


invariant_budget_scheduler_refines_spec = refinement("invariant_budget_scheduler_refines_spec", view)
