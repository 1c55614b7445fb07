"""Broken token-budget schedulers: each breaks a rule of ``kvspec.spec.scheduler_v1`` (or one of the layer's
rules it reuses) and declares what catches it.  A legal choice kvspec does not model is a member too: only a
convention rule may catch it (``properties/meta/test_no_false_safety.py``)."""

from __future__ import annotations

from kvspec.impl.broken import caught_by
from kvspec.impl.scheduler_v1 import BudgetScheduler, Slot, Tally
from kvspec.spec import preemption
from kvspec.spec import scheduler_v1 as spec
from kvspec.spec.components import Offer, every_operation
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.prefix_cache import max_hit_blocks

MACHINE = "token-budget scheduler (vLLM v1's shape)"
PRIORITY_MACHINE = "token-budget scheduler (priority)"
KIND = spec.TOKEN_BUDGET_SCHEDULER.name


def v1_member(name: str, scheduler: type[BudgetScheduler]) -> Implementation:
    """A broken implementation whose token-budget scheduler is ``scheduler``; the rest is the reference's."""
    return Implementation(name=name, extensions={KIND: Offer(scheduler, every_operation(KIND))})


class ServesPastTheBudget(BudgetScheduler):
    """Serves a running request all it lacks: a long chunked prefill takes more than the step's budget."""

    def _share(self, slot: Slot, budget: int) -> int:
        return len(slot.tokens) - slot.computed


class KeepsComputedWhenPreempted(BudgetScheduler):
    """Frees a victim's blocks but keeps its computed count: resumed, it skips KV it no longer has."""

    def _preempt(self, victim: Slot, tally: Tally) -> None:
        computed = victim.computed
        super()._preempt(victim, tally)
        victim.computed = computed


class SendsVictimsToTheBack(BudgetScheduler):
    """Queues a victim behind every waiting request, as a plain FIFO would."""

    def _enqueue(self, slot: Slot, front: bool) -> None:
        super()._enqueue(slot, front=False)


class AdmitsAfterPreempting(BudgetScheduler):
    """Admits waiting requests in a step that just preempted, into the memory the victims gave up."""

    def _may_admit(self, tally: Tally) -> bool:
        return True


class NeverChunksAPrefill(BudgetScheduler):
    """Admits a prompt only when all of it fits the step's budget, chunked prefill or not: a request longer than
    the budget, which chunked prefill lets run alone, waits for good."""

    def _chunks(self) -> bool:
        return False


class PreemptsTheOldest(BudgetScheduler):
    """Takes the first running request as the victim: the oldest gives way, and may never finish."""

    def _victim(self) -> Slot:
        return self._running[0]


class NeverPreempts(BudgetScheduler):
    """Leaves a running request that does not fit unserved rather than preempting: two requests that together
    outgrow the device wait on each other for good."""

    def _allocate(self, slot: Slot, share: int, tally: Tally) -> bool:
        try:
            self._memory.append(slot.seq, slot.tokens[slot.computed : slot.computed + share])
        except OutOfBlocks:
            return False
        return True


class BreaksPriorityTiesByCachedPrefix(BudgetScheduler):
    """A legal choice kvspec does not model: under the priority policy, among waiting requests of equal priority
    the one whose tokens the cache holds most of goes first (then the earlier arrival), as SGLang's ``lpm`` policy
    orders its waiting queue by longest prefix match; vLLM's priority queue, and kvspec's, break the tie by
    arrival.  Only the queue order and the admissions differ (convention findings): each admission still probes
    the cache at that moment, keeps the budget and takes only the blocks it allocates."""

    def _queue(self) -> list[Slot]:
        queue = super()._queue()
        if self._config.policy == "fcfs":
            return queue
        return sorted(queue, key=lambda slot: (slot.request.priority, -self._cached_now(slot), slot.arrival))

    def _cached_now(self, slot: Slot) -> int:
        size = self._memory.block_size
        return len(self._memory.cached_prefix(slot.tokens)[: max_hit_blocks(len(slot.tokens), size)])


@caught_by(spec.invariant_token_budget_kept, MACHINE)
def serves_past_the_budget() -> Implementation:
    return v1_member("broken: a running request is served past the budget", ServesPastTheBudget)


@caught_by(spec.invariant_kv_holds_computed_tokens, MACHINE)
def keeps_computed_when_preempted() -> Implementation:
    return v1_member("broken: a victim keeps its computed count", KeepsComputedWhenPreempted)


@caught_by(spec.invariant_queue_in_arrival_order, MACHINE)
def sends_victims_to_the_back() -> Implementation:
    return v1_member("broken: a victim rejoins the queue at its tail", SendsVictimsToTheBack)


@caught_by(spec.invariant_preemption_stops_admission, MACHINE)
def admits_after_preempting() -> Implementation:
    return v1_member("broken: admits in a step that preempted", AdmitsAfterPreempting)


@caught_by(preemption.invariant_finishes_within_bound, MACHINE)
@caught_by(spec.invariant_budget_scheduler_refines_spec, MACHINE)
def never_chunks_a_prefill() -> Implementation:
    return v1_member("broken: never chunks a prefill", NeverChunksAPrefill)


@caught_by(preemption.invariant_oldest_never_preempted, MACHINE)
def preempts_the_oldest() -> Implementation:
    return v1_member("broken: preempts the oldest running request", PreemptsTheOldest)


@caught_by(preemption.invariant_finishes_within_bound, MACHINE)
def never_preempts() -> Implementation:
    return v1_member("broken: never preempts", NeverPreempts)


@caught_by(spec.invariant_budget_scheduler_refines_spec, PRIORITY_MACHINE)
def breaks_priority_ties_by_cached_prefix() -> Implementation:
    return v1_member(
        "broken: a legal choice: priority ties broken by the longest cached prefix", BreaksPriorityTiesByCachedPrefix
    )
