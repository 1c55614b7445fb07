"""Layer 4 -- the scheduler: requests, sequence groups, and one iteration of serving them.

Rules (vLLM §4.5 and §5.2, lecture §6):

* A *request* is a prompt, a number of new tokens to generate and a number of
  samples ``n``.  Its *sequence group* is its ``n`` sequences, ids
  ``(request_id, sample)``; the group is scheduled, preempted and resumed as
  one (all or nothing): its blocks are all on the GPU (*running*), all on the
  CPU (*swapped*) or nowhere (*waiting*).
* A group changes place only as ``MOVES``, the location-transition table,
  says: admission runs it (prefill, swap in), preemption swaps it out or
  sends it back to wait (recompute), and it leaves when it finishes or is
  aborted.
* ``arrive(request)`` (``kvspec.spec.admission``'s) queues the request as waiting (a request may arrive
  *not ready*: see ``mark_ready``).  One whose peak need --
  ``group_blocks(prompt, max_new_tokens, n)``, the blocks it holds after its
  last token -- exceeds the GPU's capacity could never run even alone: it is
  refused with ``RequestTooLarge``, never left to block the queue.
* **Samples finish apart** (``kvspec.spec.sample_groups``): sample ``s`` stops
  after ``request.output_length(s)`` tokens (its stop token; ``max_new_tokens``
  when ``stops`` is empty) and frees its sequence at once; the group's other
  samples keep decoding, and a preemption moves or drops, and a resumption
  restores, only the samples still unfinished (``Group.live``).
* Groups are *ranked* by the queue policy (``rank``): ``fcfs`` by arrival;
  ``priority`` by the request's ``priority`` (lower first, as in vLLM), then
  by arrival.
* ``step()`` is one iteration: the *decode phase* grants each running group
  one token per sample (``sampled_token``, a deterministic stand-in for the
  model's output), preempting the lowest-ranked running group while a grant
  does not fit; then the *admission phase* resumes or prefills the groups
  not running, in rank order, while they fit.  A prefill forks the prompt into
  the group's samples: under managers that copy a partial last block at the
  fork (``SchedulerConfig.fork_partial_block="copy"``, HF's) those copies are
  part of what the admission takes.
* ``mark_ready(request_id)`` -- the remote KV arrived, the grammar compiled,
  an adapter slot opened: a request that arrived not ready may be admitted
  (the optional operation ``NOT_READY``, ``kvspec.spec.admission``'s).
* ``abort(request_id)`` drops an unfinished request and frees its blocks.
* **KV transfers** (``kvspec.spec.kv_transfer``, the optional operation
  ``finish_transfer``): a request whose prompt was computed elsewhere is
  admitted *loading* -- its blocks the landing zone of a load, it not ready --
  until the load ends; a request that sends its KV on finish leaves its blocks
  to the send.  A transfer in flight holds its blocks like any table.  That
  chapter extends this one's records with what it adds (a request's transfer
  flags, a group's load still to start, the transfers in flight), so these
  name none of it; the location table is this chapter's, ``loading`` included.
* Bad input (duplicate or unknown id, empty prompt, ``n`` or
  ``max_new_tokens`` below 1, ``stops`` other than ``n`` lengths in
  1..``max_new_tokens``, marking a ready or loading request ready) raises
  ``InvalidOperation`` and changes nothing.

The chapter reads top to bottom in three modules, each with its rules, its
transitions and its invariants: this one (records, the location table, the
protocol, the spec's scheduler ``Model`` with its pure transitions -- every
change of place through ``relocate``, by the table -- and the rules over
memory); ``kvspec.spec.preemption`` (the decode phase, the deadlock bound,
swap preemption); ``kvspec.spec.admission`` (the admission phase, requests
not ready, priorities, prefix caching, and ``step``: one iteration of both).
Each optional operation (mode) is declared in the module of its phase.

The factory an ``Implementation`` provides: ``scheduler(gpu, cpu, config)``
with ``gpu`` and ``cpu`` two empty ``BlockManager``s of one block size and
kind -- plain, or both ``PrefixCachingManager``s -- each over its own pool;
its ``snapshot()`` is a ``SchedulerState``.  Implementations may place blocks
differently, so refinement compares everything but block numbers (``view``).

Invariants (the pool and manager invariants hold on both devices too):

* ``invariant_memory_never_overcommitted`` [safety] -- each device holds at most its
  capacity, and its pool counts exactly the blocks its tables name.
* ``invariant_scheduler_refines_spec`` [convention] -- the implementation is in the model's
  state, block numbers aside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Literal, Protocol, runtime_checkable

import attrs

from kvspec.spec import block_manager, prefix_cache, swap
from kvspec.spec.block_manager import Manager, ManagerState, SeqId, blocks_for
from kvspec.spec.components import component_kind
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import invariant, refinement
from kvspec.spec.prefix_cache import CachingManager

RequestId = int
Preemption = Literal["swap", "recompute"]
QueuePolicy = Literal["fcfs", "priority"]
LoadFailure = Literal["recompute", "abort"]
Location = Literal["waiting", "loading", "running", "swapped"]
Event = Literal["prefill", "load", "loaded", "load_failed", "swap_in", "swap_out", "recompute", "finish", "abort"]
VOCABULARY = 50_272  # OPT's; any positive size would do

# The location-transition table: where each event takes a group (None: it leaves the queue).  The transition
# that raises the event writes, moves or frees the group's blocks, so they are where DEVICE_OF says.
MOVES: Mapping[tuple[Location, Event], Location | None] = {
    ("waiting", "prefill"): "running",  # admitted: its prompt, and the tokens it had sampled, written on the GPU
    ("waiting", "load"): "loading",  # admitted: its prompt's blocks allocated as the landing zone of a load
    ("loading", "loaded"): "running",  # its prompt's KV landed (kvspec.spec.kv_transfer)
    ("loading", "load_failed"): "waiting",  # the load failed or moved nothing: its blocks freed, it recomputes
    ("swapped", "swap_in"): "running",  # admitted: its blocks moved back from the CPU
    ("running", "swap_out"): "swapped",  # preempted by swap: its blocks moved to the CPU
    ("running", "recompute"): "waiting",  # preempted by recompute: its blocks freed
    ("running", "finish"): None,  # its last token decoded: its blocks freed, it is finished
    ("waiting", "abort"): None,
    ("loading", "abort"): None,  # aborted: its blocks stay with the load in flight until the load ends
    ("running", "abort"): None,  # aborted: its blocks freed
    ("swapped", "abort"): None,
}
DEVICE_OF: Mapping[str, str] = {"loading": "gpu", "running": "gpu", "swapped": "cpu"}  # waiting: no blocks


def as_tokens(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(tokens)


@attrs.frozen
class Request:
    request_id: RequestId
    prompt: tuple[int, ...] = attrs.field(converter=as_tokens)
    max_new_tokens: int
    n: int = 1
    priority: int = 0  # under the priority policy, lower runs first
    ready: bool = True  # False: it waits on something outside the scheduler until ``mark_ready``
    stops: tuple[int, ...] = attrs.field(default=(), converter=as_tokens)  # each sample's output length

    def output_length(self, sample: int) -> int:
        """The tokens sample ``sample`` generates: up to its stop token, else ``max_new_tokens``."""
        return self.stops[sample] if self.stops else self.max_new_tokens


@attrs.frozen
class SchedulerConfig:
    preemption: Preemption = "recompute"
    watermark: int = 0  # GPU blocks kept free after an admission, unless the GPU is idle
    policy: QueuePolicy = "fcfs"
    load_failure: LoadFailure = "recompute"  # a failed load: compute the prompt here, or abort the request
    # the managers' fork, as their conventions declare it: "copy" copies a partial last block at the fork itself,
    # so a prefill of n samples takes its n-1 further copies at admission, not at their first decode
    fork_partial_block: Literal["share", "copy"] = "share"


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
    def live(self) -> tuple[int, ...]:
        """The samples still decoding: a finished sample holds no blocks and is never resumed."""
        return tuple(s for s in range(self.request.n) if self.request.output_length(s) > self.generated)

    @property
    def seqs(self) -> tuple[tuple[RequestId, int], ...]:
        """The sequences of the unfinished samples: the ones that hold blocks, move and are restored."""
        return tuple((self.request.request_id, s) for s in self.live)

    def tokens(self, sample: int) -> tuple[int, ...]:
        rid, length = self.request.request_id, min(self.generated, self.request.output_length(sample))
        return self.request.prompt + tuple(sampled_token(rid, sample, i) for i in range(length))


@attrs.frozen
class SchedulerState:
    """What ``snapshot()`` returns: unfinished groups in arrival order, both devices, and the queue admission
    takes the groups not running from, in its order (where the implementation tells it)."""

    config: SchedulerConfig
    steps: int
    arrived: tuple[RequestId, ...]  # every request ever accepted, in arrival order
    groups: tuple[Group, ...]
    finished: tuple[RequestId, ...]  # in completion order
    gpu: ManagerState
    cpu: ManagerState
    queue: tuple[RequestId, ...] | None = None  # the groups not running, as admission takes them (None: not told)


@attrs.frozen
class StepReport:
    """What one iteration did; ``preempted`` pairs each victim with how it was preempted.

    ``granted`` pairs each request that decodes in this step with the tokens it was granted;
    ``cached_tokens`` pairs each prefill admission with the prompt tokens the prefix cache supplied.
    """

    preempted: tuple[tuple[RequestId, Preemption], ...] = ()
    granted: tuple[tuple[RequestId, int], ...] = ()
    admitted: tuple[RequestId, ...] = ()
    loading: tuple[RequestId, ...] = ()  # of the admitted, those whose prompt's KV is being loaded, not computed
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
    def snapshot(self) -> SchedulerState: ...


SCHEDULER = component_kind("scheduler", Scheduler, builds="scheduler(gpu_manager, cpu_manager, config)")


# -- arithmetic both the model and implementations use --------------------------------


def sampled_token(request_id: RequestId, sample: int, position: int) -> int:
    """The token a sample generates at a position: fixed, so a recomputed run samples the same."""
    return (request_id * 1_000_003 + sample * 7_919 + position * 104_729) % VOCABULARY


def group_blocks(prompt_len: int, generated: int, n: int, block_size: int, copies_at_fork: bool = False) -> int:
    """Blocks a group holds: whole prompt blocks shared by its samples, the rest private once written -- or,
    ``copies_at_fork``, once forked."""
    if generated == 0 and not copies_at_fork:
        return blocks_for(prompt_len, block_size)
    shared = prompt_len // block_size
    return shared + n * (blocks_for(prompt_len + generated, block_size) - shared)


def peak_blocks(request: Request, block_size: int) -> int:
    """Every sample at ``max_new_tokens``: a stop token comes when it comes, no engine knows it in advance."""
    return group_blocks(len(request.prompt), request.max_new_tokens, request.n, block_size)


def rank(group: Group, policy: QueuePolicy) -> tuple[int, int]:
    """Where a group stands in the queue: earlier first; ``priority`` ranks by priority, then arrival."""
    return (group.request.priority if policy == "priority" else 0, group.arrival)


def check_config(config: SchedulerConfig) -> None:
    if config.preemption not in ("swap", "recompute") or config.policy not in ("fcfs", "priority"):
        raise InvalidOperation(f"unusable scheduler config {config!r}")
    if config.load_failure not in ("recompute", "abort") or config.fork_partial_block not in ("share", "copy"):
        raise InvalidOperation(f"unusable scheduler config {config!r}")
    if not isinstance(config.watermark, int) or config.watermark < 0:
        raise InvalidOperation(f"unusable scheduler config {config!r}")


# -- the spec's scheduler ---------------------------------------------------------------

Memory = Manager | CachingManager


@attrs.frozen
class Model:
    """A ``SchedulerState`` whose devices are the spec's manager models; a new one has seen no request."""

    config: SchedulerConfig
    gpu: Memory
    cpu: Memory
    steps: int = 0
    arrived: tuple[RequestId, ...] = ()
    groups: tuple[Group, ...] = ()
    finished: tuple[RequestId, ...] = ()


