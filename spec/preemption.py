"""Layer 4, the decode phase: grants, victims, swap or recompute, and deadlock freedom.

Rules (vLLM §4.5, lecture §6; the records, the location table and the model are
``kvspec.spec.scheduler``'s, and ``admission.step`` runs this phase first):

* Each step first *grants* every running group one token per sample, in
  arrival order, while the blocks the grants take (``append_demand``, added
  up over the grants) fit the free blocks.
* When a group's grant does not fit, the lowest-ranked running group is
  preempted -- under ``priority`` it may have arrived first and already hold
  its grant, which it then gives back: a preempted group decodes nothing.
* Preemption is by **swap** -- ``move_sequences`` of the whole group to the
  CPU manager, one copy per distinct block -- or, when the mode is
  ``recompute`` or the CPU cannot take the group, by **recompute** -- every
  sequence is freed and the group waits again; re-admitted, it prefills its
  prompt and then each sample's generated tokens again.
* **Grants go with the group.**  The victim gives its grant back: its KV is
  being freed or moved, and a grant it keeps runs the model over blocks that
  are no longer its own.
* Then every granted group decodes, one token per unfinished sample; a sample
  that reaches its output length frees its sequence (the prompt blocks it
  shares keep their other holders), and the group finishes with its last.

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

Invariants (tier in brackets):

* ``invariant_no_leak_across_preemption`` [safety] -- only running, swapped or
  loading groups and transfers in flight hold blocks; with none of them both
  pools are entirely free.
* ``invariant_group_on_one_device`` [safety] -- a group's sequences are all on its
  device and none elsewhere.
* ``invariant_swap_restores_contents`` [safety] -- every held sequence reads back,
  through its device's tables, exactly its group's tokens.
* ``invariant_recompute_restores_tokens`` [safety] -- a group's tokens are its prompt
  and the tokens it sampled, whatever preemption it went through.
* ``invariant_oldest_never_preempted`` [safety] -- under ``fcfs``, while every
  request accepted fits alone and no transfer is in flight, the earliest-arrived
  unfinished request is never a victim.
* ``invariant_preempted_keeps_no_grant`` [safety] -- no request is both
  preempted and granted tokens (a running group's grant) in one step.
* ``invariant_victims_rank_below_survivors`` [convention] -- every victim ranks
  below every request that kept its grant.
* ``invariant_finishes_within_bound`` [safety] -- under ``fcfs`` with every request ready,
  every request finishes by its deadline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from kvspec.spec import block_manager, kv_transfer
from kvspec.spec.block_manager import holders, read_through_table
from kvspec.spec.components import optional_operation
from kvspec.spec.invariants import Group as InvariantGroup
from kvspec.spec.invariants import invariant
from kvspec.spec.scheduler import (
    DEVICE_OF,
    SCHEDULER,
    Group,
    Memory,
    Model,
    Preemption,
    RequestId,
    Scheduler,
    SchedulerState,
    StepReport,
    devices,
    find,
    free_blocks,
    invariant_memory_never_overcommitted,
    memory,
    mover,
    rank,
    ranking,
    release,
    relocate,
    replace,
    sampled_token,
    tables_of,
)


class SwapPreemptingScheduler(Scheduler, Protocol):
    """A mode: run with ``config.preemption == "swap"``, a victim's blocks go to the CPU manager."""


SWAP_PREEMPTION = optional_operation("swap_preemption", SwapPreemptingScheduler, kinds=(SCHEDULER.name,))


def decode_phase(model: Model) -> tuple[Model, StepReport]:
    """Grant each running group its tokens (preempting as needed), then let every granted group decode."""
    model, granted, report = grant_decodes(model, StepReport())
    for group in granted:
        model, report = decode(model, group, report)
    return model, report


