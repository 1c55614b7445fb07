"""Layer 4 -- the scheduler: iteration-level batching, FCFS, preemption by swap or recompute.

Rules (vLLM §4.5 and §5.2, lecture §6):

* A *request* is a prompt, a number of new tokens to generate and a number of
  samples ``n``.  Its *sequence group* is its ``n`` sequences, ids
  ``(request_id, sample)``; the group is scheduled, preempted and resumed as
  one (all or nothing): its blocks are all on the GPU (*running*), all on the
  CPU (*swapped*) or nowhere (*waiting*).
* ``arrive(request)`` queues the request as waiting (a request may arrive
  *not ready*: see ``mark_ready``).  One whose peak need --
  ``group_blocks(prompt, max_new_tokens, n)``, the blocks it holds after its
  last token -- exceeds the GPU's capacity could never run even alone: it is
  refused with ``RequestTooLarge``, never left to block the queue.
* Groups are *ranked* by the queue policy (``rank``): ``fcfs`` by arrival;
  ``priority`` by the request's ``priority`` (lower first, as in vLLM), then
  by arrival.
* ``step()`` is one iteration.  First the *decode phase*: the running groups,
  in arrival order, are each *granted* one token per sequence
  (``sampled_token``, a deterministic stand-in for the model's output) while
  the blocks their appends need (``append_demand``, added up over the
  grants) fit the free blocks.  When a group's grant does not fit, the
  lowest-ranked running group is preempted -- under ``priority`` it may have
  arrived first and already hold its grant, which it then gives back: a
  preempted group decodes nothing.  Preemption is by **swap** --
  ``move_sequences`` of the whole group to the CPU manager, one copy per
  distinct block -- or, when the mode is ``recompute`` or the CPU cannot take
  the group, by **recompute** -- every sequence is freed and the group waits
  again.  Then every granted group decodes, and one that reaches
  ``max_new_tokens`` finishes and frees its blocks.  Then the *admission
  phase*: the groups that are not running are taken in rank order -- under
  ``fcfs`` swapped groups resume before new admissions because they arrived
  earlier -- and each is swapped in, or prefilled (prompt, fork into ``n``
  samples, then each sample's generated tokens again if it was recomputed),
  while it fits: the GPU keeps ``watermark`` blocks free after the admission
  unless nothing is running.  A group that is not ready is passed over and
  keeps its place.  Admission stops at the first ready group that does not
  fit and at a group preempted in this very step: nobody overtakes.
* Over a prefix-caching manager (``kvspec.spec.prefix_cache``; both devices
  then cache) a prefill admission is re-probed at every attempt: its hits
  (``cached_prefix``, capped as admission caps them) lower its demand once,
  and a hit sitting in the free queue -- counted there as free -- is taken
  out of it, so it counts as demand again (``prefill_demand``).  The report
  names the tokens each admission took from the cache.
* ``mark_ready(request_id)`` -- the remote KV arrived, the grammar compiled,
  an adapter slot opened: a request that arrived not ready may be admitted.
* ``abort(request_id)`` drops an unfinished request and frees its blocks.
* Bad input (duplicate or unknown id, empty prompt, ``n`` or
  ``max_new_tokens`` below 1, marking a ready request ready) raises
  ``InvalidOperation`` and changes nothing.

Deadlock freedom (lecture exercise 12).  Preemption takes the latest-arrived
running group, so the earliest-arrived unfinished request, once running, is
never preempted, and it fits alone.  While it waits, nobody is admitted and
every running group finishes or is preempted within ``M`` steps (``M`` the
largest ``max_new_tokens`` of any request); the GPU is then idle and admits
it; it finishes within ``M`` more.  So **a request that arrives after step
``a`` with ``k`` unfinished requests, itself included, finishes by step
``a + 2 * M * k``** (``deadline``), under ``fcfs`` with every request ready.
(Under ``priority`` later arrivals may rank first, and a request not ready
waits on the world: neither is bounded by the scheduler.)

Theory of operation: ``Model`` is the spec's scheduler over the spec's block
manager models (plain or prefix-caching: ``memory`` picks the module whose
transitions apply); ``step``, ``arrive`` and ``abort`` are pure transitions
returning a new ``Model``.  An implementation's ``snapshot()`` returns a
``SchedulerState`` (its groups and both managers' snapshots); ``abstract``
gives the model's.  Implementations may place blocks differently, so
refinement compares everything but block numbers (``view``).

The factory an ``Implementation`` provides: ``scheduler(gpu, cpu, config)``
with ``gpu`` and ``cpu`` two empty ``kvspec.spec.block_manager.BlockManager``s of the
same block size and kind -- plain, or both ``PrefixCachingManager``s -- (each over its own pool) and ``config`` a ``SchedulerConfig``;
it returns a ``Scheduler``.

Invariants (checked after every step; the pool and manager invariants hold on
both devices too; ``kvspec.spec.admission`` adds those of cache hits, readiness,
priorities and grants):

* ``invariant_memory_never_overcommitted`` [safety] -- each device holds at most its
  capacity, and its pool counts exactly the blocks its tables name.
* ``invariant_no_leak_across_preemption`` [safety] -- only running or swapped groups
  hold blocks; with no request unfinished both pools are entirely free.
* ``invariant_group_on_one_device`` [safety] -- a group's sequences are all on its
  device and none elsewhere.
* ``invariant_swap_restores_contents`` [safety] -- every held sequence reads back,
  through its device's tables, exactly its group's tokens.
* ``invariant_recompute_restores_tokens`` [safety] -- a group's tokens are its prompt
  and the tokens it sampled, whatever preemption it went through.
* ``invariant_oldest_never_preempted`` [safety] -- the earliest-arrived unfinished
  request is never a victim.
* ``invariant_admission_in_arrival_order`` [convention] -- no group is admitted or resumed
  ahead of an earlier-arrived (under ``priority``: higher-ranked) ready one still waiting or swapped.
* ``invariant_finishes_within_bound`` [safety] -- under ``fcfs`` with every request ready,
  every request finishes by its deadline.
* ``invariant_scheduler_refines_spec`` [convention] -- the implementation is in the model's
  state, block numbers aside.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from types import ModuleType
from typing import Literal, Protocol, runtime_checkable

import attrs

from kvspec.spec import block_manager, prefix_cache
from kvspec.spec.block_manager import (
    Manager,
    ManagerState,
    SeqId,
    blocks_for,
    check_tokens,
    holders,
    read_through_table,
)
from kvspec.spec.errors import InvalidOperation, RequestTooLarge
from kvspec.spec.invariants import Group as InvariantGroup
from kvspec.spec.invariants import diff_states, invariant
from kvspec.spec.prefix_cache import CachingManager, max_hit_blocks

RequestId = int
Preemption = Literal["swap", "recompute"]
QueuePolicy = Literal["fcfs", "priority"]
Location = Literal["waiting", "running", "swapped"]
Memory = Manager | CachingManager
VOCABULARY = 50_272  # OPT's; any positive size would do


@attrs.frozen
class Request:
    request_id: RequestId
    prompt: tuple[int, ...] = attrs.field(converter=tuple)
    max_new_tokens: int
    n: int = 1
    priority: int = 0  # under the priority policy, lower runs first
    ready: bool = True  # False: it waits on something outside the scheduler until ``mark_ready``


@attrs.frozen
class SchedulerConfig:
    preemption: Preemption = "recompute"
    watermark: int = 0  # GPU blocks kept free after an admission, unless the GPU is idle
    policy: QueuePolicy = "fcfs"


@attrs.frozen
class Group:
    """A request's sequence group and where it stands."""

    request: Request
    arrival: int
    location: Location = "waiting"
    generated: int = 0
    preemptions: int = 0
    ready: bool = True

    @property
    def seqs(self) -> tuple[tuple[RequestId, int], ...]:
        return tuple((self.request.request_id, s) for s in range(self.request.n))

    def tokens(self, sample: int) -> tuple[int, ...]:
        rid = self.request.request_id
        return self.request.prompt + tuple(sampled_token(rid, sample, i) for i in range(self.generated))