def memory(device: Memory) -> ModuleType:
    """The spec module whose transitions apply to a device: the prefix cache's or the plain manager's."""
    return prefix_cache if isinstance(device, CachingManager) else block_manager


def mover(device: Memory) -> ModuleType:
    """The spec module whose ``move_sequences`` swaps a device's groups out or in (``kvspec.spec.swap``)."""
    return prefix_cache if isinstance(device, CachingManager) else swap


def tables_of(device: Memory) -> Manager:
    """The layer-2 model under a device: its tables, tokens and pool."""
    return device.manager if isinstance(device, CachingManager) else device


def free_blocks(device: Memory) -> int:
    return len(tables_of(device).pool.lru)


def new_model(gpu: Memory, cpu: Memory, config: SchedulerConfig) -> Model:
    if tables_of(gpu).block_size != tables_of(cpu).block_size or type(gpu) is not type(cpu):
        raise InvalidOperation(f"unlike devices: a GPU {type(gpu).__name__}, a CPU {type(cpu).__name__}")
    check_config(config)
    return Model(config, gpu, cpu)


def abstract(model: Model) -> SchedulerState:
    """The model as a snapshot reads: each device's model seen through its own layer's ``abstract``."""
    devices = {name: memory(device).abstract(device) for name, device in (("gpu", model.gpu), ("cpu", model.cpu))}
    queue = tuple(group.request.request_id for group in queued(model))
    return SchedulerState(
        model.config,
        model.steps,
        model.arrived,
        model.groups,
        model.finished,
        **devices,
        queue=queue,
    )


