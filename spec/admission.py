"""Layer 4, the admission phase as engines run it: cache hits, requests not ready, the watermark, queue order.

Rules (the records, the location table and the model are ``kvspec.spec.scheduler``'s; ``step``, one
iteration of the spec's scheduler, runs this phase after ``kvspec.spec.preemption``'s decode phase):

* ``arrive(request)`` queues a request as waiting; one out of contract, or
  too large to run even alone, is refused (the scheduler chapter's rules),
  changing nothing.
* After the decode phase, the groups that are not running are taken in rank
  order -- under ``fcfs`` swapped groups resume before new admissions because
  they arrived earlier -- and each is swapped in, or prefilled (prompt, fork
  into ``n`` samples, then each sample's generated tokens again if it was
  recomputed), while it fits (``admissible``): the GPU keeps ``watermark``
  blocks free after the admission unless nothing is running or loading.  Admission stops
  at the first ready group that does not fit and at a group preempted in this
  very step: nobody overtakes.
* **Hits are probed at every attempt.**  A waiting request's hit length is
  what the cache holds *now*: between two attempts the cache may have lost
  blocks (evicted to make room) or gained them (another request finished).
  A hit lowers the request's demand once; a hit block sitting in the free
  queue is counted there as free, and admission takes it out of the queue, so
  it counts as demand again (``prefill_demand``).  The report names the
  tokens each admission took from the cache.
* **Not ready is not blocked.**  A request waiting on remote KV, a grammar or
  an adapter slot is passed over by admission and keeps its place: the ready
  requests behind it are admitted as if it were not there, and when it
  becomes ready (``mark_ready``) it goes before every later arrival.

Invariants (tier in brackets):

* ``invariant_admission_in_arrival_order`` [convention] -- no group is admitted or resumed
  ahead of an earlier-arrived (under ``priority``: higher-ranked) ready one still waiting or swapped.
* ``invariant_hits_probed_at_admission`` [safety] -- each admission reports the
  tokens its KV cache manager answered for it at that moment (the plan of its
  ``add_sequence``), not a hit length probed earlier.
* ``invariant_watermark_kept`` [safety] -- after an admission onto a busy GPU,
  ``watermark`` blocks are still free.
* ``invariant_not_ready_never_admitted`` [safety] -- a request not ready holds no
  blocks but a landing zone of its KV load (``kvspec.spec.kv_transfer``).
* ``invariant_admission_stops_only_when_short`` [convention] -- admission stops
  only at a ready request that does not fit, or one preempted in this step.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Iterable, Mapping
from itertools import pairwise
from typing import Protocol

import attrs

from kvspec.spec import kv_transfer, preemption, prefix_cache
from kvspec.spec.block_manager import check_tokens
from kvspec.spec.components import optional_operation
from kvspec.spec.errors import InvalidOperation, RequestTooLarge
from kvspec.spec.invariants import invariant
from kvspec.spec.prefix_cache import CachingManager, max_hit_blocks
from kvspec.spec.scheduler import (
    DEVICE_OF,
    SCHEDULER,
    Group,
    Memory,
    Model,
    Request,
    RequestId,
    Scheduler,
    SchedulerState,
    StepReport,
    find,
    free_blocks,
    group_blocks,
    memory,
    mover,
    peak_blocks,
    queued,
    rank,
    relocate,
    replace,
    tables_of,
)

BUSY = ("running", "loading")  # a loading group runs once its KV lands: the watermark is its room too


class ReadinessScheduler(Scheduler, Protocol):
    """A scheduler whose requests may arrive not ready, and wait for ``mark_ready`` (``NOT_READY``)."""

    def mark_ready(self, request_id: RequestId) -> None: ...


class PriorityScheduler(Scheduler, Protocol):
    """A mode: run with ``config.policy == "priority"``, admission and preemption go by priority, with grants."""


class PrefixCachingScheduler(Scheduler, Protocol):
    """A mode: over prefix-caching managers, probed at admission for the prompt's cached prefix."""


NOT_READY = optional_operation("not_ready", ReadinessScheduler, "mark_ready", kinds=(SCHEDULER.name,))
PRIORITY = optional_operation("priority", PriorityScheduler, kinds=(SCHEDULER.name,))
PREFIX_CACHING = optional_operation("prefix_caching", PrefixCachingScheduler, kinds=(SCHEDULER.name,))