@attrs.frozen
class SchedulerState:
    """What ``snapshot()`` returns: unfinished groups in arrival order, and both devices."""

    config: SchedulerConfig
    steps: int
    arrived: tuple[RequestId, ...]  # every request ever accepted, in arrival order
    groups: tuple[Group, ...]
    finished: tuple[RequestId, ...]  # in completion order
    gpu: ManagerState
    cpu: ManagerState


@attrs.frozen
class StepReport:
    """What one iteration did; ``preempted`` pairs each victim with how it was preempted.

    ``granted`` pairs each request that decodes in this step with the tokens it was granted;
    ``cached_tokens`` pairs each prefill admission with the prompt tokens the prefix cache supplied.
    """

    preempted: tuple[tuple[RequestId, Preemption], ...] = ()
    granted: tuple[tuple[RequestId, int], ...] = ()
    admitted: tuple[RequestId, ...] = ()
    cached_tokens: tuple[tuple[RequestId, int], ...] = ()
    finished: tuple[RequestId, ...] = ()
    decode_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


@runtime_checkable
class Scheduler(Protocol):
    @property
    def gpu(self) -> block_manager.BlockManager: ...
    @property
    def cpu(self) -> block_manager.BlockManager: ...
    def arrive(self, request: Request) -> None: ...
    def step(self) -> StepReport: ...
    def abort(self, request_id: RequestId) -> None: ...
    def mark_ready(self, request_id: RequestId) -> None: ...
    def snapshot(self) -> SchedulerState: ...