def abort(model: Model, request_id: RequestId) -> Model:
    """Drop the request; a landing zone stays with its load (``kvspec.spec.kv_transfer``)."""
    group = find(model, request_id)
    return relocate(model if group.location == "loading" else release(model, group), group, "abort")


def find(model: Model, request_id: RequestId) -> Group:
    for group in model.groups:
        if group.request.request_id == request_id:
            return group
    raise InvalidOperation(f"request {request_id!r} is not unfinished (never arrived, finished or aborted)")


def replace(model: Model, group: Group) -> Model:
    """The model with ``group`` in its place in the queue."""
    rid = group.request.request_id
    return attrs.evolve(model, groups=tuple(group if g.request.request_id == rid else g for g in model.groups))


def relocate(model: Model, group: Group, event: Event) -> Model:
    """``group`` where ``MOVES`` takes it at ``event``; its blocks were moved or freed first."""
    to = MOVES[group.location, event]
    if to is not None:
        return replace(model, attrs.evolve(group, location=to))
    rid = group.request.request_id
    finished = model.finished + (rid,) if event == "finish" else model.finished
    return attrs.evolve(model, groups=tuple(g for g in model.groups if g.request.request_id != rid), finished=finished)


def release(model: Model, group: Group) -> Model:
    """The model with ``group``'s blocks freed on the device that holds them."""
    device = DEVICE_OF.get(group.location)
    if device is None:
        return model
    held: Memory = getattr(model, device)
    for seq in group.seqs:
        held = memory(held).free(held, seq)
    return attrs.evolve(model, gpu=held) if device == "gpu" else attrs.evolve(model, cpu=held)