def grant_decodes(model: Model, report: StepReport) -> tuple[Model, list[Group], StepReport]:
    """Grant each running group its tokens in arrival order, preempting the lowest-ranked while one does not fit."""
    granted: dict[RequestId, tuple[Group, int]] = {}  # request -> (group, the blocks its grant takes)
    for group in [g for g in model.groups if g.location == "running"]:
        if find(model, group.request.request_id).location != "running":
            continue  # preempted for a group before it
        demand = decode_demand(model.gpu, group)
        while sum(d for _, d in granted.values()) + demand > free_blocks(model.gpu):
            victim = max((g for g in model.groups if g.location == "running"), key=ranking(model))
            model, how = preempt(model, victim)
            granted.pop(victim.request.request_id, None)  # a preempted group decodes nothing
            report = attrs.evolve(report, preempted=report.preempted + ((victim.request.request_id, how),))
            if how == "swap":
                swapped = len({b for s in victim.seqs for b in tables_of(model.cpu).tables[s]})
                report = attrs.evolve(report, swapped_out_blocks=report.swapped_out_blocks + swapped)
            if victim.request.request_id == group.request.request_id:
                break
        else:
            granted[group.request.request_id] = (group, demand)
    grants = tuple((rid, len(group.live)) for rid, (group, _) in granted.items())
    return model, [group for group, _ in granted.values()], attrs.evolve(report, granted=grants)


def preempt(model: Model, victim: Group) -> tuple[Model, Preemption]:
    """Swap the victim out if the mode says so and the CPU has room for it; else drop it for recompute."""
    distinct = len({b for s in victim.seqs for b in tables_of(model.gpu).tables[s]})
    bumped = attrs.evolve(victim, preemptions=victim.preemptions + 1)
    if model.config.preemption == "swap" and distinct <= free_blocks(model.cpu):
        gpu, cpu, _ = mover(model.gpu).move_sequences(model.gpu, model.cpu, victim.seqs)
        return relocate(attrs.evolve(model, gpu=gpu, cpu=cpu), bumped, "swap_out"), "swap"
    return relocate(release(model, victim), bumped, "recompute"), "recompute"


def decode(model: Model, group: Group, report: StepReport) -> tuple[Model, StepReport]:
    """One token per unfinished sample; a sample that reaches its output length frees its sequence, and the
    group finishes with its last sample."""
    gpu, rid = model.gpu, group.request.request_id
    for seq in group.seqs:
        gpu, _ = memory(gpu).append(gpu, seq, (sampled_token(rid, seq[1], group.generated),))
    grown = attrs.evolve(group, generated=group.generated + 1)
    finishing = [seq for seq in group.seqs if seq not in grown.seqs]
    sends = not grown.live and kv_transfer.sends_kv(group.request)  # the last samples' blocks go to the send
    for seq in [] if sends else finishing:
        gpu = memory(gpu).free(gpu, seq)
    model = replace(attrs.evolve(model, gpu=gpu), grown)
    report = attrs.evolve(report, decode_tokens=report.decode_tokens + len(group.seqs))
    if grown.live:
        return model, report
    model = kv_transfer.start_send(model, rid, finishing) if sends else model
    return relocate(model, grown, "finish"), attrs.evolve(report, finished=report.finished + (rid,))


def decode_demand(gpu: Memory, group: Group) -> int:
    manager = tables_of(gpu)
    refcount = dict(enumerate(manager.pool.refcounts))
    tables = [manager.tables[s] for s in group.seqs]
    return append_demand(tables, [len(manager.tokens[s]) for s in group.seqs], refcount, manager.block_size)


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


