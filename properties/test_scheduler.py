"""Layer 4 conformance: the scheduler against ``kvspec.spec.scheduler``'s model.

Tiny GPU and CPU pools (a few blocks of 1-4 tokens) make preemption the
common case; requests of one to three samples arrive, are aborted, and the
scheduler steps, preempting by recompute (``SchedulerMachine``) or by swap
(``SwapSchedulerMachine``, which recomputes when the CPU is full).  After
every operation the pool and manager invariants hold on both devices, the
scheduler's own invariants and ``kvspec.spec.admission``'s hold, and the
state is the model's (block numbers aside).  ``DeadlockFreedomMachine`` runs
the implementation alone, with no model to follow, for long stretches: every
accepted request fits the GPU alone, so each must finish by the deadline
``kvspec.spec.preemption.deadline`` states.

The engine-shaped machines run the scheduler over prefix-caching managers
(``CachedSchedulerMachine``: prompts cut from three documents, so admissions
hit, and every admission reports the cached tokens its own manager supplied)
and under the priority policy (``PrioritySchedulerMachine``: victims that
arrived first, grants given back); in both, requests may arrive not ready
and are marked ready later.

Safety is judged on the implementation: its snapshots, its step reports, the
plans its manager answered, and the caller's ledger of what it was answered
(the requests the implementation accepted and when, the transfers it showed
in flight).  Search revisits, in every lockstep machine: ``retry_refused``
sends again the last call the implementation refused (or an accepted request
under its id again); ``arrive_earlier_prompt`` admits an earlier request's
prompt under a new id -- while the first is unfinished, after it finished,
and (over the cache) after its blocks were evicted.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
from hypothesis import event, target
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.spec import admission, block_manager, block_pool, kv_transfer, preemption, prefix_cache, sample_groups, swap
from kvspec.spec import scheduler as model
from kvspec.spec.errors import RequestTooLarge
from kvspec.spec.invariants import invariant_result_matches_spec
from kvspec.spec.kv_transfer import OUTCOMES
from kvspec.spec.preemption import SWAP_PREEMPTION
from kvspec.spec.prefix_cache import max_hit_blocks
from kvspec.spec.scheduler import (
    LoadFailure,
    Preemption,
    QueuePolicy,
    Request,
    SchedulerConfig,
    SchedulerState,
    StepReport,
    invariant_scheduler_refines_spec,
    rank,
)

CPU_BLOCKS, BLOCK_SIZES = st.integers(1, 6), st.integers(1, 4)
CachedBlocks = tuple[tuple[int, bool], ...]  # the blocks a prefill would share, each with whether it is free


def cached_blocks(state: model.Model, group: model.Group) -> CachedBlocks:
    refcounts = model.tables_of(state.gpu).pool.refcounts
    return tuple((block, refcounts[block] == 0) for block in admission.prefix_hits(state.gpu, group.request.prompt))


def victims_with_grants(state: model.Model) -> set[int]:
    """The requests a step from ``state`` preempts after granting them their tokens: the decode phase's grants
    (``preemption.grant_decodes``) replayed one by one, to see which a victim held when it was taken."""
    granted: dict[int, int] = {}  # request -> the blocks its grant takes
    taken = set()
    for group in [g for g in state.groups if g.location == "running"]:
        if model.find(state, group.request.request_id).location != "running":
            continue
        demand = preemption.decode_demand(state.gpu, group)
        while sum(granted.values()) + demand > model.free_blocks(state.gpu):
            victim = max((g for g in state.groups if g.location == "running"), key=model.ranking(state))
            state, _ = preemption.preempt(state, victim)
            if granted.pop(victim.request.request_id, None) is not None:
                taken.add(victim.request.request_id)
            if victim.request.request_id == group.request.request_id:
                break
        else:
            granted[group.request.request_id] = demand
    return taken


def answered(plans: list[tuple[Any, int]]) -> dict[int, int]:
    """The cached tokens a manager's plans supplied each request's admission: its first sequence's (a group's
    other samples fork from it)."""
    supplied: dict[int, int] = {}
    for seq, cached in plans:
        supplied.setdefault(seq[0], cached)
    return supplied


def watch_plans(manager: Any, plans: list[tuple[Any, int]]) -> None:
    """Record in ``plans`` the cached tokens of every plan ``manager`` answers an admission with: the scheduler
    reports its own probe's, and the manager may tell it otherwise (a value it memoized).  Nothing is recorded
    of a manager that takes no attribute of ours, or that the scheduler does not call (vLLM's scheduler runs
    its own): no admission is judged by ``invariant_hits_probed_at_admission`` then."""
    add_sequence = manager.add_sequence

    def recorded(seq: Any, *args: Any, **kwargs: Any) -> Any:
        plan = add_sequence(seq, *args, **kwargs)
        plans.append((seq, plan.cached_tokens))
        return plan

    with contextlib.suppress(AttributeError):
        manager.add_sequence = recorded


GPU_BLOCKS, WATERMARKS = st.integers(3, 8), st.integers(0, 2)
FAILURES: st.SearchStrategy[LoadFailure] = st.sampled_from(["recompute", "abort"])  # what a failed load does


def opening(gpu_blocks: st.SearchStrategy[int]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A lockstep scheduler machine's ``@initialize``: the devices' sizes, the watermark and what a failed load
    does, drawn alike for every machine but the GPU's size (a machine's opening may need room)."""
    return initialize(
        cpu_blocks=CPU_BLOCKS,
        block_size=BLOCK_SIZES,
        gpu_blocks=gpu_blocks,
        watermark=WATERMARKS,
        load_failure=FAILURES,
        data=st.data(),
    )


