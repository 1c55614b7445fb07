"""Broken schedulers: each breaks a rule of ``kvspec.spec.scheduler`` and declares what catches it."""

from __future__ import annotations

from kvspec.impl import reference
from kvspec.impl.broken import caught_by
from kvspec.impl.scheduler import Entry, Scheduler, Tally
from kvspec.spec import scheduler as spec
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import invariant_out_of_contract_call_rejected
from kvspec.spec.scheduler import Request


class PreemptsOldest(Scheduler):
    """Takes the earliest-arrived running group as the victim."""

    def _choose_victim(self, running: list[Entry]) -> Entry:
        return running[0]


class SwapsPartOfGroup(Scheduler):
    """Swaps out all samples but the last, which stays on the GPU."""

    def _swap_out(self, victim: Entry) -> None:
        self._gpu.move_sequences(self._cpu, victim.seqs[:-1] or victim.seqs)


class ForgetsToFreeOnRecompute(Scheduler):
    """Sends a recomputed group back to waiting without freeing its GPU blocks."""

    def _drop_for_recompute(self, victim: Entry) -> None:
        pass


class AdmitsOutOfOrder(Scheduler):
    """First fit: skips a waiting group that does not fit and admits a later one that does."""

    def _admit_in_order(self, report: Tally) -> None:
        just_preempted = {rid for rid, _ in report.preempted}
        for group in list(self._admission_candidates()):
            if group.request.request_id not in just_preempted and self._fits(group):
                self._admit(group, report)


class WaitsForeverOnTooLarge(Scheduler):
    """Queues a request that could never fit the GPU instead of refusing it."""

    def _check_fits_alone(self, request: Request) -> None:
        pass


class NeverPreempts(Scheduler):
    """No preemption: when blocks run out, nobody decodes and everyone waits (lecture exercise 12)."""

    def _make_room(self, report: Tally) -> list[Entry]:
        running = list(self._located("running"))
        return running if self._decode_demand(running) <= self._gpu.pool.num_free() else []


def _with_scheduler(name: str, scheduler: type[Scheduler]) -> Implementation:
    base = reference()
    return Implementation(name=name, block_pool=base.block_pool, block_manager=base.block_manager, scheduler=scheduler)


@caught_by(spec.invariant_scheduler_refines_spec, "scheduler (recompute)")
@caught_by(spec.invariant_oldest_never_preempted, "scheduler (recompute)")
def preempts_oldest() -> Implementation:
    return _with_scheduler("scheduler that preempts the oldest", PreemptsOldest)


@caught_by(spec.invariant_group_on_one_device, "scheduler (swap)")
def swaps_part_of_group() -> Implementation:
    return _with_scheduler("scheduler that swaps part of a group", SwapsPartOfGroup)


@caught_by(spec.invariant_no_leak_across_preemption, "scheduler (recompute)")
def forgets_to_free_on_recompute() -> Implementation:
    return _with_scheduler("scheduler that forgets to free on recompute", ForgetsToFreeOnRecompute)


@caught_by(spec.invariant_admission_in_arrival_order, "scheduler (recompute)")
def admits_out_of_order() -> Implementation:
    return _with_scheduler("scheduler that admits out of order", AdmitsOutOfOrder)


@caught_by(invariant_out_of_contract_call_rejected, "scheduler (recompute)")
def waits_forever_on_too_large() -> Implementation:
    return _with_scheduler("scheduler that queues requests that can never fit", WaitsForeverOnTooLarge)


@caught_by(spec.invariant_finishes_within_bound, "scheduler deadlock freedom")
def never_preempts() -> Implementation:
    return _with_scheduler("scheduler without preemption", NeverPreempts)