def step(model: Model) -> tuple[Model, StepReport]:
    """One iteration of the spec's scheduler: the decode phase (``kvspec.spec.preemption``), then this one."""
    model, report = preemption.decode_phase(model)
    model, report = admission_phase(model, report)
    return attrs.evolve(model, steps=model.steps + 1), report


def arrive(model: Model, request: Request) -> Model:
    """Queue the request as waiting, once it passes the contract and could run alone."""
    request = check_request(request, model.arrived)
    check_fits_alone(request, tables_of(model.gpu).pool.capacity, tables_of(model.gpu).block_size)
    group = kv_transfer.new_group(request, len(model.arrived))
    return attrs.evolve(model, arrived=model.arrived + (request.request_id,), groups=model.groups + (group,))


def mark_ready(model: Model, request_id: RequestId) -> Model:
    """A request that arrived not ready may be admitted from now on (a loading one readies when its load ends)."""
    group = find(model, request_id)
    if group.location == "loading":
        raise InvalidOperation(f"request {request_id!r} waits on its KV load: the load's end makes it ready")
    if group.ready:
        raise InvalidOperation(f"request {request_id!r} is ready already")
    return replace(model, attrs.evolve(group, ready=True))


def admission_phase(model: Model, report: StepReport) -> tuple[Model, StepReport]:
    """Resume or prefill the groups not running, in rank order, while each fits; stop at the first that does
    not, and at one preempted in this very step."""
    just_preempted = {rid for rid, _ in report.preempted}
    for group in queued(model):
        if not group.ready:
            continue
        if group.request.request_id in just_preempted:
            break
        gpu_idle = not any(g.location in BUSY for g in model.groups)
        need = resume_demand(model, group)
        if not admissible(need, free_blocks(model.gpu), model.config.watermark, gpu_idle):
            break
        model, report = admit(model, group, need, report)
    return model, report


def admit(model: Model, group: Group, need: int, report: StepReport) -> tuple[Model, StepReport]:
    """Swap a swapped group in; prefill a waiting one: its prompt, forked into its unfinished samples, then each
    one's sampled tokens again -- or, its prompt computed elsewhere, start loading it there."""
    rid, request = group.request.request_id, group.request
    gpu, cpu = model.gpu, model.cpu
    if group.location == "swapped":
        cpu, gpu, _ = mover(cpu).move_sequences(cpu, gpu, group.seqs)
        report = attrs.evolve(report, swapped_in_blocks=report.swapped_in_blocks + need)
        return relocate(attrs.evolve(model, gpu=gpu, cpu=cpu), group, "swap_in"), admitted(report, rid)
    first, *others = group.seqs  # the unfinished samples: a finished one is never resumed
    gpu, plan = memory(gpu).add_sequence(gpu, first, request.prompt)
    for seq in others:
        gpu = memory(gpu).fork(gpu, first, seq)
    report = attrs.evolve(report, cached_tokens=report.cached_tokens + ((rid, plan.cached_tokens),))
    if kv_transfer.loads_prompt(group):  # the prompt's blocks are the landing zone of its KV, computed elsewhere
        model, report = kv_transfer.start_load(attrs.evolve(model, gpu=gpu), group, report)
        return model, admitted(report, rid)
    for seq in group.seqs:
        gpu, _ = memory(gpu).append(gpu, seq, group.tokens(seq[1])[len(request.prompt) :])
    computed = len(request.prompt) - plan.cached_tokens + len(group.seqs) * group.generated
    field = "recomputed_tokens" if group.preemptions else "prefill_tokens"
    report = attrs.evolve(report, **{field: getattr(report, field) + computed})
    return relocate(attrs.evolve(model, gpu=gpu), group, "prefill"), admitted(report, rid)


def admitted(report: StepReport, rid: int) -> StepReport:
    return attrs.evolve(report, admitted=report.admitted + (rid,))


