"""Layer 4 in vLLM v1's shape: a token-budget scheduler against ``kvspec.spec.scheduler_v1_model``.

A tiny device (3-6 blocks of 1-4 tokens) and a small budget (2-14 tokens, 2-4 requests running)
make chunked prefills and recompute preemption the common case.  Requests arrive in bursts --
new prompts cut from three documents, so admissions hit, or an earlier prompt again, or a
malformed or too-large request -- are aborted, and the scheduler steps.  After every step the
scheduler's state is the model's (block numbers aside), every pool and manager rule holds on the
device, the layer's rules over memory and preemption hold (``as_layer``), and, under ``fcfs``,
the oldest is never preempted and every request finishes by its deadline -- while the premises
of deadlock freedom hold: every request the implementation accepted fits alone (the caller's
sums), and its own running then waiting requests have stayed in arrival order.  Safety is judged
on the implementation's snapshots and reports, the plans its manager answered and the caller's
ledger of the requests it accepted, never on the model.
``PriorityTokenBudgetMachine`` runs the same rules under the priority policy, where a victim may
have been served earlier in the step and gives its tokens back.

The machine builds the device's manager from the implementation's prefix-caching manager (its
own or the reference's) and hands it to the scheduler; it counts for an implementation that
brings a ``token_budget_scheduler``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.loading import load_implementation
from kvspec.properties.running import conformance_test
from kvspec.properties.test_scheduler import answered, watch_plans
from kvspec.spec import admission, block_manager, block_pool, preemption, prefix_cache, scheduler
from kvspec.spec import scheduler_v1 as shape
from kvspec.spec import scheduler_v1_model as model
from kvspec.spec.invariants import invariant_result_matches_spec
from kvspec.spec.scheduler import QueuePolicy, Request
from kvspec.spec.scheduler_v1 import BudgetConfig, BudgetState

KIND = shape.TOKEN_BUDGET_SCHEDULER.name
REFERENCE = "kvspec.impl:reference"


def documents(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Three texts prompts are cut from: the first two share their first block, the third nothing."""
    first = tuple((3 * i + 1) % 10 for i in range(3 * block_size + 1))
    second = first[:block_size] + tuple((t + 5) % 10 for t in first[block_size:])
    return first, second, tuple(9 - t for t in first)


# budget beyond one token per running request: tight in half the examples, where most prefills come in chunks
# and a running request lacks more than the step has left (the zoo's budget and chunking bugs show only there)
TIGHT_OR_ANY = st.one_of(st.integers(0, 2), st.integers(0, 10))


