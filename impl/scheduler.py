"""The reference scheduler: iteration-level batching over two block managers, FCFS or by priority.

It owns no memory itself: a GPU and a CPU ``BlockManager`` (each over a pool
of its own, from any implementation; both prefix-caching, or neither) come in
through the constructor.  The queue is one arrival-ordered dict of groups,
each tagged with where it lives; the steps are the spec's, phase by phase, as
methods a subclass can override (the broken schedulers in
``kvspec.impl.broken.scheduler`` do).  A step's grants are kept as vLLM keeps
``num_scheduled_tokens``: a dict the report is made from, which a preemption
must take the victim out of.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

import attrs

from kvspec.spec.admission import BUSY, admissible, check_fits_alone, check_request, prefill_demand
from kvspec.spec.block_manager import BlockManager
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.kv_transfer import (
    OUTCOMES,
    Outcome,
    Transfer,
    TransferGroup,
    TransferRequest,
    TransferState,
    loads_prompt,
    new_group,
    sends_kv,
)
from kvspec.spec.preemption import append_demand
from kvspec.spec.prefix_cache import PrefixCachingManager, max_hit_blocks
from kvspec.spec.scheduler import (
    Group,
    Location,
    Preemption,
    Request,
    RequestId,
    SchedulerConfig,
    StepReport,
    check_config,
    rank,
    sampled_token,
)


class Scheduler:
    """Waiting, running and swapped groups over a GPU and a CPU block manager."""

    def __init__(self, gpu: BlockManager, cpu: BlockManager, config: SchedulerConfig | None = None) -> None:
        config = config or SchedulerConfig()
        if gpu.block_size != cpu.block_size:
            raise InvalidOperation(f"GPU blocks of {gpu.block_size} tokens, CPU blocks of {cpu.block_size}")
        check_config(config)
        self._gpu, self._cpu, self._config = gpu, cpu, config
        # a manager that probes its cache caches prefixes, whichever optional operations (fork, swap) it lacks:
        # the protocol's isinstance would ask for those too
        self._cache = cast(PrefixCachingManager, gpu) if hasattr(gpu, "cached_prefix") else None
        self._groups: dict[RequestId, Entry] = {}
        self._arrived: list[RequestId] = []
        self._arrived_set: set[RequestId] = set()
        self._finished: list[RequestId] = []
        self._transfers: dict[RequestId, Transfer] = {}  # in flight, in the order they started
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
        self._groups[request.request_id] = Entry.of(new_group(request, len(self._arrived)))
        self._arrived.append(request.request_id)
        self._arrived_set.add(request.request_id)

    def abort(self, request_id: RequestId) -> None:
        group = self._groups.get(request_id) if isinstance(request_id, int) else None
        if group is None:
            raise InvalidOperation(f"request {request_id!r} is not unfinished (never arrived, finished or aborted)")
        if group.location != "loading":  # a landing zone stays with its load until the load ends
            self._release(group)
        del self._groups[request_id]

    def mark_ready(self, request_id: RequestId) -> None:
        group = self._groups.get(request_id) if isinstance(request_id, int) else None
        if group is None:
            raise InvalidOperation(f"request {request_id!r} is not unfinished (never arrived, finished or aborted)")
        if group.location == "loading":
            raise InvalidOperation(f"request {request_id!r} waits on its KV load: the load's end makes it ready")
        if group.ready:
            raise InvalidOperation(f"request {request_id!r} is ready already")
        group.ready = True

    def step(self) -> StepReport:
        report = Tally()
        for group in self._grant_decodes(report):
            self._decode(group, report)
        self._admit_in_order(report)
        self._steps += 1
        return report.freeze()

    def snapshot(self) -> TransferState:
        return TransferState(
            config=self._config,
            steps=self._steps,
            arrived=tuple(self._arrived),
            groups=tuple(entry.frozen() for entry in self._groups.values()),
            finished=tuple(self._finished),
            gpu=self._gpu.snapshot(),
            cpu=self._cpu.snapshot(),
            queue=tuple(group.request.request_id for group in self._admission_candidates()),
            transfers=tuple(self._transfers.values()),
        )

    def finish_transfer(self, request_id: RequestId, outcome: Outcome) -> None:
        """The worker reports the end of a request's transfer: a load landed, failed or moved nothing; a send ended."""
        if outcome not in OUTCOMES:
            raise InvalidOperation(f"a transfer ends {' or '.join(OUTCOMES)}, not {outcome!r}")
        transfer = self._transfers.get(request_id) if isinstance(request_id, int) else None
        if transfer is None:
            raise InvalidOperation(f"request {request_id!r} has no KV transfer in flight")
        del self._transfers[request_id]
        owner = self._groups.get(request_id)
        if transfer.direction == "send" or owner is None:
            for seq in transfer.seqs:
                self._gpu.free(seq)
        else:
            self._land(owner, outcome)

    def _land(self, group: Entry, outcome: Outcome) -> None:
        """A load's end: the group runs over its landed KV, or computes its prompt here, or is aborted."""
        if outcome != "done":
            self._release(group)
            if outcome == "failed" and self._config.load_failure == "abort":
                del self._groups[group.request.request_id]
                return
        group.location = "running" if outcome == "done" else "waiting"
        group.ready, group.remote = True, False

    # -- the decode phase ---------------------------------------------------------------

    def _grant_decodes(self, report: Tally) -> list[Entry]:
        """Grant each running group its tokens in arrival order; preempt the lowest-ranked while one does not fit."""
        running = list(self._located("running"))
        scheduled: dict[RequestId, tuple[Entry, int]] = {}  # request -> (group, blocks its grant takes)
        granted = 0
        for group in running:
            if group.location != "running":
                continue  # preempted for a group before it
            demand = self._decode_demand(group)
            while granted + demand > self._gpu.pool.num_free():
                victim = self._choose_victim([g for g in running if g.location == "running"])
                report.preempted.append((victim.request.request_id, self._preempt(victim, report)))
                if victim.request.request_id in scheduled:
                    granted -= scheduled.pop(victim.request.request_id)[1]
                    self._revoke_grant(victim, report)
                if victim is group:
                    break
            else:
                scheduled[group.request.request_id] = (group, demand)
                report.granted[group.request.request_id] = len(group.seqs)
                granted += demand
        return [group for group, _ in scheduled.values()]

    def _choose_victim(self, running: list[Entry]) -> Entry:
        return max(running, key=self._rank)

    def _revoke_grant(self, victim: Entry, report: Tally) -> None:
        del report.granted[victim.request.request_id]

    def _rank(self, group: Entry) -> tuple[int, int]:
        return rank(group.frozen(), self._config.policy)

    def _decode_demand(self, group: Entry) -> int:
        tables = [self._gpu.block_table(seq) for seq in group.seqs]
        refcount = {t[-1]: self._gpu.pool.refcount(t[-1]) for t in tables if t}
        lengths = [len(group.request.prompt) + group.generated] * len(tables)
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
        rid, decoding = group.request.request_id, group.seqs
        for seq in decoding:
            self._gpu.append(seq, [sampled_token(rid, seq[1], group.generated)])
        report.decode_tokens += len(decoding)
        group.generated += 1
        finishing = [seq for seq in decoding if group.request.output_length(seq[1]) == group.generated]
        if group.seqs or not sends_kv(group.request):
            for seq in finishing:
                self._finish_sample(seq)
        else:  # the last samples' blocks go to the send of the request's KV
            self._start_send(rid, finishing)
        if not group.seqs:
            del self._groups[rid]
            self._finished.append(rid)
            report.finished.append(rid)

    def _start_send(self, rid: RequestId, seqs: list[tuple[RequestId, int]]) -> None:
        self._transfers[rid] = Transfer(rid, "send", tuple(seqs))

    def _finish_sample(self, seq: tuple[RequestId, int]) -> None:
        """A sample sampled its stop token: its sequence goes, the prompt blocks it shares keep their holders."""
        self._gpu.free(seq)

    # -- the admission phase ------------------------------------------------------------

    def _admit_in_order(self, report: Tally) -> None:
        just_preempted = {rid for rid, _ in report.preempted}
        for group in self._admission_candidates():
            if not self._is_ready(group):
                continue
            if group.request.request_id in just_preempted:
                return
            probe = self._probe(group)
            if not self._fits(probe.need):
                return
            self._admit(group, probe, report)

    def _admission_candidates(self) -> Iterable[Entry]:
        """The groups not running, in queue order: the dict's (arrival) under fcfs, by rank under priority."""
        queued = [g for g in self._groups.values() if g.location != "running"]
        return sorted(queued, key=self._rank) if self._config.policy == "priority" else queued

    def _is_ready(self, group: Entry) -> bool:
        return group.ready

    def _fits(self, need: int) -> bool:
        idle = not any(group.location in BUSY for group in self._groups.values())
        return admissible(need, self._gpu.pool.num_free(), self._config.watermark, idle)

    def _probe(self, group: Entry) -> Probe:
        """What resuming ``group`` takes now: its blocks, and the prompt tokens the cache holds for it."""
        if group.location == "swapped":
            return Probe(len({b for seq in group.seqs for b in self._cpu.block_table(seq)}), 0)
        request, size = group.request, self._gpu.block_size
        hits = (
            self._cache.cached_prefix(request.prompt)[: max_hit_blocks(len(request.prompt), size)]
            if self._cache
            else ()
        )
        revived = sum(1 for block in hits if self._gpu.pool.refcount(block) == 0)
        copies = self._config.fork_partial_block == "copy"
        need = prefill_demand(request, group.generated, size, len(hits), revived, len(group.seqs), copies)
        return Probe(need, len(hits) * size)

    def _restored(self, group: Entry) -> tuple[tuple[RequestId, int], ...]:
        """The sequences a prefill writes: the unfinished samples' (a finished sample is never resumed)."""
        return group.seqs

    def _admit(self, group: Entry, probe: Probe, report: Tally) -> None:
        request = group.request
        report.admitted.append(request.request_id)
        if group.location == "swapped":
            report.swapped_in_blocks += probe.need
            self._cpu.move_sequences(self._gpu, group.seqs)
            group.location = "running"
            return
        restored = self._restored(group)
        first, *others = restored
        self._gpu.add_sequence(first, request.prompt)
        for seq in others:
            self._gpu.fork(first, seq)
        report.cached_tokens[request.request_id] = probe.cached_tokens
        if group.remote:
            self._start_load(group, report)
            return
        for seq in restored:
            self._gpu.append(seq, group.frozen().tokens(seq[1])[len(request.prompt) :])
        prefilled = len(request.prompt) - probe.cached_tokens + len(group.seqs) * group.generated
        if group.preemptions:
            report.recomputed_tokens += prefilled
        else:
            report.prefill_tokens += prefilled
        group.location = "running"

    def _start_load(self, group: Entry, report: Tally) -> None:
        """The prompt's blocks, just allocated, are the landing zone of its KV: the group waits, not ready."""
        group.location, group.ready = "loading", False
        self._transfers[group.request.request_id] = Transfer(group.request.request_id, "load", group.seqs)
        report.loading.append(group.request.request_id)

    # -- bookkeeping ---------------------------------------------------------------------

    def _check_fits_alone(self, request: Request) -> None:
        check_fits_alone(request, self._gpu.pool.capacity, self._gpu.block_size)

    def _located(self, location: Location) -> Iterator[Entry]:
        return (g for g in self._groups.values() if g.location == location)

    def _release(self, group: Entry) -> None:
        manager = {"loading": self._gpu, "running": self._gpu, "swapped": self._cpu}.get(group.location)
        if manager is not None:
            for seq in group.seqs:
                manager.free(seq)