class SchedulerMachineBase(LockstepMachine):
    """Builds the scheduler under test and checks every invariant that needs no model."""

    uses = frozenset({"block_pool", "block_manager", "scheduler"})
    judges: ClassVar[tuple[str, ...]] = (
        "scheduler",
        "preemption",
        "admission",
        "sample_groups",
        "kv_transfer",
        "block_manager",
        "block_pool",
        "invariants",
    )

    preemption: ClassVar[Preemption] = "recompute"
    policy: ClassVar[QueuePolicy] = "fcfs"
    samples: ClassVar[st.SearchStrategy[int]] = st.integers(1, 3)
    readiness: ClassVar[st.SearchStrategy[bool]] = st.just(True)  # False: the request arrives not ready
    batches_not_ready: ClassVar[bool] = False  # arrivals come, as often as not, in batches not ready
    priorities: ClassVar[st.SearchStrategy[int]] = st.just(0)
    caching: ClassVar[bool] = False  # both devices' managers cache prefixes
    transfers: ClassVar[bool] = False  # requests load their prompts' KV from elsewhere, or send theirs on finish
    finish_apart: ClassVar[bool] = False  # a group's samples may stop at lengths of their own

    @initialize(cpu_blocks=CPU_BLOCKS, block_size=BLOCK_SIZES, gpu_blocks=GPU_BLOCKS, watermark=WATERMARKS)
    def start(
        self,
        gpu_blocks: int,
        cpu_blocks: int,
        block_size: int,
        watermark: int,
        preemption: Preemption | None = None,
        load_failure: LoadFailure = "recompute",
    ) -> None:
        preemption = preemption or self.preemption
        fork = self.conventions.manager.fork_partial_block  # the managers it builds fork as declared
        self.config = SchedulerConfig(preemption, watermark, self.policy, load_failure, fork)
        self.record(f"scheduler(gpu_blocks={gpu_blocks}, cpu_blocks={cpu_blocks}, B={block_size}, {self.config})")
        scheduler = self.implementation.scheduler(
            self.device(gpu_blocks, block_size), self.device(cpu_blocks, block_size), self.config
        )
        self.scheduler = self.subject("scheduler", None, None, scheduler)
        self.sizes = (gpu_blocks, cpu_blocks, block_size)
        self.next_id = 0
        self.arrivals: dict[int, tuple[int, int]] = {}  # request -> (step it arrived after, unfinished then)
        self.longest = 0  # the largest max_new_tokens accepted so far: M of the deadline
        self.preemptions: Counter[Preemption] = Counter()
        self.fit_alone = True  # every request the implementation accepted fits the GPU alone, by the caller's sums
        self.bounded = self.policy == "fcfs"  # the deadline holds under fcfs while every request arrives ready
        self.in_flight: dict[int, tuple[str, frozenset[int]]] = {}  # transfers: direction, blocks when they began
        self.read: SchedulerState  # its state, read at ``read_at`` calls (``state``)
        self.read_at = self.checked_at = -1  # the count of calls at its last read, and when its rules were checked

    def device(self, capacity: int, block_size: int) -> Any:
        """One device's block manager, as the scheduler under test gets it."""
        impl = self.implementation
        manager = impl.prefix_caching_manager if self.caching else impl.block_manager
        return manager(impl.block_pool(capacity, "lru"), block_size)

    def draw_prompt(self, data: st.DataObject) -> tuple[int, ...]:
        prompt_len = data.draw(st.integers(1, 2 * self.sizes[2]), label="prompt_len")
        return tuple(data.draw(st.lists(st.integers(0, 9), min_size=prompt_len, max_size=prompt_len), label="prompt"))

    def draw_request(self, data: st.DataObject, ready: bool | None = None, priority: int | None = None) -> Request:
        """Sizes in blocks, so that two or three requests overfill the GPU and preemption is common; ready and of
        the priority the arguments say, or as drawn."""
        prompt = self.draw_prompt(data)
        max_new_tokens = data.draw(st.integers(1, 3 * self.sizes[2]), label="max_new_tokens")
        manager = "prefix_caching_manager" if self.caching else "block_manager"
        n = data.draw(self.samples if self.offers(manager, block_manager.FORK) else st.just(1), label="n")
        priority = data.draw(self.priorities, label="priority") if priority is None else priority
        readiness = self.readiness if ready is None else st.just(ready)
        readiness = readiness if self.offers("scheduler", admission.NOT_READY) else st.just(True)
        ready = data.draw(readiness, label="ready")
        apart = n > 1 and self.finish_apart and data.draw(st.booleans(), label="samples finish apart")
        stops = (
            data.draw(st.lists(st.integers(1, max_new_tokens), min_size=n, max_size=n), label="stops") if apart else []
        )
        self.next_id += 1
        if self.transfers and self.offers("scheduler", kv_transfer.KV_TRANSFER):
            remote = data.draw(st.booleans(), label="prompt computed elsewhere")
            sends = data.draw(st.booleans(), label="sends its KV on finish")
            return kv_transfer.TransferRequest(
                self.next_id, prompt, max_new_tokens, n, priority, ready, tuple(stops), remote, sends
            )
        return Request(self.next_id, prompt, max_new_tokens, n, priority, ready, stops=tuple(stops))

    def accepted(self, request: Request) -> None:
        """The implementation took ``request``: its deadline counts from the implementation's own state now."""
        state = self.state()
        self.arrivals[request.request_id] = (state.steps, len(state.groups))
        self.longest = max(self.longest, request.max_new_tokens)
        gpu_blocks, _, block_size = self.sizes
        self.fit_alone = self.fit_alone and model.peak_blocks(request, block_size) <= gpu_blocks
        transfers = isinstance(request, kv_transfer.TransferRequest) and (request.remote_prompt or request.sends_kv)
        self.bounded = self.bounded and self.fit_alone and request.ready and not transfers
        event("arrival accepted" if request.ready else "arrival accepted, not ready")

    def state(self) -> SchedulerState:
        """The implementation's state, read once between two calls: this machine changes it by calls alone."""
        if self.read_at != self.calls:
            self.read, self.read_at = self.scheduler.impl.snapshot(), self.calls
        return self.read

    def stepped(self, before: SchedulerState, report: StepReport) -> SchedulerState:
        """The step's rules, and the state after it (its rules checked)."""
        after = self.check_state()
        # the oldest is safe from preemption under fcfs when it fits alone and no transfer holds blocks it may need
        if self.policy == "fcfs" and self.fit_alone and not kv_transfer.transfers_in_flight(before):
            self.check(preemption.invariant_oldest_never_preempted, before, report)
        loads = {rid for rid, (direction, _) in self.in_flight.items() if direction == "load"}
        self.check(kv_transfer.invariant_no_decode_before_load_lands, loads, after, report)
        if report.loading:
            event("a load started: its blocks the landing zone")
        self.check(admission.invariant_admission_in_arrival_order, after, report)
        self.check(admission.invariant_watermark_kept, after, report)
        self.check(admission.invariant_admission_stops_only_when_short, after, report)
        self.check(preemption.invariant_preempted_keeps_no_grant, report)
        self.check(preemption.invariant_victims_rank_below_survivors, before, report)
        self.partly_finished(before, after, report)
        ranks = {g.request.request_id: rank(g, self.policy) for g in before.groups}
        for victim, how in report.preempted:
            event(f"preempted by {how}")
            if any(ranks[victim][1] < ranks[rid][1] for rid, _ in report.granted):
                event("victim arrived before a request that kept its grant")
        self.preemptions.update(how for _, how in report.preempted)
        return after

    def partly_finished(self, before: SchedulerState, after: SchedulerState, report: StepReport) -> None:
        """Events of groups whose samples finish apart: decoding with some finished, preempted, resumed."""
        partly = {g.request.request_id: g for g in after.groups if len(g.live) < g.request.n}
        if partly:
            event("a group decodes with some samples finished")
        for victim, how in report.preempted:
            if victim in partly:
                event(f"partly finished group preempted by {how}")
        was = {g.request.request_id: g.location for g in before.groups}
        for rid in report.admitted:
            if rid in partly:
                event(f"partly finished group resumed from {was.get(rid, 'waiting')}")

    def check_state(self) -> SchedulerState:
        """The implementation's state now, its rules checked once between two calls."""
        state = self.state()
        if self.checked_at == self.calls:
            return state
        self.checked_at = self.calls
        self.check_group(preemption.STATE, state)
        self.check(sample_groups.invariant_finished_sample_holds_nothing, state)
        # the blocks each transfer began on, as the implementation placed them
        for transfer in kv_transfer.transfers_in_flight(state):
            if transfer.request_id not in self.in_flight:
                blocks = frozenset(b for seq in transfer.seqs for b in state.gpu.tables.get(seq, ()))
                self.in_flight[transfer.request_id] = (transfer.direction, blocks)
                event(f"{transfer.direction} in flight")
        self.check(kv_transfer.invariant_transfer_blocks_held, {r: b for r, (_, b) in self.in_flight.items()}, state)
        self.check(admission.invariant_not_ready_never_admitted, state)
        if self.bounded:
            deadlines = {rid: preemption.deadline(after, k, self.longest) for rid, (after, k) in self.arrivals.items()}
            self.check(preemption.invariant_finishes_within_bound, state, deadlines)
        return state

    def teardown(self) -> None:
        if hasattr(self, "scheduler"):
            event("preemption in this run" if self.preemptions else "no preemption in this run")
            for how in ("swap", "recompute"):  # each kind apart: recomputes alone would crowd swaps out
                target(float(self.preemptions[how]), label=f"preemptions by {how}")
        super().teardown()


