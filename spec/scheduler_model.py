"""Layer 4, the spec's scheduler: one iteration as a pure transition, phase by phase.

Theory of operation: ``Model`` is the spec's scheduler over the spec's block
manager models -- plain or prefix-caching: ``memory`` picks the module whose
transitions apply -- and ``arrive``, ``abort``, ``mark_ready`` and ``step``
are pure transitions returning a new ``Model`` (``step`` with its
``StepReport``).  ``step`` runs the decode phase of ``kvspec.spec.preemption``
(``_grant_decodes``, ``_preempt``, ``_decode``), then the admission phase of
``kvspec.spec.admission`` (``_resume_demand``, ``_admit``); a machine
compares ``abstract(model)`` with an implementation's ``snapshot()``.

Over a prefix-caching manager (both devices then cache) a prefill admission
is re-probed at every attempt: its hits (``prefix_hits``: ``cached_prefix``
capped as admission caps them) lower its demand once, and a hit sitting in
the free queue -- counted there as free -- is taken out of it, so it counts
as demand again (``prefill_demand``).

``STATE`` groups every safety rule over a scheduler's snapshot, both devices'
managers included (the deadline apart: it holds only under ``fcfs`` with
every request ready).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import attrs

from kvspec.spec import block_manager, prefix_cache
from kvspec.spec.admission import admissible, prefill_demand
from kvspec.spec.block_manager import Manager
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import Group as InvariantGroup
from kvspec.spec.preemption import (
    append_demand,
    invariant_group_on_one_device,
    invariant_no_leak_across_preemption,
    invariant_recompute_restores_tokens,
    invariant_swap_restores_contents,
)
from kvspec.spec.prefix_cache import CachingManager, max_hit_blocks
from kvspec.spec.scheduler import (
    DEVICE_OF,
    Group,
    Preemption,
    Request,
    RequestId,
    SchedulerConfig,
    SchedulerState,
    StepReport,
    check_config,
    check_fits_alone,
    check_request,
    invariant_memory_never_overcommitted,
    rank,
    sampled_token,
)

Memory = Manager | CachingManager


@attrs.frozen
class Model:
    config: SchedulerConfig
    steps: int
    arrived: tuple[RequestId, ...]
    groups: tuple[Group, ...]
    finished: tuple[RequestId, ...]
    gpu: Memory
    cpu: Memory


def memory(device: Memory) -> ModuleType:
    """The spec module whose transitions apply to a device: the prefix cache's or the plain manager's."""
    return prefix_cache if isinstance(device, CachingManager) else block_manager


def tables_of(device: Memory) -> Manager:
    """The layer-2 model under a device: its tables, tokens and pool."""
    return device.manager if isinstance(device, CachingManager) else device


def new_model(gpu: Memory, cpu: Memory, config: SchedulerConfig) -> Model:
    if tables_of(gpu).block_size != tables_of(cpu).block_size or type(gpu) is not type(cpu):
        raise InvalidOperation(f"unlike devices: a GPU {type(gpu).__name__}, a CPU {type(cpu).__name__}")
    check_config(config)
    return Model(config=config, steps=0, arrived=(), groups=(), finished=(), gpu=gpu, cpu=cpu)


def abstract(model: Model) -> SchedulerState:
    return SchedulerState(
        config=model.config,
        steps=model.steps,
        arrived=model.arrived,
        groups=model.groups,
        finished=model.finished,
        gpu=memory(model.gpu).abstract(model.gpu),
        cpu=memory(model.cpu).abstract(model.cpu),
    )


def arrive(model: Model, request: Request) -> Model:
    request = check_request(request, model.arrived)
    check_fits_alone(request, tables_of(model.gpu).pool.capacity, tables_of(model.gpu).block_size)
    group = Group(request=request, arrival=len(model.arrived), ready=request.ready)
    return attrs.evolve(model, arrived=model.arrived + (request.request_id,), groups=model.groups + (group,))


def abort(model: Model, request_id: RequestId) -> Model:
    group = _find(model, request_id)
    model = _release(model, group)
    return attrs.evolve(model, groups=tuple(g for g in model.groups if g.request.request_id != request_id))


def mark_ready(model: Model, request_id: RequestId) -> Model:
    group = _find(model, request_id)
    if group.ready:
        raise InvalidOperation(f"request {request_id!r} is ready already")
    return _replace(model, attrs.evolve(group, ready=True))


def step(model: Model) -> tuple[Model, StepReport]:
    """One iteration: grant decodes (preempting the lowest-ranked as needed), decode, then admit in rank order."""
    model, granted, report = _grant_decodes(model, StepReport())
    for group in granted:
        model, report = _decode(model, group, report)
    just_preempted = {rid for rid, _ in report.preempted}
    for group in sorted((g for g in model.groups if g.location != "running"), key=_ranking(model)):
        if not group.ready:
            continue
        if group.request.request_id in just_preempted:
            break
        gpu_idle = not any(g.location == "running" for g in model.groups)
        need = _resume_demand(model, group)
        if not admissible(need, free_blocks(model.gpu), model.config.watermark, gpu_idle):
            break
        model, report = _admit(model, group, need, report)
    return attrs.evolve(model, steps=model.steps + 1), report


def free_blocks(device: Memory) -> int:
    return len(tables_of(device).pool.lru)


def _ranking(model: Model) -> Callable[[Group], tuple[int, int]]:
    return lambda group: rank(group, model.config.policy)


def _find(model: Model, request_id: RequestId) -> Group:
    for group in model.groups:
        if group.request.request_id == request_id:
            return group
    raise InvalidOperation(f"request {request_id!r} is not unfinished (never arrived, finished or aborted)")


def _replace(model: Model, group: Group) -> Model:
    rid = group.request.request_id
    return attrs.evolve(model, groups=tuple(group if g.request.request_id == rid else g for g in model.groups))


def _grant_decodes(model: Model, report: StepReport) -> tuple[Model, list[Group], StepReport]:
    """Grant each running group its tokens in arrival order, preempting the lowest-ranked while one does not fit."""
    granted: dict[RequestId, tuple[Group, int]] = {}  # request -> (group, the blocks its grant takes)
    for group in [g for g in model.groups if g.location == "running"]:
        if _find(model, group.request.request_id).location != "running":
            continue  # preempted for a group before it
        demand = _decode_demand(model.gpu, group)
        while sum(d for _, d in granted.values()) + demand > free_blocks(model.gpu):
            victim = max((g for g in model.groups if g.location == "running"), key=_ranking(model))
            model, how = _preempt(model, victim)
            granted.pop(victim.request.request_id, None)  # a preempted group decodes nothing
            report = attrs.evolve(report, preempted=report.preempted + ((victim.request.request_id, how),))
            if how == "swap":
                swapped = len({b for s in victim.seqs for b in tables_of(model.cpu).tables[s]})
                report = attrs.evolve(report, swapped_out_blocks=report.swapped_out_blocks + swapped)
            if victim.request.request_id == group.request.request_id:
                break
        else:
            granted[group.request.request_id] = (group, demand)
    grants = tuple((rid, group.request.n) for rid, (group, _) in granted.items())
    return model, [group for group, _ in granted.values()], attrs.evolve(report, granted=grants)


def _decode(model: Model, group: Group, report: StepReport) -> tuple[Model, StepReport]:
    gpu, rid = model.gpu, group.request.request_id
    for sample, seq in enumerate(group.seqs):
        gpu, _ = memory(gpu).append(gpu, seq, (sampled_token(rid, sample, group.generated),))
    grown = attrs.evolve(group, generated=group.generated + 1)
    model = _replace(attrs.evolve(model, gpu=gpu), grown)
    report = attrs.evolve(report, decode_tokens=report.decode_tokens + group.request.n)
    if grown.generated < grown.request.max_new_tokens:
        return model, report
    model = _release(model, grown)
    model = attrs.evolve(
        model,
        groups=tuple(g for g in model.groups if g.request.request_id != rid),
        finished=model.finished + (rid,),
    )
    return model, attrs.evolve(report, finished=report.finished + (rid,))


def _decode_demand(gpu: Memory, group: Group) -> int:
    manager = tables_of(gpu)
    refcount = dict(enumerate(manager.pool.refcounts))
    tables = [manager.tables[s] for s in group.seqs]
    return append_demand(tables, [len(manager.tokens[s]) for s in group.seqs], refcount, manager.block_size)


def _resume_demand(model: Model, group: Group) -> int:
    if group.location == "swapped":
        return len({b for s in group.seqs for b in tables_of(model.cpu).tables[s]})
    hits = prefix_hits(model.gpu, group.request.prompt)
    revived = sum(1 for b in hits if tables_of(model.gpu).pool.refcounts[b] == 0)
    return prefill_demand(group.request, group.generated, tables_of(model.gpu).block_size, len(hits), revived)


def prefix_hits(gpu: Memory, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """The cached blocks a prefill of ``prompt`` would share now; none without a prefix cache."""
    if not isinstance(gpu, CachingManager):
        return ()
    return prefix_cache.cached_prefix(gpu, prompt)[: max_hit_blocks(len(prompt), gpu.manager.block_size)]


def _release(model: Model, group: Group) -> Model:
    device = DEVICE_OF.get(group.location)
    if device is None:
        return model
    held: Memory = getattr(model, device)
    for seq in group.seqs:
        held = memory(held).free(held, seq)
    return attrs.evolve(model, gpu=held) if device == "gpu" else attrs.evolve(model, cpu=held)


def _preempt(model: Model, victim: Group) -> tuple[Model, Preemption]:
    distinct = len({b for s in victim.seqs for b in tables_of(model.gpu).tables[s]})
    bumped = attrs.evolve(victim, preemptions=victim.preemptions + 1)
    if model.config.preemption == "swap" and distinct <= free_blocks(model.cpu):
        gpu, cpu, _ = memory(model.gpu).move_sequences(model.gpu, model.cpu, victim.seqs)
        return _replace(attrs.evolve(model, gpu=gpu, cpu=cpu), attrs.evolve(bumped, location="swapped")), "swap"
    model = _release(model, victim)
    return _replace(model, attrs.evolve(bumped, location="waiting")), "recompute"


def _admit(model: Model, group: Group, need: int, report: StepReport) -> tuple[Model, StepReport]:
    rid, request = group.request.request_id, group.request
    gpu, cpu = model.gpu, model.cpu
    if group.location == "swapped":
        cpu, gpu, _ = memory(cpu).move_sequences(cpu, gpu, group.seqs)
        report = attrs.evolve(report, swapped_in_blocks=report.swapped_in_blocks + need)
    else:
        gpu, plan = memory(gpu).add_sequence(gpu, group.seqs[0], request.prompt)
        for seq in group.seqs[1:]:
            gpu = memory(gpu).fork(gpu, group.seqs[0], seq)
        for sample, seq in enumerate(group.seqs):
            gpu, _ = memory(gpu).append(gpu, seq, group.tokens(sample)[len(request.prompt) :])
        computed = len(request.prompt) - plan.cached_tokens + request.n * group.generated
        field = "recomputed_tokens" if group.preemptions else "prefill_tokens"
        report = attrs.evolve(
            report,
            cached_tokens=report.cached_tokens + ((rid, plan.cached_tokens),),
            **{field: getattr(report, field) + computed},
        )
    model = _replace(attrs.evolve(model, gpu=gpu, cpu=cpu), attrs.evolve(group, location="running"))
    return model, attrs.evolve(report, admitted=report.admitted + (rid,))


STATE = (
    InvariantGroup(
        (
            invariant_memory_never_overcommitted,
            invariant_no_leak_across_preemption,
            invariant_group_on_one_device,
            invariant_swap_restores_contents,
            invariant_recompute_restores_tokens,
        )
    )
    .including(block_manager.STATE, lambda state: (state.gpu,))
    .including(block_manager.STATE, lambda state: (state.cpu,))
)
