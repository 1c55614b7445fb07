"""The reference scheduler in vLLM v1's shape: a token budget, chunked prefill, recompute-only preemption.

It owns no memory: one ``PrefixCachingManager`` (any implementation's) comes in through the
constructor.  Requests live in one dict in arrival order, each a mutable ``Slot``; ``running`` is
a list in admission order and ``waiting`` a deque (``fcfs``, victims pushed back at its head) or
a heap keyed by rank (``priority``), as vLLM keeps them.  Each pass of a step is a method a
subclass can override (the broken schedulers of ``kvspec.impl.broken.scheduler_v1`` do).
"""

from __future__ import annotations

import heapq
from collections import deque

import attrs

from kvspec.spec.admission import check_request, prefill_demand
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.prefix_cache import PrefixCachingManager, max_hit_blocks
from kvspec.spec.scheduler import Request, RequestId, sampled_token
from kvspec.spec.scheduler_v1 import (
    BudgetConfig,
    BudgetReport,
    BudgetState,
    Entry,
    Place,
    Tracked,
    check_config,
    check_fits_alone,
)


@attrs.define
class Slot(Tracked):
    """A request as the scheduler tracks it: its tokens grow as it samples."""

    request: Request
    arrival: int
    tokens: list[int]
    place: Place = "waiting"
    computed: int = 0
    generated: int = 0
    preemptions: int = 0

    @property
    def rank(self) -> tuple[int, int]:
        return (self.request.priority, self.arrival)

    def frozen(self) -> Entry:
        return Entry(self.request, self.arrival, self.place, self.computed, self.generated, self.preemptions)


@attrs.define
class Tally:
    """A step under way: the budget left and what was done."""

    budget: int
    served: dict[RequestId, int] = attrs.Factory(dict)
    preempted: list[RequestId] = attrs.Factory(list)
    admitted: list[RequestId] = attrs.Factory(list)
    cached_tokens: dict[RequestId, int] = attrs.Factory(dict)
    finished: list[RequestId] = attrs.Factory(list)

    def freeze(self) -> BudgetReport:
        return BudgetReport(
            tuple(self.served.items()),
            tuple(sorted(self.preempted)),
            tuple(self.admitted),
            tuple(self.cached_tokens.items()),
            tuple(self.finished),
        )