class LockstepSchedulerMachine(SchedulerMachineBase):
    """Lockstep with the model."""

    @opening(GPU_BLOCKS)
    def start(
        self,
        gpu_blocks: int,
        cpu_blocks: int,
        block_size: int,
        watermark: int,
        preemption: Preemption | None = None,
        load_failure: LoadFailure = "recompute",
        data: st.DataObject | None = None,
    ) -> None:
        """``data``: open the example with transfers (the recompute machine's opening; others open their own)."""
        super().start(gpu_blocks, cpu_blocks, block_size, watermark, preemption, load_failure)
        self.scheduler.spec = (model, admission, kv_transfer)
        self.scheduler.model = model.new_model(self.memory(gpu_blocks), self.memory(cpu_blocks), self.config)
        self.requests: list[Request] = []  # every request accepted, in arrival order
        self.rejected: tuple[str, Any] | None = None  # the last call the implementation refused
        self.admitted: set[int] = set()
        self.plans: list[tuple[Any, int]] = []  # (sequence, cached tokens) the GPU manager planned in this step
        if self.caching:
            watch_plans(self.scheduler.impl.gpu, self.plans)
        self.stopped_at: tuple[int, CachedBlocks] | None = None  # the request admission stopped at, its hits then
        if data is not None and self.transfers and self.offers("scheduler", kv_transfer.KV_TRANSFER):
            self.open_with_transfers(data)

    def open_with_transfers(self, data: st.DataObject) -> None:
        """The example opens with three short requests whose prompts were computed elsewhere: the first lands and
        sends its KV on finish, the second's load fails or moves nothing, the third is aborted while its load is
        in flight and its load ends after.  Each load ends the step after it starts; the opening ends when all
        three are over.  Then the machine's rules take over."""
        fates = [("done", False), (data.draw(st.sampled_from(["failed", "empty"]), label="fate"), False)]
        fates.append((data.draw(st.sampled_from(OUTCOMES), label="outcome after abort"), True))
        ids = []
        for sends in (True, False, False):
            request = self.draw_request(data, ready=True)
            prompt, max_new_tokens = request.prompt[: self.sizes[2]], min(request.max_new_tokens, 2)
            self.arrive(
                kv_transfer.TransferRequest(
                    request.request_id, prompt, max_new_tokens, 1, request.priority, remote_prompt=True, sends_kv=sends
                )
            )
            ids.append(request.request_id)
        fate = dict(zip(ids, fates, strict=True))
        self.step(1)
        for _ in range(12):  # a bounded count: a call the implementation fails leaves the model as it was
            in_flight = kv_transfer.transfers_in_flight(self.scheduler.model)
            if not (in_flight or self.scheduler.model.groups):
                break
            for transfer in in_flight:
                self.end_transfer(transfer.request_id, *fate.get(transfer.request_id, ("done", False)))
            self.step(1)

    def memory(self, capacity: int) -> model.Memory:
        pool = block_pool.new_pool(capacity, "lru", self.conventions.pool)
        if self.caching:
            return prefix_cache.new_caching_manager(self.sizes[2], pool)
        return block_manager.new_manager(pool, self.sizes[2], self.conventions.manager)

    def call(self, operation: str, argument: Any) -> bool:
        """``operation(argument)`` on both sides; whether the implementation carried it out (remembered if not)."""
        refused = self.scheduler(operation, argument) is None
        if refused:
            self.rejected = (operation, argument)
        return not refused

    def arrive(self, request: Request) -> None:
        if self.call("arrive", request):
            self.accepted(request)
            self.requests.append(request)

    @rule(
        data=st.data(),
        burst=st.lists(st.sampled_from(["new", "earlier prompt", "new", "retry"]), min_size=1, max_size=3),
        then_steps=st.integers(0, 3),
    )
    def arrive_request(self, data: st.DataObject, burst: list[str], then_steps: int) -> None:
        """A burst of arrivals between two iterations -- each a new request, an earlier prompt again, or the
        last refused call again; where requests may arrive not ready, as often as not a batch of them whose
        remote KV is still on its way -- then (often) steps.

        Several arrivals before one step make one step admit several requests, the watermark and the
        queue order matter within a step.  Revisits ride on the arrival rule, which runs in nearly every
        example (swarm testing disables a rule of its own in many); arrivals step the scheduler because
        it often disables the step rule.
        """
        not_ready = self.batches_not_ready and data.draw(st.booleans(), label="a batch not ready yet")
        # in falling priority: the burst's first requests yield to its later ones (a batch job, then chats)
        priorities = sorted(data.draw(st.lists(self.priorities, min_size=3, max_size=3), label="priorities"))
        for source in burst:
            if source == "retry":
                self.retry_refused()
            elif source == "earlier prompt" and self.requests:
                self.arrive_earlier_prompt(data.draw(st.integers(0, 7), label="earlier"))
            else:
                self.arrive(self.draw_request(data, False if not_ready else None, priorities.pop()))
        if len(burst) > 1:
            event("a burst of arrivals")
        self.step(then_steps)

    @rule(
        request_id=st.integers(-1, 3),
        prompt=st.lists(st.integers(0, 9), max_size=2),
        max_new_tokens=st.integers(0, 2),
        n=st.integers(0, 2),
    )
    def arrive_malformed(self, request_id: int, prompt: list[int], max_new_tokens: int, n: int) -> None:
        """Duplicate ids, empty prompts, zero outputs or samples: all out of contract.  Two samples only where
        the manager forks: one that cannot is never sent a group (its scheduler samples one at a time)."""
        manager = "prefix_caching_manager" if self.caching else "block_manager"
        n = n if self.offers(manager, block_manager.FORK) else min(n, 1)
        self.arrive(Request(request_id, tuple(prompt), max_new_tokens, n))

    def retry_refused(self) -> None:
        """The last refused call again -- refused again, with no trace -- or an accepted request under its id."""
        if self.rejected is not None:
            operation, argument = self.rejected
            event(f"retried a refused {operation}")
            if operation == "arrive":
                self.arrive(argument)
            else:
                self.call(operation, argument)
        elif self.requests:
            event("sent an accepted request again")
            self.arrive(self.requests[-1])

    def arrive_earlier_prompt(self, index: int) -> None:
        """An earlier request's prompt under a new id: a retry by the user, a replay after eviction."""
        earlier = self.requests[index % len(self.requests)]  # the oldest first: the likeliest evicted
        unfinished = any(g.request.request_id == earlier.request_id for g in self.scheduler.model.groups)
        event("earlier prompt again, first run unfinished" if unfinished else "earlier prompt again, first run over")
        if self.caching and earlier.request_id in self.admitted:
            cached = len(admission.prefix_hits(self.scheduler.model.gpu, earlier.prompt))
            full = max_hit_blocks(len(earlier.prompt), self.sizes[2])
            if full:
                event("replayed a prompt after eviction" if cached < full else "replayed a prompt still cached")
        self.next_id += 1
        self.arrive(
            Request(
                self.next_id, earlier.prompt, earlier.max_new_tokens, earlier.n, earlier.priority, stops=earlier.stops
            )
        )

    @rule(count=st.integers(1, 6))
    def step_rule(self, count: int) -> None:
        self.step(count)

    def step(self, count: int) -> None:
        for _ in range(count):
            before, spec_before = self.state(), self.scheduler.model
            self.plans.clear()
            answer = self.scheduler("step", judged_by=None)
            if answer is None:
                return
            report = answer.actual
            if self.plans:  # what the scheduler's own manager supplied the step's admissions, beside its report
                self.check(admission.invariant_hits_probed_at_admission, answered(self.plans), report.cached_tokens)
            self.check(invariant_result_matches_spec, answer.expected, report)
            after = self.stepped(before, report)
            self.check(invariant_scheduler_refines_spec, after, kv_transfer.abstract(self.scheduler.model))
            self.reached(spec_before, self.scheduler.model, report)
            self.admitted.update(report.admitted)
            for _, cached in report.cached_tokens:
                hits = cached // self.sizes[2]
                event(f"admission hit {hits if hits < 3 else '3+'} blocks" if self.caching else "admission")

    def reached(self, before: model.Model, after: model.Model, report: StepReport) -> None:
        """What the step's admission pass met: requests not ready it passed over, a request it stopped at for want
        of room after its cached blocks changed since it was last stopped at, victims whose grant was taken."""
        queue = model.queued(after)
        stop = next((group for group in queue if group.ready), None)
        passed = sum(1 for group in queue[: queue.index(stop) if stop else len(queue)] if not group.ready)
        if passed:
            event(f"admission passed over {'2+ requests' if passed > 1 else '1 request'} not ready")
        if self.stopped_at is not None:
            rid, then = self.stopped_at
            waiting = next((g for g in before.groups if g.request.request_id == rid and g.location == "waiting"), None)
            attempted = rid in report.admitted or (stop is not None and stop.request.request_id == rid)
            # admission probes after the step's decode phase
            if waiting and attempted and cached_blocks(preemption.decode_phase(before)[0], waiting) != then:
                event("retried a refused admission after its cached blocks changed")
        if (
            stop is not None
            and stop.location == "waiting"
            and all(rid != stop.request.request_id for rid, _ in report.preempted)
        ):
            self.stopped_at = (stop.request.request_id, cached_blocks(after, stop))
        if report.preempted and victims_with_grants(before) & {rid for rid, _ in report.preempted}:
            event("a grant taken from a victim")

    @rule(index=st.integers(0, 8))
    def abort(self, index: int) -> None:
        """An unfinished request (often) or an unknown id; a request cut short by a stop string is aborted too."""
        request_id = self.unfinished(index)
        if self.call("abort", request_id):
            self.arrivals.pop(request_id, None)

    def end_transfer(self, rid: int, outcome: str, abort_first: bool) -> None:
        """``rid``'s transfer ends ``outcome``; its request, if loading and ``abort_first``, aborted first."""
        loading = any(g.request.request_id == rid and g.location == "loading" for g in self.scheduler.model.groups)
        if abort_first and loading and self.call("abort", rid):
            self.arrivals.pop(rid, None)
            event("aborted while its load was in flight")
        if self.scheduler("finish_transfer", rid, outcome) is None:
            return
        direction, _ = self.in_flight.pop(rid, ("", frozenset()))
        if not direction:  # no transfer of this request was in flight, as the implementation had shown it
            return
        owner = any(g.request.request_id == rid for g in self.scheduler.model.groups) or direction == "send"
        event(f"{direction} ended {outcome}" + ("" if owner else " after its request was aborted"))
        if direction == "load" and outcome != "done":
            event("a load failed or moved nothing")
        self.check(kv_transfer.invariant_failed_load_recomputes, rid, outcome, self.state())

    def unfinished(self, index: int, ready: bool | None = None) -> int:
        """The index-th unfinished request (of the given readiness), or the index itself as an id."""
        ids = [g.request.request_id for g in self.scheduler.model.groups if ready is None or g.ready == ready]
        return ids[index] if index < len(ids) else index

    @invariant()
    def matches_model(self) -> None:
        if self.checked_at == self.calls:  # a step checked this very state, and its refinement
            return
        state = self.check_state()
        self.check(invariant_scheduler_refines_spec, state, kv_transfer.abstract(self.scheduler.model))