def resume_demand(model: Model, group: Group) -> int:
    if group.location == "swapped":
        return len({b for s in group.seqs for b in tables_of(model.cpu).tables[s]})
    hits = prefix_hits(model.gpu, group.request.prompt)
    revived = sum(1 for b in hits if tables_of(model.gpu).pool.refcounts[b] == 0)
    block_size = tables_of(model.gpu).block_size
    copies = model.config.fork_partial_block == "copy"
    return prefill_demand(group.request, group.generated, block_size, len(hits), revived, len(group.live), copies)


def prefix_hits(gpu: Memory, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """The cached blocks a prefill of ``prompt`` would share now; none without a prefix cache."""
    if not isinstance(gpu, CachingManager):
        return ()
    return prefix_cache.cached_prefix(gpu, prompt)[: max_hit_blocks(len(prompt), gpu.manager.block_size)]


def prefill_demand(
    request: Request,
    generated: int,
    block_size: int,
    hits: int,
    revived: int,
    samples: int | None = None,
    copies_at_fork: bool = False,
) -> int:
    """Blocks a prefill admission of ``samples`` samples (all ``n`` unless some finished) takes: its blocks less
    its ``hits``, plus the ``revived`` hits; under a fork that copies the partial block, each further sample's copy.

    A hit is counted once: it lowers the demand.  A hit whose block sits in the
    free queue is also counted there as free, and admission takes it out: so it
    is demand again, or the supply would count it a second time.
    """
    samples = request.n if samples is None else samples
    return group_blocks(len(request.prompt), generated, samples, block_size, copies_at_fork) - hits + revived


def admissible(need: int, free: int, watermark: int, gpu_idle: bool) -> bool:
    return need <= free if gpu_idle else need + watermark <= free


@invariant(
    "first come, first served: overtaking starves large requests and breaks the deadlock-freedom argument",
    "convention",
)
def invariant_admission_in_arrival_order(after: SchedulerState, report: StepReport) -> str | None:
    """Arrival order within the policy's rank (``rank``): under ``fcfs``, arrival order itself.

    The queue itself -- the unfinished groups, as the snapshot lists them, and the groups not running in the
    order admission takes them (``queue``, where the implementation tells it) -- stays in arrival order
    within rank: a request passed over (not ready, say) keeps its place, at the very pass that passes it.
    """
    for i, group in enumerate(after.groups):
        later = [g.request.request_id for g in after.groups[:i] if g.arrival > group.arrival]
        if later:
            return (
                f"request {group.request.request_id!r} lost its place: it is queued behind later request {later[0]!r}"
            )
    ranks = {g.request.request_id: rank(g, after.config.policy) for g in after.groups}
    queue = [rid for rid in after.queue or () if rid in ranks]
    for ahead, behind in pairwise(queue):
        if ranks[behind] < ranks[ahead]:
            return f"the queue is {queue}: request {behind!r} is behind request {ahead!r}, {after.config.policy}-later"
    order = [ranks[rid] for rid in report.admitted]
    if order != sorted(order):
        return f"admitted {list(report.admitted)} out of {after.config.policy} order"
    passed_over = sorted(
        rank(g, after.config.policy) + (g.request.request_id,)
        for g in after.groups
        if g.ready and g.location != "running"
    )
    if order and passed_over and passed_over[0][:2] < order[-1]:
        return f"admitted {report.admitted[-1]!r} ahead of request {passed_over[0][2]!r}, still {after.config.policy}-earlier and ready"
    return None


@invariant(
    "the cache changes between attempts: a hit length remembered from an earlier probe counts blocks since "
    "evicted, or recomputes blocks since cached",
    "safety",
)
def invariant_hits_probed_at_admission(
    answered: Mapping[RequestId, int], reported: Iterable[tuple[RequestId, int]]
) -> str | None:
    """Judged on the implementation alone: ``answered`` is what the scheduler's own KV cache manager answered
    each admission of the step (the cached tokens of the plan of the request's ``add_sequence``, watched as
    the scheduler called it), ``reported`` the cached tokens the scheduler's report names per admission.  Of
    the admissions both name, each must report what the manager supplied then: more skips computing KV that
    is not there, fewer overwrites cached blocks the request shares."""
    wrong = {request: cached for request, cached in reported if request in answered and cached != answered[request]}
    if wrong:
        told = {request: answered[request] for request in wrong}
        return f"admissions report {wrong} tokens taken from the cache, their manager supplied {told} then"
    return None


@invariant(
    "the watermark is room kept for the running requests' next tokens: admitting into it preempts someone at "
    "the very next step (a hit counted in both demand and supply does exactly that)",
    "safety",
)
def invariant_watermark_kept(after: SchedulerState, report: StepReport) -> str | None:
    admitted = set(report.admitted)
    busy_before = any(g.location in BUSY and g.request.request_id not in admitted for g in after.groups)
    free = after.gpu.pool.num_free
    if admitted and (busy_before or len(admitted) > 1) and free < after.config.watermark:
        return (
            f"admitted {list(report.admitted)} and left {free} blocks free, the watermark is {after.config.watermark}"
        )
    return None


@invariant(
    "a request not ready has no remote KV, grammar or adapter yet: running it computes from what is not there",
    "safety",
    needs=(NOT_READY,),
)
def invariant_not_ready_never_admitted(state: SchedulerState) -> str | None:
    for group in state.groups:
        if not group.ready and group.location not in ("waiting", "loading"):
            return f"request {group.request.request_id!r} is {group.location} before it is ready"
    return None


def upper_demand(state: SchedulerState, group: Group) -> int:
    """Blocks resuming ``group`` takes at most: a swapped group's, or a prefill's as if nothing were cached."""
    device = DEVICE_OF.get(group.location)
    if device == "cpu":
        return len({b for seq in group.seqs for b in state.cpu.tables.get(seq, ())})
    request = group.request
    copies = state.config.fork_partial_block == "copy"
    return group_blocks(len(request.prompt), group.generated, len(group.live), state.gpu.block_size, copies)


@invariant(
    "admission stops at the first ready request that does not fit: stopping earlier -- at a request not ready, "
    "say -- idles memory and stalls every request behind it",
    "convention",
)
def invariant_admission_stops_only_when_short(after: SchedulerState, report: StepReport) -> str | None:
    policy = after.config.policy
    queue = sorted((g for g in after.groups if g.location != "running" and g.ready), key=lambda g: rank(g, policy))
    if not queue or any(rid == queue[0].request.request_id for rid, _ in report.preempted):
        return None
    first = queue[0]
    need, free = upper_demand(after, first), after.gpu.pool.num_free
    idle = not any(g.location in BUSY for g in after.groups)
    if admissible(need, free, after.config.watermark, idle):
        return f"request {first.request.request_id!r} needs at most {need} blocks, {free} are free, yet it waits"
    return None


# -- the contract of an arrival -------------------------------------------------------


def check_request(request: object, known: Collection[RequestId]) -> Request:
    if not isinstance(request, Request):
        raise InvalidOperation(f"expected a Request, got {type(request).__name__}")
    rid = request.request_id
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise InvalidOperation(f"request ids are ints, got {rid!r}")
    if rid in known:
        raise InvalidOperation(f"request {rid!r} already arrived")
    check_tokens(request.prompt, allow_empty=False)
    for name in ("max_new_tokens", "n"):
        value = getattr(request, name)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise InvalidOperation(f"request {request.request_id!r}: {name} must be an int >= 1, got {value!r}")
    if not isinstance(request.priority, int) or isinstance(request.priority, bool):
        raise InvalidOperation(f"request {request.request_id!r}: priority must be an int, got {request.priority!r}")
    flags = ("ready", "remote_prompt", "sends_kv") if isinstance(request, kv_transfer.TransferRequest) else ("ready",)
    for flag in flags:
        if not isinstance(getattr(request, flag), bool):
            raise InvalidOperation(f"request {rid!r}: {flag} must be a bool, got {getattr(request, flag)!r}")
    lengths = request.stops
    if lengths and (
        len(lengths) != request.n or any(type(k) is not int or not 0 < k <= request.max_new_tokens for k in lengths)
    ):
        raise InvalidOperation(f"request {rid!r}: stops must be n lengths in 1..max_new_tokens, got {lengths!r}")
    return request


def check_fits_alone(request: Request, gpu_capacity: int, block_size: int) -> None:
    need = peak_blocks(request, block_size)
    if need > gpu_capacity:
        raise RequestTooLarge(
            f"request {request.request_id!r} needs {need} blocks at its longest, the GPU has {gpu_capacity}"
        )
