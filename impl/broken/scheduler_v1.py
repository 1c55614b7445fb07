"""Broken token-budget schedulers: each breaks a rule of ``kvspec.spec.scheduler_v1`` (or one of the layer's
rules it reuses) and declares what catches it.  A legal choice kvspec does not model is a member too: only a
convention rule may catch it (``properties/meta/test_no_false_safety.py``)."""

from __future__ import annotations

from kvspec.impl.broken import members
from kvspec.impl.scheduler_v1 import BudgetScheduler, Slot, Tally
from kvspec.spec import preemption
from kvspec.spec import scheduler_v1 as spec
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.prefix_cache import max_hit_blocks

KIND = spec.TOKEN_BUDGET_SCHEDULER.name
token_budget = members(KIND, "token-budget scheduler (vLLM v1's shape)")  # a member: its scheduler, and what catches it
priority = members(KIND, "token-budget scheduler (priority)")


class ServesPastTheBudget(BudgetScheduler):
    """Serves a running request all it lacks: a long chunked prefill takes more than the step's budget."""

    def _share(self, slot: Slot, budget: int) -> int:
        return len(slot.tokens) - slot.computed


serves_past_the_budget = token_budget(
    "a running request is served past the budget", ServesPastTheBudget, spec.invariant_token_budget_kept
)


class KeepsComputedWhenPreempted(BudgetScheduler):
    """Frees a victim's blocks but keeps its computed count: resumed, it skips KV it no longer has."""

    def _preempt(self, victim: Slot, tally: Tally) -> None:
        computed = victim.computed
        super()._preempt(victim, tally)
        victim.computed = computed


keeps_computed_when_preempted = token_budget(
    "a victim keeps its computed count", KeepsComputedWhenPreempted, spec.invariant_kv_holds_computed_tokens
)


class SendsVictimsToTheBack(BudgetScheduler):
    """Queues a victim behind every waiting request, as a plain FIFO would."""

    def _enqueue(self, slot: Slot, front: bool) -> None:
        super()._enqueue(slot, front=False)


sends_victims_to_the_back = token_budget(
    "a victim rejoins the queue at its tail", SendsVictimsToTheBack, spec.invariant_queue_in_arrival_order
)


class AdmitsAfterPreempting(BudgetScheduler):
    """Admits waiting requests in a step that just preempted, into the memory the victims gave up."""

    def _may_admit(self, tally: Tally) -> bool:
        return True


admits_after_preempting = token_budget(
    "admits in a step that preempted", AdmitsAfterPreempting, spec.invariant_preemption_stops_admission
)


class NeverChunksAPrefill(BudgetScheduler):
    """Admits a prompt only when all of it fits the step's budget, chunked prefill or not: a request longer than
    the budget, which chunked prefill lets run alone, waits for good."""

    def _chunks(self) -> bool:
        return False


never_chunks_a_prefill = token_budget(
    "never chunks a prefill",
    NeverChunksAPrefill,
    preemption.invariant_finishes_within_bound,
    spec.invariant_budget_scheduler_refines_spec,
)


class PreemptsTheOldest(BudgetScheduler):
    """Takes the first running request as the victim: the oldest gives way, and may never finish."""

    def _victim(self) -> Slot:
        return self._running[0]


preempts_the_oldest = token_budget(
    "preempts the oldest running request", PreemptsTheOldest, preemption.invariant_oldest_never_preempted
)


class NeverPreempts(BudgetScheduler):
    """Leaves a running request that does not fit unserved rather than preempting: two requests that together
    outgrow the device wait on each other for good."""

    def _allocate(self, slot: Slot, share: int, tally: Tally) -> bool:
        try:
            self._memory.append(slot.seq, slot.tokens[slot.computed : slot.computed + share])
        except OutOfBlocks:
            return False
        return True


never_preempts = token_budget("never preempts", NeverPreempts, preemption.invariant_finishes_within_bound)


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


breaks_priority_ties_by_cached_prefix = priority(
    "a legal choice: priority ties broken by the longest cached prefix",
    BreaksPriorityTiesByCachedPrefix,
    spec.invariant_budget_scheduler_refines_spec,
)