class SchedulerMachine(LockstepSchedulerMachine):
    """Lockstep with the model, preempting by recompute; prompts loaded from elsewhere, KV sent on finish
    (``kvspec.spec.kv_transfer``)."""

    transfers: ClassVar[bool] = True

    @precondition(lambda self: self.offers("scheduler", kv_transfer.KV_TRANSFER))
    @rule(
        index=st.integers(0, 3),
        outcome=st.sampled_from(["done", "done", "failed", "empty", "lost"]),
        abort_first=st.booleans(),
        then_steps=st.integers(0, 2),
    )
    def finish_transfer(self, index: int, outcome: str, abort_first: bool, then_steps: int) -> None:
        """The worker reports the end of a transfer in flight (often of a load whose request was aborted while it
        was in flight), then steps; a request with none in flight, or an outcome there is not, is out of contract."""
        flying = [t.request_id for t in kv_transfer.transfers_in_flight(self.scheduler.model)]
        self.end_transfer(flying[index] if index < len(flying) else index, outcome, abort_first)
        self.step(then_steps)


class SwapSchedulerMachine(SchedulerMachine):
    """Lockstep with the model, preempting by swap -- vLLM's choice for groups of several samples -- and groups
    whose samples finish apart given way and resumed (``kvspec.spec.sample_groups``)."""

    preemption: ClassVar[Preemption] = "swap"
    samples: ClassVar[st.SearchStrategy[int]] = st.sampled_from([2, 3, 1])
    finish_apart: ClassVar[bool] = True
    requires = {"scheduler": frozenset({SWAP_PREEMPTION}), "block_manager": frozenset({swap.SWAP})}

    @opening(st.integers(6, 8))  # the opening's request and group each need the GPU alone
    def start(
        self,
        gpu_blocks: int,
        cpu_blocks: int,
        block_size: int,
        watermark: int,
        load_failure: LoadFailure,
        data: st.DataObject,
    ) -> None:
        super().start(gpu_blocks, cpu_blocks, block_size, watermark, None, load_failure)
        self.open_with_group_finishing_apart(data)

    def open_with_group_finishing_apart(self, data: st.DataObject) -> None:
        """The example opens with a request of two blocks' prompt, then a group of two samples of one block's prompt,
        each as long as the GPU holds it alone, one of whose samples stops at once: as the request grows, the
        group -- a sample finished, the latest arrival -- gives way (its unfinished sample swapped, or dropped
        when the CPU is full), and is resumed as that sample alone.  Then the machine's rules take over.  A
        manager that cannot fork is never sent a group: its examples open with the machine's rules."""
        if not self.offers("block_manager", block_manager.FORK):
            return
        gpu_blocks, _, size = self.sizes
        for n, prompt_blocks in ((1, 2), (2, 1)):
            prompt = tuple(
                data.draw(
                    st.lists(st.integers(0, 9), min_size=prompt_blocks * size, max_size=prompt_blocks * size),
                    label="prompt",
                )
            )
            fits = [k for k in range(1, 4 * size + 1) if model.group_blocks(len(prompt), k, n, size) <= gpu_blocks]
            stops = (fits[-1], 1) if n == 2 and len(fits) > 1 else ()
            self.next_id += 1
            self.arrive(Request(self.next_id, prompt, fits[-1], len(stops) or 1, stops=stops))
        for _ in range(8 * size + 2):  # a bounded count: a step the implementation fails leaves the model as it was
            if not self.scheduler.model.groups:
                break
            self.step(1)


