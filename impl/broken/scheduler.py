"""Broken schedulers: each breaks a rule of layer 4 (``kvspec.spec.scheduler`` and the modules it names).  A legal
choice kvspec does not model is a member too: only a convention rule may catch it
(``properties/meta/test_no_false_safety.py``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from kvspec.impl.block_manager import BlockManager
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.broken import members
from kvspec.impl.scheduler import Entry, Probe, Scheduler, Tally
from kvspec.spec import admission, kv_transfer, preemption, sample_groups
from kvspec.spec import scheduler as spec
from kvspec.spec.admission import admissible
from kvspec.spec.block_manager import BlockManager as ManagerProtocol
from kvspec.spec.invariants import invariant_failed_operation_changes_nothing, invariant_out_of_contract_call_rejected
from kvspec.spec.kv_transfer import Outcome
from kvspec.spec.prefix_cache import max_hit_blocks
from kvspec.spec.scheduler import Request, RequestId, SchedulerConfig

# A member: its scheduler (over the reference's pool and manager), and the rules that catch it in that machine.
MEMORY = {"block_pool": BlockPool, "block_manager": BlockManager}
recompute = members("scheduler", "scheduler (recompute)", **MEMORY)
swap = members("scheduler", "scheduler (swap)", **MEMORY)
deadlock = members("scheduler", "scheduler deadlock freedom", **MEMORY)
cached = members("scheduler", "scheduler over the prefix cache", **MEMORY)
priority = members("scheduler", "scheduler (priority)", **MEMORY)


class PreemptsOldest(Scheduler):
    """Takes the earliest-arrived running group as the victim."""

    def _choose_victim(self, running: list[Entry]) -> Entry:
        return running[0]


preempts_oldest = deadlock(  # the machine whose workloads reach the oldest's preemption under any declaration
    "scheduler that preempts the oldest",
    PreemptsOldest,
    preemption.invariant_oldest_never_preempted,
    also=[(spec.invariant_scheduler_refines_spec, "scheduler (recompute)")],
)


class SwapsPartOfGroup(Scheduler):
    """Swaps out all samples but the last, which stays on the GPU."""

    def _swap_out(self, victim: Entry) -> None:
        self._gpu.move_sequences(self._cpu, victim.seqs[:-1] or victim.seqs)


swaps_part_of_group = swap(
    "scheduler that swaps part of a group", SwapsPartOfGroup, preemption.invariant_group_on_one_device
)


class ForgetsToFreeOnRecompute(Scheduler):
    """Sends a recomputed group back to waiting without freeing its GPU blocks."""

    def _drop_for_recompute(self, victim: Entry) -> None:
        pass


forgets_to_free_on_recompute = recompute(
    "scheduler that forgets to free on recompute",
    ForgetsToFreeOnRecompute,
    preemption.invariant_no_leak_across_preemption,
)


class AdmitsOutOfOrder(Scheduler):
    """First fit: skips a waiting group that does not fit and admits a later one that does."""

    def _admit_in_order(self, report: Tally) -> None:
        just_preempted = {rid for rid, _ in report.preempted}
        for group in list(self._admission_candidates()):
            probe = self._probe(group)
            if group.ready and group.request.request_id not in just_preempted and self._fits(probe.need):
                self._admit(group, probe, report)


admits_out_of_order = recompute(
    "scheduler that admits out of order", AdmitsOutOfOrder, admission.invariant_admission_in_arrival_order
)


class WaitsForeverOnTooLarge(Scheduler):
    """Queues a request that could never fit the GPU instead of refusing it."""

    def _check_fits_alone(self, request: Request) -> None:
        pass


waits_forever_on_too_large = recompute(
    "scheduler that queues requests that can never fit", WaitsForeverOnTooLarge, invariant_out_of_contract_call_rejected
)


class NeverPreempts(Scheduler):
    """No preemption: when blocks run out, nobody decodes and everyone waits (lecture exercise 12)."""

    def _grant_decodes(self, report: Tally) -> list[Entry]:
        running = list(self._located("running"))
        if sum(self._decode_demand(group) for group in running) > self._gpu.pool.num_free():
            return []
        report.granted.update((group.request.request_id, group.request.n) for group in running)
        return running


never_preempts = deadlock("scheduler without preemption", NeverPreempts, preemption.invariant_finishes_within_bound)


class RemembersHitLength(Scheduler):
    """Probes the cache once per request and keeps what it found across admission attempts.

    vLLM's shape of it: ``num_computed_tokens`` set by an attempt that failed, and not reset before the next.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._probes: dict[int, Probe] = {}

    def _probe(self, group: Entry) -> Probe:
        if group.location == "swapped":
            return super()._probe(group)
        return self._probes.setdefault(group.request.request_id, super()._probe(group))