class BudgetScheduler:
    """Running and waiting requests over one prefix-caching manager."""

    def __init__(self, manager: PrefixCachingManager, config: BudgetConfig) -> None:
        self._memory, self._config = manager, check_config(config)
        self._slots: dict[RequestId, Slot] = {}
        self._running: list[Slot] = []
        self._fifo: deque[Slot] = deque()
        self._heap: list[tuple[tuple[int, int], Slot]] = []
        self._arrived: list[RequestId] = []
        self._arrived_set: set[RequestId] = set()
        self._finished: list[RequestId] = []
        self._steps = 0

    def arrive(self, request: Request) -> None:
        request = check_request(request, self._arrived_set)
        if request.n != 1 or not request.ready:
            raise InvalidOperation(f"request {request.request_id!r}: v1 takes one sample of a ready request")
        check_fits_alone(request, self._config, self._memory.pool.capacity, self._memory.block_size)
        slot = Slot(request, len(self._arrived), list(request.prompt))
        self._slots[request.request_id] = slot
        self._arrived.append(request.request_id)
        self._arrived_set.add(request.request_id)
        self._enqueue(slot, front=False)

    def abort(self, request_id: RequestId) -> None:
        slot = self._slots.get(request_id) if isinstance(request_id, int) else None
        if slot is None:
            raise InvalidOperation(f"request {request_id!r} is not unfinished (never arrived, finished or aborted)")
        self._leave(slot)

    def step(self) -> BudgetReport:
        tally = Tally(self._config.token_budget)
        self._serve_running(tally)
        if self._may_admit(tally):
            self._admit_waiting(tally)
        self._forward(tally)
        self._steps += 1
        return tally.freeze()

    def snapshot(self) -> BudgetState:
        return BudgetState(
            config=self._config,
            steps=self._steps,
            arrived=tuple(self._arrived),
            entries=tuple(slot.frozen() for slot in self._slots.values()),
            running=tuple(slot.request_id for slot in self._running),
            waiting=tuple(slot.request_id for slot in self._queue()),
            finished=tuple(self._finished),
            memory=self._memory.snapshot(),
        )

    # -- the running pass -----------------------------------------------------------------

    def _serve_running(self, tally: Tally) -> None:
        visited: set[RequestId] = set()
        while tally.budget > 0:
            slot = next((s for s in self._running if s.request_id not in visited), None)
            if slot is None:
                return
            visited.add(slot.request_id)
            share = self._share(slot, tally.budget)
            if self._allocate(slot, share, tally):
                tally.served[slot.request_id] = share
                tally.budget -= share
            elif self._config.policy == "fcfs":
                return

    def _share(self, slot: Slot, budget: int) -> int:
        return min(len(slot.tokens) - slot.computed, budget)

    def _allocate(self, slot: Slot, share: int, tally: Tally) -> bool:
        """Slots for ``share`` more tokens, preempting the lowest-ranked while they do not fit; False: ``slot``
        preempted itself."""
        while True:
            try:
                self._memory.append(slot.seq, slot.tokens[slot.computed : slot.computed + share])
                return True
            except OutOfBlocks:
                victim = self._victim()
                self._preempt(victim, tally)
                if victim is slot:
                    return False

    def _victim(self) -> Slot:
        if self._config.policy == "fcfs":
            return self._running[-1]
        return max(self._running, key=lambda slot: slot.rank)

    def _preempt(self, victim: Slot, tally: Tally) -> None:
        self._memory.free(victim.seq)
        self._running.remove(victim)
        victim.place, victim.computed = "waiting", 0
        victim.preemptions += 1
        tally.budget += tally.served.pop(victim.request_id, 0)
        tally.preempted.append(victim.request_id)
        self._enqueue(victim, front=True)

    # -- the waiting pass -----------------------------------------------------------------

    def _may_admit(self, tally: Tally) -> bool:
        return not tally.preempted

    def _admit_waiting(self, tally: Tally) -> None:
        size = self._memory.block_size
        while tally.budget > 0 and len(self._running) < self._config.max_running:
            queue = self._queue()
            if not queue:
                return
            slot = queue[0]
            hits = self._memory.cached_prefix(slot.tokens)[: max_hit_blocks(len(slot.tokens), size)]
            lacking = len(slot.tokens) - len(hits) * size
            if (not self._chunks() and lacking > tally.budget) or not self._whole_fits(slot, hits):
                return
            share = min(lacking, tally.budget)
            try:
                plan = self._memory.add_sequence(slot.seq, slot.tokens[: len(hits) * size + share])
            except OutOfBlocks:
                return
            self._dequeue(slot)
            slot.place, slot.computed = "running", plan.cached_tokens
            self._running.append(slot)
            tally.served[slot.request_id] = share
            tally.budget -= share
            tally.admitted.append(slot.request_id)
            tally.cached_tokens[slot.request_id] = plan.cached_tokens

    def _chunks(self) -> bool:
        return self._config.chunked_prefill

    def _whole_fits(self, slot: Slot, hits: tuple[int, ...]) -> bool:
        """Under ``reserve_full_sequence``: the blocks of all its tokens, less its hits, plus the hits it revives."""
        if not self._config.reserve_full_sequence:
            return True
        revived = sum(1 for block in hits if self._memory.pool.refcount(block) == 0)
        need = prefill_demand(slot.request, slot.generated, self._memory.block_size, len(hits), revived)
        return need <= self._memory.pool.num_free()

    # -- the forward ------------------------------------------------------------------------

    def _forward(self, tally: Tally) -> None:
        for request_id, share in tally.served.items():
            slot = self._slots[request_id]
            slot.computed += share
            if slot.computed == len(slot.tokens):
                slot.tokens.append(sampled_token(request_id, 0, slot.generated))
                slot.generated += 1
            if slot.generated == slot.request.max_new_tokens:
                self._leave(slot)
                self._finished.append(request_id)
                tally.finished.append(request_id)

    # -- the queues -------------------------------------------------------------------------

    def _enqueue(self, slot: Slot, front: bool) -> None:
        if self._config.policy == "priority":
            heapq.heappush(self._heap, (slot.rank, slot))
        elif front:
            self._fifo.appendleft(slot)
        else:
            self._fifo.append(slot)

    def _queue(self) -> list[Slot]:
        """The waiting requests, the head first."""
        if self._config.policy == "priority":
            return [slot for _, slot in sorted(self._heap, key=lambda entry: entry[0])]
        return list(self._fifo)

    def _dequeue(self, slot: Slot) -> None:
        if self._config.policy == "priority":
            self._heap = [entry for entry in self._heap if entry[1] is not slot]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(slot)

    def _leave(self, slot: Slot) -> None:
        if slot.place == "running":
            self._memory.free(slot.seq)
            self._running.remove(slot)
        else:
            self._dequeue(slot)
        del self._slots[slot.request_id]
