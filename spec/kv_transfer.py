"""Layer 4, asynchronous KV transfers: disaggregated prefill and decode, KV connectors, offloading.

Rules (the location table is ``kvspec.spec.scheduler``'s, and this module extends that chapter's records and
model with what transfers add -- ``TransferRequest``, ``TransferGroup``, ``TransferState``, ``TransferModel`` --
as ``radix_conventions`` extends the radix chapter's; the optional operation ``finish_transfer`` of the scheduler
kind, ``kv_transfer``, is this module's; vLLM v1's scheduler and its ``KVConnectorBase_V1`` are the engine shape):

* A request (a ``TransferRequest``) may arrive with ``remote_prompt``: its
  prompt's KV was computed elsewhere (a prefill instance, an offload tier;
  vLLM's connector answers ``get_num_new_matched_tokens`` with an
  asynchronous load).  Admission takes it in rank order as a prefill -- the
  same blocks, the same watermark -- but the blocks become the **landing
  zone** of a load: the group is *loading* (vLLM's
  ``WAITING_FOR_REMOTE_KVS``), not ready, and neither decodes nor is
  preempted until the load ends.  The step report lists it as admitted and
  as ``loading``; no prompt token is computed.
* ``finish_transfer(request_id, outcome)`` is the worker's report of a
  transfer's end (vLLM's ``finished_recving`` / ``finished_sending``):

  - a load ``"done"``: the KV landed, the group runs (vLLM's
    ``_update_waiting_for_remote_kv``);
  - a load ``"failed"``: its blocks are freed, and by ``config.load_failure``
    the request computes its prompt here (back to waiting, ready) or is
    aborted (vLLM's ``kv_load_failure_policy``);
  - a load ``"empty"`` -- it completed with nothing to transfer (the source
    had nothing for it): its blocks are freed and it computes its prompt here,
    whatever the policy (nothing failed);
  - a send, whatever its outcome: the blocks it read are freed.

* **A transfer in flight is a holder.**  Aborting a loading request drops the
  request at once, but its landing zone stays with the load until
  ``finish_transfer`` reports the load's end (the DMA writes there until
  then; vLLM frees a finished request's blocks on ``finished_recving``).  A
  request that ``sends_kv`` finishes with its last samples' blocks held by the
  send (vLLM's ``request_finished`` answering ``delay_free_blocks``).  Its
  blocks are counted in the pool, named by the transfer's sequences in the
  GPU's tables, never free, never another request's.
* ``mark_ready`` refuses a loading request (its load's end readies it);
  ``finish_transfer`` refuses a request with no transfer in flight and an
  unknown outcome.  Both change nothing.
* Left out: landing zones over a prefix cache (vLLM caches a landing zone's
  blocks only once they landed; kvspec's prefix-caching managers hash a
  prompt as they write it) -- transfers are modelled over plain managers --
  and partial loads (some blocks landed, the rest recomputed).

Theory.  A transfer owns its blocks between its start and its reported end,
whatever becomes of the request: the scheduler's only safe answer to an abort
or a finish under a transfer is to leave the blocks to the transfer.  The
deadline of ``kvspec.spec.preemption`` does not hold with transfers, nor does
``invariant_oldest_never_preempted`` while one is in flight: a transfer's end
is the world's, and the blocks it holds may be the ones the oldest request
needs.  A loading group counts as running for the watermark (admission's
``BUSY``): it runs the moment its KV lands.

Invariants (tier in brackets):

* ``invariant_transfer_blocks_held`` [safety] -- a transfer in flight keeps its
  sequences, and every block it started on is in use and named only by that
  request's sequences.
* ``invariant_no_decode_before_load_lands`` [safety] -- a request whose load is
  in flight neither runs nor is granted tokens.
* ``invariant_failed_load_recomputes`` [safety] -- after a load failed or moved
  nothing, its request holds no blocks until it is admitted again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Literal, Protocol, cast, runtime_checkable

import attrs

from kvspec.spec import scheduler as chapter
from kvspec.spec.block_manager import SeqId
from kvspec.spec.components import optional_operation
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import invariant
from kvspec.spec.scheduler import (
    SCHEDULER,
    Group,
    Memory,
    Model,
    Request,
    RequestId,
    Scheduler,
    SchedulerState,
    StepReport,
    memory,
    release,
    relocate,
)

Outcome = Literal["done", "failed", "empty"]
OUTCOMES: tuple[Outcome, ...] = ("done", "failed", "empty")


@runtime_checkable
class TransferringScheduler(Scheduler, Protocol):
    """A scheduler whose prompts may be loaded from elsewhere (``scheduler``'s optional ``kv_transfer``)."""

    def finish_transfer(self, request_id: RequestId, outcome: Outcome) -> None:
        """The worker's report that a request's load or send ended: ``done``, ``failed`` or ``empty``."""
        ...


KV_TRANSFER = optional_operation("kv_transfer", TransferringScheduler, "finish_transfer", kinds=(SCHEDULER.name,))


# -- what this chapter adds to the scheduler's records and model ------------------------


@attrs.frozen
class TransferRequest(Request):
    """A request whose KV crosses instances: the scheduler's request and where its KV comes from and goes.

    A request of the scheduler chapter's own record transfers nothing: these flags are its defaults.
    """

    remote_prompt: bool = False  # its prompt's KV was computed elsewhere: admission loads it
    sends_kv: bool = False  # its KV is sent elsewhere when it finishes: its blocks wait for the send


@attrs.frozen
class TransferGroup(Group):
    """A ``TransferRequest``'s group: the scheduler's, and whether admission is still to load its prompt's KV.

    The group's, not the request's: once a load ends -- landed, failed or empty -- any later admission (after a
    recompute, or the failure) computes the prompt here.
    """

    remote: bool = False


@attrs.frozen
class Transfer:
    """A KV transfer in flight: a load into a request's landing zone, or a send of a finished request's KV; either
    holds the GPU blocks of ``seqs`` until it ends."""

    request_id: RequestId
    direction: Literal["load", "send"]
    seqs: tuple[SeqId, ...]


@attrs.frozen
class TransferState(SchedulerState):
    """A transferring scheduler's snapshot: the scheduler's, and the transfers in flight, in the order they started.

    Outliving the request they serve (a load under an abort, a send after the finish), the transfers are the
    chapter's state, not any group's.  A scheduler with none in flight may answer the scheduler's own record:
    refinement reads the two alike (``kvspec.spec.scheduler.View``).
    """

    transfers: tuple[Transfer, ...] = ()


@attrs.frozen
class TransferModel(Model):
    """The spec's scheduler with transfers in flight: a scheduler's model becomes one at its first transfer, so the
    scheduler chapter's model holds nothing of this one's."""

    transfers: tuple[Transfer, ...] = ()


def new_group(request: Request, arrival: int) -> Group:
    """A request's group as it arrives: a ``TransferRequest``'s is this chapter's, its load to start if its prompt
    was computed elsewhere."""
    if isinstance(request, TransferRequest):
        return TransferGroup(request, arrival, ready=request.ready, remote=request.remote_prompt)
    return Group(request, arrival, ready=request.ready)


def loads_prompt(group: Group) -> bool:
    """Whether admitting ``group`` loads its prompt's KV, computed elsewhere, rather than compute it."""
    return isinstance(group, TransferGroup) and group.remote


def sends_kv(request: Request) -> bool:
    return isinstance(request, TransferRequest) and request.sends_kv


def transfers_in_flight(state: SchedulerState | Model) -> tuple[Transfer, ...]:
    """The transfers in flight: none in a state of the scheduler chapter's own record."""
    return state.transfers if isinstance(state, TransferState | TransferModel) else ()


def with_transfers(model: Model, transfers: tuple[Transfer, ...]) -> TransferModel:
    """``model`` with ``transfers`` in flight: this chapter's model, whichever ``model`` was."""
    return TransferModel(**(attrs.asdict(model, recurse=False) | {"transfers": transfers}))


def abstract(model: Model) -> TransferState:
    """The model as a transferring scheduler's snapshot reads: the scheduler chapter's, and the transfers in flight."""
    state = chapter.abstract(model)
    return TransferState(**attrs.asdict(state, recurse=False), transfers=transfers_in_flight(model))


# -- the transitions ----------------------------------------------------------------------


def start_load(model: Model, group: Group, report: StepReport) -> tuple[Model, StepReport]:
    """The group's prompt blocks, just written on the GPU, become a load's landing zone: it waits, not ready."""
    rid = group.request.request_id
    model = with_transfers(model, transfers_in_flight(model) + (Transfer(rid, "load", group.seqs),))
    model = relocate(model, attrs.evolve(group, ready=False), "load")
    return model, attrs.evolve(report, loading=report.loading + (rid,))


def start_send(model: Model, rid: RequestId, seqs: Sequence[SeqId]) -> Model:
    """A finished request's last sequences stay on the GPU for the send of its KV."""
    return with_transfers(model, transfers_in_flight(model) + (Transfer(rid, "send", tuple(seqs)),))


def finish_transfer(model: Model, request_id: RequestId, outcome: Outcome) -> Model:
    """The worker reports the end of ``request_id``'s transfer in flight (see the module docstring)."""
    if outcome not in OUTCOMES:
        raise InvalidOperation(f"a transfer ends {' or '.join(OUTCOMES)}, not {outcome!r}")
    in_flight = transfers_in_flight(model)
    transfer = next((t for t in in_flight if t.request_id == request_id), None)
    if transfer is None:
        raise InvalidOperation(f"request {request_id!r} has no KV transfer in flight")
    model = with_transfers(model, tuple(t for t in in_flight if t is not transfer))
    owner = next((g for g in model.groups if g.request.request_id == request_id), None)
    if transfer.direction == "send" or owner is None:
        return attrs.evolve(model, gpu=free_all(model.gpu, transfer.seqs))
    # a load's owner is the group start_load took it for: this chapter's
    landed = attrs.evolve(cast(TransferGroup, owner), ready=True, remote=False)
    if outcome == "done":
        return relocate(model, landed, "loaded")
    model = release(model, owner)
    if outcome == "failed" and model.config.load_failure == "abort":
        return relocate(model, owner, "abort")
    return relocate(model, landed, "load_failed")


def free_all(device: Memory, seqs: Sequence[SeqId]) -> Memory:
    for seq in seqs:
        device = memory(device).free(device, seq)
    return device


def request_of(seq: SeqId) -> object:
    """The request a scheduler's sequence ``(request_id, sample)`` belongs to."""
    return seq[0] if isinstance(seq, tuple) else None


@invariant(
    "a transfer in flight writes (a load) or reads (a send) its blocks whatever the scheduler decided since: "
    "a block freed or handed to another request under it is corrupted, or leaks another request's KV",
    "safety",
    needs=(KV_TRANSFER,),
)
def invariant_transfer_blocks_held(in_flight: Mapping[RequestId, Collection[int]], state: SchedulerState) -> str | None:
    """``in_flight``: each transfer not yet reported ended, with the GPU blocks its sequences held when it began;
    and each transfer the state lists holds its sequences' tables."""
    pool, tables = state.gpu.pool, state.gpu.tables
    for transfer in transfers_in_flight(state):
        gone = [seq for seq in transfer.seqs if seq not in tables]
        if gone:
            return f"request {transfer.request_id!r}'s {transfer.direction} is in flight, yet the GPU freed {gone}"
    for rid, blocks in in_flight.items():
        for block in sorted(blocks):
            if pool.refcounts[block] == 0:
                return f"block {block} of request {rid!r}'s transfer in flight is free"
            others = sorted({repr(seq) for seq, table in tables.items() if block in table and request_of(seq) != rid})
            if others:
                return f"block {block} of request {rid!r}'s transfer in flight is held by {others}"
    return None


@invariant(
    "a landing zone holds what was there before the KV lands: decoding over it computes from garbage",
    "safety",
    needs=(KV_TRANSFER,),
)
def invariant_no_decode_before_load_lands(
    loads: Collection[RequestId], state: SchedulerState, report: StepReport
) -> str | None:
    """``loads``: the requests whose loads were in flight when the step began (and not reported ended)."""
    running = sorted(
        g.request.request_id for g in state.groups if g.location == "running" and g.request.request_id in loads
    )
    granted = sorted(rid for rid, _ in report.granted if rid in loads)
    if running or granted:
        return f"requests {running or granted} run while their KV loads are in flight"
    return None


@invariant(
    "a failed or empty load left no KV in the landing zone: running over it serves garbage, so the prompt is "
    "computed again (or the request aborted)",
    "safety",
    needs=(KV_TRANSFER,),
)
def invariant_failed_load_recomputes(request_id: RequestId, outcome: str, state: SchedulerState) -> str | None:
    if outcome == "done":
        return None
    group = next((g for g in state.groups if g.request.request_id == request_id), None)
    held = [seq for seq in state.gpu.tables if request_of(seq) == request_id]
    if held or (group is not None and group.location != "waiting"):
        where = group.location if group is not None else "gone"
        return f"request {request_id!r}'s load ended {outcome}, yet it is {where} holding {held}"
    return None