@invariant(
    "blocks a waiting, finished or aborted request still holds are lost to everyone for good",
    "safety",
)
def invariant_no_leak_across_preemption(state: SchedulerState) -> str | None:
    in_flight = kv_transfer.transfers_in_flight(state)
    holding = {g.request.request_id for g in state.groups if g.location != "waiting"}
    holding |= {t.request_id for t in in_flight}  # a transfer in flight holds its blocks
    for name, manager in devices(state).items():
        stray = sorted({repr(s) for s in manager.tables if not (isinstance(s, tuple) and s[0] in holding)})
        if stray:
            return f"{name} holds sequences {stray} of requests that are waiting, finished or gone"
        if not state.groups and not in_flight and manager.pool.num_free != manager.pool.capacity:
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
        for name, manager in devices(state).items():
            present = [s for s in group.seqs if s in manager.tables]
            expected = list(group.seqs) if name == home else []
            if present != expected:
                return f"request {group.request.request_id!r} is {group.location}, yet {name} holds {present}"
    return None


@invariant(
    "a swapped group must come back with exactly the KV it left with, or it continues from corrupt state",
    "safety",
    fails_only_with="a table reads back its sequence's tokens (invariant_read_back_exact) and those are the group's (invariant_recompute_restores_tokens)",
    needs=(SWAP_PREEMPTION,),
)
def invariant_swap_restores_contents(state: SchedulerState) -> str | None:
    for group in state.groups:
        manager = devices(state).get(DEVICE_OF.get(group.location, ""))
        for seq in group.seqs:
            if manager is None or seq not in manager.tables:
                continue
            tokens = group.tokens(seq[1])
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
        manager = devices(state).get(DEVICE_OF.get(group.location, ""))
        if manager is None:
            continue
        for seq in group.seqs:
            if seq in manager.tokens and manager.tokens[seq] != group.tokens(seq[1]):
                return (
                    f"sequence {seq!r} holds {manager.tokens[seq]}, its prompt and samples are {group.tokens(seq[1])}"
                )

    return None


@invariant(
    "the oldest request must always make progress; preempting it is what lets a scheduler livelock",
    "safety",
)
def invariant_oldest_never_preempted(before: SchedulerState, report: StepReport) -> str | None:
    """``before``: the implementation's state when the step began; judged where the deadlock-freedom argument's
    premises hold (``fcfs``, every request accepted fits alone, no transfer in flight): the caller's to know."""
    if before.groups and any(rid == before.groups[0].request.request_id for rid, _ in report.preempted):
        return f"request {before.groups[0].request.request_id!r}, the earliest unfinished, was preempted"
    return None


@invariant(
    "deadlock freedom: when every request fits alone, each finishes within the bound the spec states",
    "safety",
)
def invariant_finishes_within_bound(state: SchedulerState, deadlines: Mapping[RequestId, int]) -> str | None:
    """``deadlines``: the caller's, for each request the implementation accepted and was not asked to drop, from the
    step and the unfinished count it showed at the arrival; a request the caller aborted is not its to finish."""
    for group in state.groups:
        due = deadlines.get(group.request.request_id)
        if due is not None and state.steps > due:
            return f"request {group.request.request_id!r} is still {group.location} at step {state.steps}, due by {due}"
    return None


@invariant(
    "a preempted request's KV is being freed or moved: a grant it keeps runs the model over blocks no longer its own",
    "safety",
)
def invariant_preempted_keeps_no_grant(report: StepReport) -> str | None:
    kept = sorted({rid for rid, _ in report.preempted} & {rid for rid, _ in report.granted})
    if kept:
        return f"requests {kept} were preempted and keep their grants in the same step"
    return None


@invariant(
    "the policy decides who gives way: preempting a request that ranks above one kept serves the wrong one first",
    "convention",
)
def invariant_victims_rank_below_survivors(before: SchedulerState, report: StepReport) -> str | None:
    ranks = {g.request.request_id: rank(g, before.config.policy) for g in before.groups}
    granted = [rid for rid, _ in report.granted]
    for victim, _ in report.preempted:
        above = [rid for rid in granted if ranks[rid] > ranks[victim]]
        if above:
            return f"preempted request {victim!r} (rank {ranks[victim]}) and kept {above[0]!r} (rank {ranks[above[0]]})"
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
"""Every safety rule over a scheduler's snapshot, both devices' managers included (the deadline apart: it holds
only under ``fcfs`` with every request ready)."""