# -- arithmetic both the model and implementations use --------------------------------


def sampled_token(request_id: RequestId, sample: int, position: int) -> int:
    """The token a sample generates at a position: fixed, so a recomputed run samples the same."""
    return (request_id * 1_000_003 + sample * 7_919 + position * 104_729) % VOCABULARY


def group_blocks(prompt_len: int, generated: int, n: int, block_size: int) -> int:
    """Blocks a group holds: whole prompt blocks shared by its samples, the rest private once written."""
    if generated == 0:
        return blocks_for(prompt_len, block_size)
    shared = prompt_len // block_size
    return shared + n * (blocks_for(prompt_len + generated, block_size) - shared)


def prefill_demand(request: Request, generated: int, block_size: int, hits: int, revived: int) -> int:
    """Blocks a prefill admission takes: its blocks less its ``hits``, plus the ``revived`` hits.

    A hit is counted once: it lowers the demand.  A hit whose block sits in the
    free queue is also counted there as free, and admission takes it out: so it
    is demand again, or the supply would count it a second time.
    """
    return group_blocks(len(request.prompt), generated, request.n, block_size) - hits + revived


def rank(group: Group, policy: QueuePolicy) -> tuple[int, int]:
    """Where a group stands in the queue: earlier first; ``priority`` ranks by priority, then arrival."""
    return (group.request.priority if policy == "priority" else 0, group.arrival)


def peak_blocks(request: Request, block_size: int) -> int:
    return group_blocks(len(request.prompt), request.max_new_tokens, request.n, block_size)


def append_demand(
    tables: Sequence[Sequence[int]], lengths: Sequence[int], refcount: Mapping[int, int], block_size: int
) -> int:
    """Blocks one more token per sequence takes: a fresh block after a full one, a copy of a shared partial one.

    The last of a partial block's holders writes in place, so k holders of a
    block nobody else holds make k-1 copies.
    """
    fresh = sum(1 for length in lengths if length % block_size == 0)
    partial = holders(
        {i: (t[-1],) for i, (t, length) in enumerate(zip(tables, lengths, strict=True)) if length % block_size}
    )
    return fresh + sum(k if refcount[b] > k else k - 1 for b, k in partial.items())


def deadline(arrived_after_step: int, unfinished_at_arrival: int, longest_output: int) -> int:
    """The step by which a request must be finished (see the module docstring)."""
    return arrived_after_step + 2 * longest_output * unfinished_at_arrival


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
    if not isinstance(request.ready, bool):
        raise InvalidOperation(f"request {request.request_id!r}: ready must be a bool, got {request.ready!r}")
    return request