@attrs.define
class Entry:
    """A group as the scheduler tracks it: ``kvspec.spec.scheduler.Group``'s fields, and the KV-transfer chapter's
    ``remote`` (``kvspec.spec.kv_transfer.TransferGroup``), updated in place."""

    request: Request
    arrival: int
    location: Location
    generated: int
    preemptions: int
    ready: bool
    remote: bool  # admission loads its prompt's KV, computed elsewhere

    @classmethod
    def of(cls, group: Group) -> Entry:
        return cls(
            group.request,
            group.arrival,
            group.location,
            group.generated,
            group.preemptions,
            group.ready,
            loads_prompt(group),
        )

    @property
    def seqs(self) -> tuple[tuple[RequestId, int], ...]:
        """The unfinished samples' sequences: a sample is finished once it generated its output length."""
        request, rid = self.request, self.request.request_id
        return tuple((rid, s) for s in range(request.n) if request.output_length(s) > self.generated)

    def frozen(self) -> Group:
        fields = (self.request, self.arrival, self.location, self.generated, self.preemptions, self.ready)
        if isinstance(self.request, TransferRequest):  # the KV-transfer chapter's group, as the spec's arrival makes it
            return TransferGroup(*fields, remote=self.remote)
        return Group(*fields)


@attrs.frozen
class Probe:
    """An admission attempt's view of a group: the blocks it takes, and the tokens the cache supplies."""

    need: int
    cached_tokens: int


@attrs.define
class Tally:
    """A step report under construction."""

    preempted: list[tuple[RequestId, Preemption]] = attrs.Factory(list)
    granted: dict[RequestId, int] = attrs.Factory(dict)
    admitted: list[RequestId] = attrs.Factory(list)
    loading: list[RequestId] = attrs.Factory(list)
    cached_tokens: dict[RequestId, int] = attrs.Factory(dict)
    finished: list[RequestId] = attrs.Factory(list)
    decode_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0

    def freeze(self) -> StepReport:
        return StepReport(
            preempted=tuple(self.preempted),
            granted=tuple(self.granted.items()),
            admitted=tuple(self.admitted),
            loading=tuple(self.loading),
            cached_tokens=tuple(self.cached_tokens.items()),
            finished=tuple(self.finished),
            decode_tokens=self.decode_tokens,
            prefill_tokens=self.prefill_tokens,
            recomputed_tokens=self.recomputed_tokens,
            swapped_out_blocks=self.swapped_out_blocks,
            swapped_in_blocks=self.swapped_in_blocks,
        )