remembers_hit_length = cached(
    "scheduler that remembers hit lengths across admission attempts",
    RemembersHitLength,
    admission.invariant_hits_probed_at_admission,
)


class CountsHitsTwice(Scheduler):
    """Subtracts the hits from the demand and still counts the free-queue hits as free blocks.

    It admits a request memory cannot hold: the prefill runs out of blocks half-way through the step.
    """

    def _probe(self, group: Entry) -> Probe:
        probe = super()._probe(group)
        if group.location == "swapped" or self._cache is None:
            return probe
        hits = self._cache.cached_prefix(group.request.prompt)[: probe.cached_tokens // self._gpu.block_size]
        revived = sum(1 for block in hits if self._gpu.pool.refcount(block) == 0)
        return Probe(probe.need - revived, probe.cached_tokens)


counts_hits_twice = cached(
    "scheduler that counts hits in both demand and supply",
    CountsHitsTwice,
    admission.invariant_watermark_kept,
    invariant_failed_operation_changes_nothing,
)


class IdleOncePerStep(Scheduler):
    """Decides once per step whether the GPU is idle: every admission after the first skips the watermark too."""

    def _admit_in_order(self, report: Tally) -> None:
        self._idle_at_start = not any(True for _ in self._located("running"))
        super()._admit_in_order(report)

    def _fits(self, need: int) -> bool:
        return admissible(need, self._gpu.pool.num_free(), self._config.watermark, self._idle_at_start)


idle_once_per_step = recompute(
    "scheduler that decides once per step whether the GPU is idle", IdleOncePerStep, admission.invariant_watermark_kept
)


class AdmitsBeforeReady(Scheduler):
    """Admits a request whose remote KV has not arrived yet."""

    def _is_ready(self, group: Entry) -> bool:
        return True


admits_before_ready = cached(
    "scheduler that admits requests not ready", AdmitsBeforeReady, admission.invariant_not_ready_never_admitted
)


class NotReadyBlocksQueue(Scheduler):
    """Admission stops at a request that is not ready, as at one that does not fit."""

    def _admission_candidates(self) -> Iterable[Entry]:
        return itertools.takewhile(lambda group: group.ready, super()._admission_candidates())


not_ready_blocks_queue = cached(
    "scheduler whose queue a request not ready blocks",
    NotReadyBlocksQueue,
    admission.invariant_admission_stops_only_when_short,
)


class NotReadyLosesPlace(Scheduler):
    """Passes over a request that is not ready by sending it to the back of the admission queue.

    Only admission's order changes: the request keeps its arrival, and with it its rank as a victim (the
    deadlock bound's), as an engine whose queue this is would.
    """

    def __init__(self, gpu: ManagerProtocol, cpu: ManagerProtocol, config: SchedulerConfig | None = None) -> None:
        super().__init__(gpu, cpu, config)
        self._sent_back: dict[RequestId, None] = {}  # in the order sent to the back

    def _admit_in_order(self, report: Tally) -> None:
        super()._admit_in_order(report)
        for rid in [rid for rid, group in self._groups.items() if not group.ready]:
            self._sent_back.pop(rid, None)
            self._sent_back[rid] = None

    def _admission_candidates(self) -> Iterable[Entry]:
        place = {rid: position for position, rid in enumerate(self._sent_back)}
        return sorted(super()._admission_candidates(), key=lambda group: place.get(group.request.request_id, -1))


not_ready_loses_place = cached(
    "scheduler that sends a request not ready to the back",
    NotReadyLosesPlace,
    admission.invariant_admission_in_arrival_order,
)


class KeepsGrantOfVictim(Scheduler):
    """Takes a preempted group out of the batch but leaves its grant in the step's grants."""

    def _revoke_grant(self, victim: Entry, report: Tally) -> None:
        pass


keeps_grant_of_victim = priority(
    "scheduler whose victims keep their grants", KeepsGrantOfVictim, preemption.invariant_preempted_keeps_no_grant
)


class PreemptsLatestArrival(Scheduler):
    """Under the priority policy still preempts the latest-arrived running group."""

    def _choose_victim(self, running: list[Entry]) -> Entry:
        return running[-1]


preempts_latest_arrival = priority(
    "priority scheduler that preempts the latest arrival",
    PreemptsLatestArrival,
    preemption.invariant_victims_rank_below_survivors,
)


class BreaksPriorityTiesByCachedPrefix(Scheduler):
    """A legal choice kvspec does not model: among requests of equal priority, the one whose prompt the cache holds
    most of goes first (then the earlier arrival), as SGLang's ``lpm`` policy orders its waiting queue by longest
    prefix match; kvspec's priority policy breaks the tie by arrival.  Only the queue order and who is admitted
    first differ (convention findings): each admission still probes the cache, fits and keeps the watermark,
    and touches no other request's blocks."""

    def _admission_candidates(self) -> Iterable[Entry]:
        queued = list(super()._admission_candidates())
        if self._config.policy != "priority":
            return queued
        return sorted(queued, key=lambda group: (group.request.priority, -self._cached_now(group), group.arrival))

    def _cached_now(self, group: Entry) -> int:
        """The prompt blocks the cache holds for a waiting group (a swapped one resumes without a probe)."""
        if group.location == "swapped" or self._cache is None:
            return 0
        prompt = group.request.prompt
        return len(self._cache.cached_prefix(prompt)[: max_hit_blocks(len(prompt), self._gpu.block_size)])


breaks_priority_ties_by_cached_prefix = priority(
    "a legal choice: priority ties broken by the longest cached prefix",
    BreaksPriorityTiesByCachedPrefix,
    admission.invariant_admission_in_arrival_order,
)


class ReversesPassedOver(Scheduler):
    """Puts the requests a pass passed over (not ready) back at the head of its waiting queue one at a time, as
    ``deque.extendleft`` does: they come back reversed, so two passed over together swap places at every pass,
    and after an odd number of passes the later arrival goes first.  Its groups stay in arrival order."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._passed_over: list[int] = []  # the requests not ready, in the order the queue holds them now

    def _admission_candidates(self) -> Iterable[Entry]:
        queued = list(super()._admission_candidates())
        held = {id(group): group for group in queued if group.request.request_id in self._passed_over}
        in_queue_order = iter(
            sorted(held.values(), key=lambda group: self._passed_over.index(group.request.request_id))
        )
        return [next(in_queue_order) if id(group) in held else group for group in queued]

    def _admit_in_order(self, report: Tally) -> None:
        super()._admit_in_order(report)
        passed = [group.request.request_id for group in self._admission_candidates() if not group.ready]
        self._passed_over = passed[::-1]


reverses_passed_over = cached(
    "scheduler that puts the requests it passed over back reversed",
    ReversesPassedOver,
    admission.invariant_admission_in_arrival_order,
)


class ResumesFinishedSamples(Scheduler):
    """Prefills a recomputed group as it arrived, every sample forked from its prompt: a sample that finished
    before the preemption is resumed (its tokens rewritten, its blocks taken) and never freed again."""

    def _restored(self, group: Entry) -> tuple[tuple[int, int], ...]:
        return tuple((group.request.request_id, sample) for sample in range(group.request.n))


resumes_finished_samples = swap(
    "scheduler that resumes finished samples after a recompute",
    ResumesFinishedSamples,
    sample_groups.invariant_finished_sample_holds_nothing,
)


class KeepsFinishedSamples(Scheduler):
    """Leaves a finished sample's sequence in place while its group still decodes (vLLM v0 freed finished
    sequences of unfinished groups in ``free_finished_seq_groups``' sweep, not at the stop token)."""

    def _finish_sample(self, seq: tuple[int, int]) -> None:
        pass


keeps_finished_samples = swap(
    "scheduler that keeps a finished sample's blocks",
    KeepsFinishedSamples,
    sample_groups.invariant_finished_sample_holds_nothing,
)


class ReleasesSharedPrefix(Scheduler):
    """Frees the first sample to finish as if it owned the prompt it forked to the others: every block of its
    table goes back to the pool, the shared prompt blocks too, while the other samples still read them."""

    def _finish_sample(self, seq: tuple[int, int]) -> None:
        table = self._gpu.block_table(seq)
        self._gpu.free(seq)
        for block in table:
            while self._gpu.pool.refcount(block):
                self._gpu.pool.release([block])


releases_shared_prefix = swap(
    "scheduler that releases the shared prompt when a sample finishes",
    ReleasesSharedPrefix,
    spec.invariant_memory_never_overcommitted,
)


class FreesAbortedLoad(Scheduler):
    """Frees an aborted request's blocks at once, though its KV load is still in flight: the load lands in blocks
    another request may already hold (vLLM's class of bug "KV connector: blocks freed before async recv done";
    its scheduler now frees an aborted ``WAITING_FOR_REMOTE_KVS`` request's blocks on ``finished_recving``)."""

    def abort(self, request_id: int) -> None:
        group = self._groups.get(request_id) if isinstance(request_id, int) else None
        if group is not None and group.location == "loading":
            self._release(group)
            group.location = "waiting"
        super().abort(request_id)


frees_aborted_load = recompute(
    "scheduler that frees an aborted request's landing zone under its load",
    FreesAbortedLoad,
    kv_transfer.invariant_transfer_blocks_held,
)


class FreesBeforeSendDone(Scheduler):
    """Frees a finished request's blocks at once and reports its send as started: the connector's
    ``request_finished`` answer (delay the free until ``finished_sending``) ignored."""

    def _start_send(self, rid: int, seqs: list[tuple[int, int]]) -> None:
        for seq in seqs:
            self._finish_sample(seq)
        super()._start_send(rid, seqs)


frees_before_send_done = recompute(
    "scheduler that frees a request's blocks while its KV is being sent",
    FreesBeforeSendDone,
    kv_transfer.invariant_transfer_blocks_held,
)


class RunsBeforeLoadLands(Scheduler):
    """Treats a load as synchronous: the request runs in the step after its blocks were allocated, whether or not
    its KV landed."""

    def _start_load(self, group: Entry, report: Tally) -> None:
        super()._start_load(group, report)
        group.location, group.ready, group.remote = "running", True, False


runs_before_load_lands = recompute(
    "scheduler that runs a request before its KV load lands",
    RunsBeforeLoadLands,
    kv_transfer.invariant_no_decode_before_load_lands,
)


class RunsOnFailedLoad(Scheduler):
    """Takes the end of a load for its success: a request whose load failed, or moved nothing, runs over its
    landing zone."""

    def _land(self, group: Entry, outcome: Outcome) -> None:
        super()._land(group, "done")


runs_on_failed_load = recompute(
    "scheduler that runs a request whose KV load failed",
    RunsOnFailedLoad,
    kv_transfer.invariant_failed_load_recomputes,
)