def check_config(config: SchedulerConfig) -> None:
    if config.preemption not in ("swap", "recompute") or config.policy not in ("fcfs", "priority"):
        raise InvalidOperation(f"unusable scheduler config {config!r}")
    if not isinstance(config.watermark, int) or config.watermark < 0:
        raise InvalidOperation(f"unusable scheduler config {config!r}")


def check_fits_alone(request: Request, gpu_capacity: int, block_size: int) -> None:
    need = peak_blocks(request, block_size)
    if need > gpu_capacity:
        raise RequestTooLarge(
            f"request {request.request_id!r} needs {need} blocks at its longest, the GPU has {gpu_capacity}"
        )


def admissible(need: int, free: int, watermark: int, gpu_idle: bool) -> bool:
    return need <= free if gpu_idle else need + watermark <= free


# -- the model -------------------------------------------------------------------------


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


@attrs.frozen
class View:
    """What refinement compares: everything but which physical blocks hold what."""

    config: SchedulerConfig
    steps: int
    arrived: tuple[RequestId, ...]
    groups: tuple[Group, ...]
    finished: tuple[RequestId, ...]
    gpu_tokens: Mapping[SeqId, tuple[int, ...]]
    cpu_tokens: Mapping[SeqId, tuple[int, ...]]
    gpu_blocks_in_use: int
    cpu_blocks_in_use: int


def view(state: SchedulerState) -> View:
    return View(
        config=state.config,
        steps=state.steps,
        arrived=state.arrived,
        groups=state.groups,
        finished=state.finished,
        gpu_tokens=dict(state.gpu.tokens),
        cpu_tokens=dict(state.cpu.tokens),
        gpu_blocks_in_use=state.gpu.pool.capacity - state.gpu.pool.num_free,
        cpu_blocks_in_use=state.cpu.pool.capacity - state.cpu.pool.num_free,
    )


# -- invariants ------------------------------------------------------------------------


DEVICE_OF = {"running": "gpu", "swapped": "cpu"}  # where a group's blocks live; a waiting group holds none


def _devices(state: SchedulerState) -> dict[str, ManagerState]:
    return {"gpu": state.gpu, "cpu": state.cpu}


@invariant(
    "a device cannot hold more than it has; blocks in use that no table names are memory nobody can use",
    "safety",
    fails_only_with="a block is in use exactly when a table names it, and tables name only the pool's blocks: both are invariant_refcount_matches_holders on each device",
)
def invariant_memory_never_overcommitted(state: SchedulerState) -> str | None:
    for name, manager in _devices(state).items():
        named = {b for t in manager.tables.values() for b in t}
        in_use = {b for b, r in enumerate(manager.pool.refcounts) if r > 0}
        if len(named) > manager.pool.capacity:
            return f"{name} tables name {len(named)} blocks, the device has {manager.pool.capacity}"
        if named != in_use:
            return f"{name} pool counts {len(in_use)} blocks in use, its tables name {len(named)}"
    return None


@invariant(
    "blocks a waiting, finished or aborted request still holds are lost to everyone for good",
    "safety",
)
def invariant_no_leak_across_preemption(state: SchedulerState) -> str | None:
    holding = {g.request.request_id for g in state.groups if g.location != "waiting"}
    for name, manager in _devices(state).items():
        stray = sorted({repr(s) for s in manager.tables if not (isinstance(s, tuple) and s[0] in holding)})
        if stray:
            return f"{name} holds sequences {stray} of requests that are waiting, finished or gone"
        if not state.groups and manager.pool.num_free != manager.pool.capacity:
            return (
                f"nothing is unfinished, yet {name} has {manager.pool.capacity - manager.pool.num_free} blocks in use"
            )
    return None