class TokenBudgetMachine(LockstepMachine):
    uses = frozenset({KIND})
    judges = (
        "scheduler_v1",
        "scheduler_v1_model",
        "preemption",
        "admission",
        "scheduler",
        "block_manager",
        "block_pool",
        "invariants",
    )
    policy: ClassVar[QueuePolicy] = "fcfs"
    priorities: ClassVar[st.SearchStrategy[int]] = st.just(0)

    @initialize(
        capacity=st.integers(3, 6),
        block_size=st.integers(1, 4),
        max_running=st.integers(2, 4),
        spare_budget=TIGHT_OR_ANY,
        chunked=st.booleans(),
        reserve=st.booleans(),
    )
    def start(
        self, capacity: int, block_size: int, max_running: int, spare_budget: int, chunked: bool, reserve: bool
    ) -> None:
        config = BudgetConfig(max_running + spare_budget, max_running, chunked, reserve, self.policy)
        self.record(f"scheduler = token_budget_scheduler(capacity={capacity}, block_size={block_size}, {config})")
        impl = self.implementation
        manager = impl.component("prefix_caching_manager")(impl.component("block_pool")(capacity, "lru"), block_size)
        pool = block_pool.new_pool(capacity, "lru", self.conventions.pool)
        spec = model.new_model(prefix_cache.new_caching_manager(block_size, pool), config)
        self.scheduler = self.subject("scheduler", model, spec, impl.component(KIND)(manager, config))
        self.config, self.capacity, self.block_size = config, capacity, block_size
        self.next_id = 0
        self.requests: list[Request] = []
        self.arrivals: dict[int, tuple[int, int]] = {}  # request -> (the step it arrived after, unfinished then)
        self.longest = self.longest_output = 0  # L and M of the deadline
        # deadlock freedom's premises under fcfs, read off the caller's sums and the implementation's own state:
        # every request it accepted fits alone, and its running then waiting requests were in arrival order at
        # every step (a scheduler that queues its victims elsewhere may preempt the oldest: a convention)
        self.bounded = self.policy == "fcfs"
        self.plans: list[tuple[Any, int]] = []  # (sequence, cached tokens) the manager planned in this step
        watch_plans(manager, self.plans)
        self.preemptions = 0

    # -- arrivals -----------------------------------------------------------------------

    def most_tokens(self) -> int:
        """The most tokens a request may take to fit alone."""
        tokens = self.capacity * self.block_size
        return tokens if self.config.chunked_prefill else min(tokens, self.config.token_budget)

    def draw_request(self, data: st.DataObject) -> Request | None:
        """A prompt cut from a document with a short tail, and an output, that fit alone together."""
        room = self.most_tokens()
        if room < 2:
            return None
        size = self.block_size
        text = data.draw(st.sampled_from(documents(size)), label="document")
        kept = data.draw(st.integers(1, min(len(text), room - 1)), label="kept")
        tail = data.draw(st.lists(st.integers(0, 9), max_size=min(size // 2, room - 1 - kept)), label="tail")
        prompt = text[:kept] + tuple(tail)
        max_new_tokens = data.draw(st.integers(1, room - len(prompt)), label="max_new_tokens")
        self.next_id += 1
        priority = data.draw(self.priorities, label="priority")
        return Request(self.next_id, prompt, max_new_tokens, priority=priority)

    def arrive(self, arrival: Request) -> None:
        """``arrival``; once the implementation took it, its deadline counts from the implementation's own state."""
        if self.scheduler("arrive", arrival) is None:
            return
        state = self.scheduler.impl.snapshot()
        self.requests.append(arrival)
        self.arrivals[arrival.request_id] = (state.steps, len(state.entries))
        self.longest = max(self.longest, len(arrival.prompt) + arrival.max_new_tokens)
        self.longest_output = max(self.longest_output, arrival.max_new_tokens)
        longest = len(arrival.prompt) + arrival.max_new_tokens
        self.bounded = self.bounded and longest <= self.most_tokens() and arrival.n == 1

    @rule(
        data=st.data(),
        burst=st.lists(st.sampled_from(["new", "earlier prompt", "new", "out of contract"]), min_size=1, max_size=3),
        then_steps=st.integers(0, 3),
    )
    def arrive_requests(self, data: st.DataObject, burst: list[str], then_steps: int) -> None:
        """Arrivals between two steps: new requests, an earlier prompt under a new id, or an out-of-contract one
        (an id that arrived already, two samples, an empty prompt, no output, too large to run alone)."""
        for source in burst:
            new = self.draw_request(data)
            if new is None:
                continue
            if source == "earlier prompt" and self.requests:
                earlier = data.draw(st.sampled_from(self.requests), label="earlier")
                new = attrs.evolve(new, prompt=earlier.prompt, max_new_tokens=earlier.max_new_tokens)
                event("an earlier prompt again")
            elif source == "out of contract":
                new = data.draw(self.malformed(new), label="malformed")
            self.arrive(new)
        self.step(then_steps)

    def malformed(self, new: Request) -> st.SearchStrategy[Request]:
        too_long = new.prompt * (self.capacity * self.block_size + 1)
        variants = [
            attrs.evolve(new, n=2),
            attrs.evolve(new, prompt=()),
            attrs.evolve(new, max_new_tokens=0),
            attrs.evolve(new, prompt=too_long),
        ]
        if self.requests:
            variants.append(attrs.evolve(new, request_id=self.requests[-1].request_id))
        return st.sampled_from(variants)

    @rule(index=st.integers(0, 5))
    def abort(self, index: int) -> None:
        """An unfinished request (often), or an id that is not."""
        unfinished = list(self.scheduler.model.entries)
        request_id = unfinished[index] if index < len(unfinished) else index + 100
        if self.scheduler("abort", request_id) is not None:
            self.arrivals.pop(request_id, None)

    # -- steps --------------------------------------------------------------------------

    @rule(data=st.data(), arrivals=st.integers(0, 2), count=st.integers(1, 6))
    def step_rule(self, data: st.DataObject, arrivals: int, count: int) -> None:
        """A few new requests, then steps: arrivals ride on this rule too, as swarm testing often turns one off."""
        for _ in range(arrivals):
            new = self.draw_request(data)
            if new is not None:
                self.arrive(new)
        self.step(count)

    def step(self, count: int) -> None:
        for _ in range(count):
            before = self.scheduler.impl.snapshot()
            self.plans.clear()
            answer = self.scheduler("step", judged_by=None)
            if answer is None:
                return
            actual = answer.actual
            after = self.scheduler.impl.snapshot()
            layer_before = shape.as_layer(before)
            layer_report = shape.as_layer_report(actual)
            # the step's own rules first: a finding at this step is filed under the first that failed
            self.check(shape.invariant_token_budget_kept, before, after, actual)
            self.check(preemption.invariant_preempted_keeps_no_grant, layer_report)
            self.bounded = self.bounded and shape.in_arrival_order(before)
            if self.bounded:
                self.check(preemption.invariant_oldest_never_preempted, layer_before, layer_report)
            self.check(shape.invariant_preemption_stops_admission, actual)
            self.check(preemption.invariant_victims_rank_below_survivors, layer_before, layer_report)
            if self.plans:  # the step's admissions through the manager the scheduler was handed
                self.check(admission.invariant_hits_probed_at_admission, answered(self.plans), actual.cached_tokens)
            self.check(invariant_result_matches_spec, answer.expected, actual)
            self.preemptions += len(actual.preempted)
            for _, cached in actual.cached_tokens:
                event("admission hit" if cached else "admission, no hit")
            if any(rid not in actual.admitted and share > 1 for rid, share in actual.served):
                event("a running prefill served in chunks")
            if actual.preempted:
                event("preempted by recompute")

    # -- after every step ---------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        state = self.scheduler.impl.snapshot()
        self.check_state(state)
        self.check(shape.invariant_budget_scheduler_refines_spec, state, model.abstract(self.scheduler.model))

    def check_state(self, state: BudgetState) -> None:
        layer = shape.as_layer(state)
        self.check_group(block_manager.STATE, state.memory)
        self.check(scheduler.invariant_memory_never_overcommitted, layer)
        self.check(preemption.invariant_no_leak_across_preemption, layer)
        self.check(shape.invariant_kv_holds_computed_tokens, state)
        self.check(shape.invariant_queue_in_arrival_order, state)
        self.bounded = self.bounded and shape.in_arrival_order(state)
        if self.bounded:
            deadlines = {
                rid: shape.deadline(after, k, self.longest, self.longest_output, self.config.token_budget)
                for rid, (after, k) in self.arrivals.items()
            }
            self.check(preemption.invariant_finishes_within_bound, layer, deadlines)

    def teardown(self) -> None:
        if hasattr(self, "scheduler"):
            event("preemption in this run" if self.preemptions else "no preemption in this run")
        super().teardown()


class PriorityTokenBudgetMachine(TokenBudgetMachine):
    """The priority policy: victims by rank, a victim served earlier in the step gives its tokens back."""

    policy: ClassVar[QueuePolicy] = "priority"
    priorities: ClassVar[st.SearchStrategy[int]] = st.integers(0, 2)
    requires = {KIND: frozenset({shape.PRIORITY})}


TestTokenBudgetScheduler = conformance_test(
    TokenBudgetMachine, "token-budget scheduler (vLLM v1's shape)", examples=0.4
)
TestPriorityTokenBudgetScheduler = conformance_test(
    PriorityTokenBudgetMachine, "token-budget scheduler (priority)", examples=0.3
)


def test_a_long_prompt_is_served_in_chunks_and_finishes() -> None:
    """A 9-token prompt with a budget of 4 is prefilled over three steps, then decodes one token a step."""
    impl = load_implementation(REFERENCE)
    manager = impl.component("prefix_caching_manager")(impl.component("block_pool")(8, "lru"), 4)
    scheduler_under_test: Any = impl.component(KIND)(manager, BudgetConfig(token_budget=4, max_running=2))
    scheduler_under_test.arrive(Request(1, range(9), max_new_tokens=2))
    served = [scheduler_under_test.step().served for _ in range(4)]
    assert served == [((1, 4),), ((1, 4),), ((1, 1),), ((1, 1),)]
    assert scheduler_under_test.snapshot().finished == (1,)