def documents(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Three texts prompts are cut from: the first two share their first block, the third nothing."""
    first = tuple((3 * i + 1) % 10 for i in range(2 * block_size + 1))
    second = first[:block_size] + tuple((t + 5) % 10 for t in first[block_size:])
    return first, second, tuple(9 - t for t in first)


class CachedSchedulerMachine(LockstepSchedulerMachine):
    """The engine's shape: preemption, abort and re-admission over prefix-caching managers, requests not ready.

    Prompts are cuts of three documents with a short tail, so admissions hit; a hit is probed again at every
    attempt, and every admission reports the cached tokens its own manager supplied it (``watch_plans``).
    Preemption is drawn: by recompute (vLLM V1's only way) a victim's prompt blocks wait in the free queue,
    cached, and its re-admission revives them; by swap it resumes without a probe.  The engine may trim the
    cache between two attempts (``evict``).
    """

    caching: ClassVar[bool] = True  # no transfers: a prefix cache hashes a landing zone before its KV lands
    readiness: ClassVar[st.SearchStrategy[bool]] = st.sampled_from([True, True, False])
    batches_not_ready: ClassVar[bool] = True
    uses = frozenset({"block_pool", "prefix_caching_manager", "scheduler"})
    requires = {"scheduler": frozenset({admission.PREFIX_CACHING})}

    @initialize(
        cpu_blocks=CPU_BLOCKS,
        block_size=BLOCK_SIZES,
        gpu_blocks=st.integers(4, 10),
        watermark=st.sampled_from([0, 1, 0, 2]),  # vLLM keeps 1 % of the GPU: no block of a pool this small
        swaps=st.booleans(),
    )
    def start(self, gpu_blocks: int, cpu_blocks: int, block_size: int, watermark: int, swaps: bool) -> None:
        swaps = swaps and self.offers("scheduler", SWAP_PREEMPTION) and self.offers("prefix_caching_manager", swap.SWAP)
        super().start(gpu_blocks, cpu_blocks, block_size, watermark, "swap" if swaps else "recompute")
        self.gpu = self.subject("gpu", prefix_cache, self.scheduler.model.gpu, self.scheduler.impl.gpu)

    def draw_prompt(self, data: st.DataObject) -> tuple[int, ...]:
        size = self.sizes[2]
        text = data.draw(st.sampled_from(documents(size)), label="document")
        # half the prompts carry a whole document, as requests behind one system prompt do; the rest a cut
        kept = data.draw(st.one_of(st.just(len(text)), st.integers(1, len(text))), label="kept")
        tail = data.draw(st.lists(st.integers(0, 9), max_size=size // 2), label="tail")
        return text[:kept] + tuple(tail)

    @rule(blocks=st.integers(1, 3), then_steps=st.integers(1, 2))
    def evict(self, blocks: int, then_steps: int) -> None:
        """The engine trims its GPU cache (vLLM's ``reset_prefix_cache``, SGLang's eviction for other
        memory): a waiting request's hits, probed at an attempt that found no room, are fewer at the next."""
        self.gpu.model = self.scheduler.model.gpu
        if self.gpu("evict", blocks, judged_by=None) is None:
            return
        self.scheduler.model = attrs.evolve(self.scheduler.model, gpu=self.gpu.model)
        if any(g.location == "waiting" for g in self.scheduler.model.groups):
            event("cache trimmed while a request waits")
        self.step(then_steps)

    @precondition(lambda self: self.offers("scheduler", admission.NOT_READY))
    @rule(indices=st.lists(st.integers(0, 4), min_size=1, max_size=3), then_steps=st.integers(0, 2))
    def mark_ready(self, indices: list[int], then_steps: int) -> None:
        """Requests not ready get their remote KV, often several before one step (the transfers of one batch land
        together); a ready or unknown one is out of contract."""
        marked = 0
        for index in indices:
            if self.call("mark_ready", self.unfinished(index, ready=False)):
                marked += 1
        event("marked several ready at once" if marked > 1 else "marked ready" if marked else "marked none ready")
        self.step(then_steps)


class PrioritySchedulerMachine(CachedSchedulerMachine):
    """The priority policy over the cache: a victim may have arrived first and hold its grant already."""

    policy: ClassVar[QueuePolicy] = "priority"
    requires = {"scheduler": frozenset({admission.PREFIX_CACHING, admission.PRIORITY})}
    priorities: ClassVar[st.SearchStrategy[int]] = st.integers(0, 2)


class DeadlockFreedomMachine(SchedulerMachineBase):
    """The implementation alone, over long runs: no model decides for it whether it made progress."""

    @rule(data=st.data(), then_steps=st.integers(0, 3))
    def arrive_request(self, data: st.DataObject, then_steps: int) -> None:
        request = self.draw_request(data)
        try:
            self.scheduler("arrive", request)
            self.accepted(request)
        except RequestTooLarge:
            event("arrive rejected with RequestTooLarge")
        self.step(then_steps)

    @rule(count=st.integers(1, 30))
    def step_rule(self, count: int) -> None:
        self.step(count)

    def step(self, count: int) -> None:
        for _ in range(count):
            before = self.state()
            answer = self.scheduler("step")
            if answer is None:
                return
            self.stepped(before, answer.actual)


TestSchedulerRecompute = conformance_test(SchedulerMachine, "scheduler (recompute)")
TestSchedulerSwap = conformance_test(SwapSchedulerMachine, "scheduler (swap)")
TestDeadlockFreedom = conformance_test(DeadlockFreedomMachine, "scheduler deadlock freedom")
TestCachedScheduler = conformance_test(CachedSchedulerMachine, "scheduler over the prefix cache")
TestPriorityScheduler = conformance_test(PrioritySchedulerMachine, "scheduler (priority)")
