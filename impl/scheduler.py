"""The reference scheduler: FCFS iteration-level batching over two block managers.

It owns no memory itself: a GPU and a CPU ``BlockManager`` (each over a pool
of its own, from any implementation) come in through the constructor.  The
queues are one arrival-ordered dict of groups, each tagged with where it
lives; the steps are the spec's, phase by phase, as methods a subclass can
override (the broken schedulers in ``kvspec.impl.broken.scheduler`` do).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from kvspec.spec.block_manager import BlockManager
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.scheduler import (
    Group,
    Location,
    Preemption,
    Request,
    RequestId,
    SchedulerConfig,
    SchedulerState,
    StepReport,
    admissible,
    append_demand,
    check_fits_alone,
    check_request,
    group_blocks,
    sampled_token,
)


class Scheduler:
    """Waiting, running and swapped groups over a GPU and a CPU block manager."""

    def __init__(self, gpu: BlockManager, cpu: BlockManager, config: SchedulerConfig | None = None) -> None:
        config = config or SchedulerConfig()
        if gpu.block_size != cpu.block_size:
            raise InvalidOperation(f"GPU blocks of {gpu.block_size} tokens, CPU blocks of {cpu.block_size}")
        if config.preemption not in ("swap", "recompute") or config.watermark < 0:
            raise InvalidOperation(f"unusable scheduler config {config!r}")
        self._gpu, self._cpu, self._config = gpu, cpu, config
        self._groups: dict[RequestId, Entry] = {}
        self._arrived: list[RequestId] = []
        self._arrived_set: set[RequestId] = set()
        self._finished: list[RequestId] = []
        self._steps = 0

    @property
    def gpu(self) -> BlockManager:
        return self._gpu

    @property
    def cpu(self) -> BlockManager:
        return self._cpu

    def arrive(self, request: Request) -> None:
        request = check_request(request, self._arrived_set)
        self._check_fits_alone(request)
        self._groups[request.request_id] = Entry.of(Group(request=request, arrival=len(self._arrived)))
        self._arrived.append(request.request_id)
        self._arrived_set.add(request.request_id)

    def abort(self, request_id: RequestId) -> None:
        group = self._groups.get(request_id) if isinstance(request_id, int) else None
        if group is None:
            raise InvalidOperation(f"request {request_id!r} is not unfinished (never arrived, finished or aborted)")
        self._release(group)
        del self._groups[request_id]

    def step(self) -> StepReport:
        report = Tally()
        running = self._make_room(report)
        for group in running:
            self._decode(group, report)
        self._admit_in_order(report)
        self._steps += 1
        return report.freeze()

    def snapshot(self) -> SchedulerState:
        return SchedulerState(
            config=self._config,
            steps=self._steps,
            arrived=tuple(self._arrived),
            groups=tuple(entry.frozen() for entry in self._groups.values()),
            finished=tuple(self._finished),
            gpu=self._gpu.snapshot(),
            cpu=self._cpu.snapshot(),
        )

    # -- the decode phase ---------------------------------------------------------------

    def _make_room(self, report: Tally) -> list[Entry]:
        """Preempt the latest-arrived running groups until the rest can all append a token."""
        running = list(self._located("running"))
        while running and self._decode_demand(running) > self._gpu.pool.num_free():
            victim = self._choose_victim(running)
            running.remove(victim)
            report.preempted.append((victim.request.request_id, self._preempt(victim, report)))
        return running

    def _choose_victim(self, running: list[Entry]) -> Entry:
        return running[-1]

    def _decode_demand(self, running: list[Entry]) -> int:
        seqs = [seq for group in running for seq in group.seqs]
        tables = [self._gpu.block_table(seq) for seq in seqs]
        refcount = {t[-1]: self._gpu.pool.refcount(t[-1]) for t in tables if t}
        lengths = [len(group.request.prompt) + group.generated for group in running for _ in group.seqs]
        return append_demand(tables, lengths, refcount, self._gpu.block_size)

    def _preempt(self, victim: Entry, report: Tally) -> Preemption:
        distinct = len({b for seq in victim.seqs for b in self._gpu.block_table(seq)})
        victim.preemptions += 1
        if self._config.preemption == "swap" and distinct <= self._cpu.pool.num_free():
            self._swap_out(victim)
            report.swapped_out_blocks += distinct
            victim.location = "swapped"
            return "swap"
        self._drop_for_recompute(victim)
        victim.location = "waiting"
        return "recompute"

    def _swap_out(self, victim: Entry) -> None:
        self._gpu.move_sequences(self._cpu, victim.seqs)

    def _drop_for_recompute(self, victim: Entry) -> None:
        self._release(victim)

    def _decode(self, group: Entry, report: Tally) -> None:
        rid = group.request.request_id
        for sample, seq in enumerate(group.seqs):
            self._gpu.append(seq, [sampled_token(rid, sample, group.generated)])
        report.decode_tokens += group.request.n
        group.generated += 1
        if group.generated == group.request.max_new_tokens:
            self._release(group)
            del self._groups[rid]
            self._finished.append(rid)
            report.finished.append(rid)

    # -- the admission phase ------------------------------------------------------------

    def _admit_in_order(self, report: Tally) -> None:
        just_preempted = {rid for rid, _ in report.preempted}
        for group in self._admission_candidates():
            if group.request.request_id in just_preempted or not self._fits(group):
                return
            self._admit(group, report)

    def _admission_candidates(self) -> Iterator[Entry]:
        return (g for g in self._groups.values() if g.location != "running")

    def _fits(self, group: Entry) -> bool:
        idle = not any(True for _ in self._located("running"))
        need = self._resume_demand(group)
        return admissible(need, self._gpu.pool.num_free(), self._config.watermark, idle)

    def _resume_demand(self, group: Entry) -> int:
        if group.location == "swapped":
            return len({b for seq in group.seqs for b in self._cpu.block_table(seq)})
        request = group.request
        return group_blocks(len(request.prompt), group.generated, request.n, self._gpu.block_size)

    def _admit(self, group: Entry, report: Tally) -> None:
        request = group.request
        if group.location == "swapped":
            report.swapped_in_blocks += self._resume_demand(group)
            self._cpu.move_sequences(self._gpu, group.seqs)
        else:
            first, *others = group.seqs
            self._gpu.add_sequence(first, request.prompt)
            for seq in others:
                self._gpu.fork(first, seq)
            for sample, seq in enumerate(group.seqs):
                self._gpu.append(seq, group.frozen().tokens(sample)[len(request.prompt) :])
            prefilled = len(request.prompt) + request.n * group.generated
            if group.preemptions:
                report.recomputed_tokens += prefilled
            else:
                report.prefill_tokens += prefilled
        group.location = "running"
        report.admitted.append(request.request_id)

    # -- bookkeeping ---------------------------------------------------------------------

    def _check_fits_alone(self, request: Request) -> None:
        check_fits_alone(request, self._gpu.pool.capacity, self._gpu.block_size)

    def _located(self, location: Location) -> Iterator[Entry]:
        return (g for g in self._groups.values() if g.location == location)

    def _release(self, group: Entry) -> None:
        manager = {"running": self._gpu, "swapped": self._cpu}.get(group.location)
        if manager is not None:
            for seq in group.seqs:
                manager.free(seq)


@attrs.define
class Entry:
    """A group as the scheduler tracks it: ``kvspec.spec.scheduler.Group``'s fields, updated in place."""

    request: Request
    arrival: int
    location: Location
    generated: int
    preemptions: int
    seqs: tuple[tuple[RequestId, int], ...]

    @classmethod
    def of(cls, group: Group) -> Entry:
        return cls(group.request, group.arrival, group.location, group.generated, group.preemptions, group.seqs)

    def frozen(self) -> Group:
        return Group(self.request, self.arrival, self.location, self.generated, self.preemptions)


@attrs.define
class Tally:
    """A step report under construction."""

    preempted: list[tuple[RequestId, Preemption]] = attrs.Factory(list)
    admitted: list[RequestId] = attrs.Factory(list)
    finished: list[RequestId] = attrs.Factory(list)
    decode_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0

    def freeze(self) -> StepReport:
        return StepReport(
            preempted=tuple(self.preempted),
            admitted=tuple(self.admitted),
            finished=tuple(self.finished),
            decode_tokens=self.decode_tokens,
            prefill_tokens=self.prefill_tokens,
            recomputed_tokens=self.recomputed_tokens,
            swapped_out_blocks=self.swapped_out_blocks,
            swapped_in_blocks=self.swapped_in_blocks,
        )