def ranking(model: Model) -> Callable[[Group], tuple[int, int]]:
    return lambda group: rank(group, model.config.policy)


def queued(model: Model) -> list[Group]:
    """The groups not running, in the order admission takes them: by rank."""
    return sorted((g for g in model.groups if g.location != "running"), key=ranking(model))


# -- what refinement compares, and the rules over memory ---------------------------------


@attrs.frozen
class View:
    """What refinement compares: everything but which physical blocks hold what.

    ``extension`` is what a later chapter's snapshot adds to ``SchedulerState`` (``kvspec.spec.kv_transfer``'s
    transfers in flight), field by field: refinement compares it without this chapter naming it.  A field at its
    default is left out: it shows nothing of that chapter, as a snapshot of this chapter's own record shows nothing.
    """

    config: SchedulerConfig
    steps: int
    arrived: tuple[RequestId, ...]
    groups: tuple[Group, ...]
    finished: tuple[RequestId, ...]
    gpu_tokens: Mapping[SeqId, tuple[int, ...]]
    cpu_tokens: Mapping[SeqId, tuple[int, ...]]
    gpu_blocks_in_use: int
    cpu_blocks_in_use: int
    extension: Mapping[str, object]


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
        extension=extension(state),
    )


def extension(state: SchedulerState) -> dict[str, object]:
    """The fields a later chapter's snapshot adds, by name, those at their default left out (``View``)."""
    own = attrs.fields_dict(SchedulerState)
    added = (field for field in attrs.fields(type(state)) if field.name not in own)
    return {field.name: getattr(state, field.name) for field in added if getattr(state, field.name) != field.default}


def devices(state: SchedulerState) -> dict[str, ManagerState]:
    return {"gpu": state.gpu, "cpu": state.cpu}


@invariant(
    "a device cannot hold more than it has; blocks in use that no table names are memory nobody can use",
    "safety",
    fails_only_with="a block is in use exactly when a table names it, and tables name only the pool's blocks: both are invariant_refcount_matches_holders on each device",
)
def invariant_memory_never_overcommitted(state: SchedulerState) -> str | None:
    for name, manager in devices(state).items():
        named = {b for t in manager.tables.values() for b in t}
        in_use = {b for b, r in enumerate(manager.pool.refcounts) if r > 0}
        if len(named) > manager.pool.capacity:
            return f"{name} tables name {len(named)} blocks, the device has {manager.pool.capacity}"
        if named != in_use:
            return f"{name} pool counts {len(in_use)} blocks in use, its tables name {len(named)}"
    return None


invariant_scheduler_refines_spec = refinement("invariant_scheduler_refines_spec", view)