@invariant(
    "a group's samples share blocks and run together: split across devices, neither half can run",
    "safety",
)
def invariant_group_on_one_device(state: SchedulerState) -> str | None:
    for group in state.groups:
        home = DEVICE_OF.get(group.location)
        for name, manager in _devices(state).items():
            present = [s for s in group.seqs if s in manager.tables]
            expected = list(group.seqs) if name == home else []
            if present != expected:
                return f"request {group.request.request_id!r} is {group.location}, yet {name} holds {present}"
    return None


@invariant(
    "a swapped group must come back with exactly the KV it left with, or it continues from corrupt state",
    "safety",
    fails_only_with="a table reads back its sequence's tokens (invariant_read_back_exact) and those are the group's (invariant_recompute_restores_tokens)",
)
def invariant_swap_restores_contents(state: SchedulerState) -> str | None:
    for group in state.groups:
        manager = _devices(state).get(DEVICE_OF.get(group.location, ""))
        for sample, seq in enumerate(group.seqs):
            if manager is None or seq not in manager.tables:
                continue
            tokens = group.tokens(sample)
            got = read_through_table(manager.contents, manager.tables[seq], len(tokens), manager.block_size)
            if got != tokens:
                return f"{group.location} sequence {seq!r} reads back {got}, expected {tokens}"
    return None


@invariant(
    "preemption is invisible to the user: a recomputed request continues with the same tokens",
    "safety",
    fails_only_with="where a model runs, a sequence's tokens are the model's, which restores them by construction: "
    "other tokens fail invariant_scheduler_refines_spec",
)
def invariant_recompute_restores_tokens(state: SchedulerState) -> str | None:
    for group in state.groups:
        manager = _devices(state).get(DEVICE_OF.get(group.location, ""))
        if manager is None:
            continue
        for sample, seq in enumerate(group.seqs):
            if seq in manager.tokens and manager.tokens[seq] != group.tokens(sample):
                return (
                    f"sequence {seq!r} holds {manager.tokens[seq]}, its prompt and samples are {group.tokens(sample)}"
                )
    return None


@invariant(
    "the oldest request must always make progress; preempting it is what lets a scheduler livelock",
    "safety",
)
def invariant_oldest_never_preempted(before: SchedulerState, report: StepReport) -> str | None:
    if before.groups and any(rid == before.groups[0].request.request_id for rid, _ in report.preempted):
        return f"request {before.groups[0].request.request_id!r}, the earliest unfinished, was preempted"
    return None


@invariant(
    "first come, first served: overtaking starves large requests and breaks the deadlock-freedom argument",
    "convention",
)
def invariant_admission_in_arrival_order(after: SchedulerState, report: StepReport) -> str | None:
    """Arrival order within the policy's rank (``rank``): under ``fcfs``, arrival order itself.

    The queue itself -- the unfinished groups, as the snapshot lists them -- stays in arrival order: a
    request passed over (not ready, say) keeps its place.
    """
    for i, group in enumerate(after.groups):
        later = [g.request.request_id for g in after.groups[:i] if g.arrival > group.arrival]
        if later:
            return (
                f"request {group.request.request_id!r} lost its place: it is queued behind later request {later[0]!r}"
            )
    ranks = {g.request.request_id: rank(g, after.config.policy) for g in after.groups}
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
    "deadlock freedom: when every request fits alone, each finishes within the bound the spec states",
    "safety",
)
def invariant_finishes_within_bound(state: SchedulerState, deadlines: Mapping[RequestId, int]) -> str | None:
    for group in state.groups:
        due = deadlines[group.request.request_id]
        if state.steps > due:
            return f"request {group.request.request_id!r} is still {group.location} at step {state.steps}, due by {due}"
    return None


@invariant(
    "the implementation must be in exactly the state the model of its declared conventions predicts",
    "convention",
)
def invariant_scheduler_refines_spec(actual: SchedulerState, expected: SchedulerState) -> str | None:
    if view(actual) != view(expected):
        return diff_states(view(actual), view(expected))
    return None


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
"""Every safety rule over a scheduler's snapshot, both devices' managers included (the deadline apart: it
holds only under ``fcfs`` with every request ready)."""
