"""Layer 4 conformance: the scheduler against ``kvspec.spec.scheduler``'s model.

Tiny GPU and CPU pools (a few blocks of 1-4 tokens) make preemption the
common case; requests of one to three samples arrive, are aborted, and the
scheduler steps, preempting by recompute (``SchedulerMachine``) or by swap
(``SwapSchedulerMachine``, which recomputes when the CPU is full).  After
every operation the pool and manager invariants hold on both devices, the
scheduler's own invariants hold, and the state is the model's (block numbers
aside).  ``DeadlockFreedomMachine`` runs the implementation alone, with no
model to follow, for long stretches: every accepted request fits the GPU
alone, so each must finish by the deadline ``kvspec.spec.scheduler.deadline`` states.
"""

from __future__ import annotations

from typing import ClassVar

from hypothesis import event, target
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.properties.harness import LockstepMachine, conformance_test
from kvspec.spec import block_manager, block_pool
from kvspec.spec import scheduler as model
from kvspec.spec.errors import RequestTooLarge
from kvspec.spec.scheduler import Preemption, Request, SchedulerConfig, SchedulerState, StepReport

SIZES = {
    "gpu_blocks": st.integers(3, 8),
    "cpu_blocks": st.integers(1, 6),
    "block_size": st.integers(1, 4),
    "watermark": st.integers(0, 2),
}


class SchedulerMachineBase(LockstepMachine):
    """Builds the scheduler under test and checks every invariant that needs no model."""

    preemption: ClassVar[Preemption] = "recompute"
    samples: ClassVar[st.SearchStrategy[int]] = st.integers(1, 3)

    @initialize(**SIZES)
    def start(self, gpu_blocks: int, cpu_blocks: int, block_size: int, watermark: int) -> None:
        self.config = SchedulerConfig(preemption=self.preemption, watermark=watermark)
        self.record(f"scheduler(gpu_blocks={gpu_blocks}, cpu_blocks={cpu_blocks}, B={block_size}, {self.config})")
        impl = self.implementation
        scheduler = impl.scheduler(
            impl.block_manager(impl.block_pool(gpu_blocks, "lru"), block_size),
            impl.block_manager(impl.block_pool(cpu_blocks, "lru"), block_size),
            self.config,
        )
        self.scheduler = self.subject("scheduler", None, None, scheduler)
        self.sizes = (gpu_blocks, cpu_blocks, block_size)
        self.next_id = 0
        self.arrivals: dict[int, tuple[int, int]] = {}  # request -> (step it arrived after, unfinished then)
        self.longest = 0  # the largest max_new_tokens accepted so far: M of the deadline
        self.preemptions = 0

    def draw_request(self, data: st.DataObject) -> Request:
        """Sizes in blocks, so that two or three requests overfill the GPU and preemption is common."""
        block_size = self.sizes[2]
        prompt_len = data.draw(st.integers(1, 2 * block_size), label="prompt_len")
        max_new_tokens = data.draw(st.integers(1, 3 * block_size), label="max_new_tokens")
        n = data.draw(self.samples, label="n")
        prompt = data.draw(st.lists(st.integers(0, 9), min_size=prompt_len, max_size=prompt_len), label="prompt")
        self.next_id += 1
        return Request(self.next_id, tuple(prompt), max_new_tokens, n)

    def accepted(self, request: Request, state: SchedulerState) -> None:
        self.arrivals[request.request_id] = (state.steps, len(state.groups))
        self.longest = max(self.longest, request.max_new_tokens)
        event("arrival accepted")

    def stepped(self, before: SchedulerState, report: StepReport) -> None:
        after = self.scheduler.impl.snapshot()
        self.check_state(after)
        self.check(model.invariant_oldest_never_preempted, before, report)
        self.check(model.invariant_admission_in_arrival_order, after, report)
        for _, how in report.preempted:
            event(f"preempted by {how}")
        self.preemptions += len(report.preempted)

    def check_state(self, state: SchedulerState) -> None:
        deadlines = {rid: model.deadline(after, k, self.longest) for rid, (after, k) in self.arrivals.items()}
        self.check_group(model.STATE, state, deadlines)

    def teardown(self) -> None:
        if hasattr(self, "scheduler"):
            event("preemption in this run" if self.preemptions else "no preemption in this run")
            target(float(self.preemptions), label="preemptions")
        super().teardown()


class SchedulerMachine(SchedulerMachineBase):
    """Lockstep with the model, preempting by recompute."""

    @initialize(**SIZES)
    def start(self, gpu_blocks: int, cpu_blocks: int, block_size: int, watermark: int) -> None:
        super().start(gpu_blocks, cpu_blocks, block_size, watermark)
        self.scheduler.spec = model
        self.scheduler.model = model.new_model(
            block_manager.new_manager(block_size, block_pool.new_pool(gpu_blocks)),
            block_manager.new_manager(block_size, block_pool.new_pool(cpu_blocks)),
            self.config,
        )

    def arrive(self, request: Request) -> None:
        if self.scheduler("arrive", request) is not None:
            self.accepted(request, model.abstract(self.scheduler.model))

    @rule(data=st.data(), then_steps=st.integers(0, 3))
    def arrive_request(self, data: st.DataObject, then_steps: int) -> None:
        """Arrivals step the scheduler too: Hypothesis's swarm testing often disables the step rule."""
        self.arrive(self.draw_request(data))
        self.step(then_steps)

    @rule(
        request_id=st.integers(-1, 3),
        prompt=st.lists(st.integers(0, 9), max_size=2),
        max_new_tokens=st.integers(0, 2),
        n=st.integers(0, 2),
    )
    def arrive_malformed(self, request_id: int, prompt: list[int], max_new_tokens: int, n: int) -> None:
        """Duplicate ids, empty prompts, zero outputs or samples: all out of contract."""
        self.arrive(Request(request_id, tuple(prompt), max_new_tokens, n))

    @rule(count=st.integers(1, 6))
    def step_rule(self, count: int) -> None:
        self.step(count)

    def step(self, count: int) -> None:
        for _ in range(count):
            before = self.scheduler.impl.snapshot()
            answer = self.scheduler("step")
            if answer is None:
                return
            self.stepped(before, answer.actual)
            expected = model.abstract(self.scheduler.model)
            self.check(model.invariant_scheduler_refines_spec, self.scheduler.impl.snapshot(), expected)

    @rule(request_id=st.integers(0, 12))
    def abort(self, request_id: int) -> None:
        if self.scheduler("abort", request_id) is not None:
            del self.arrivals[request_id]

    @invariant()
    def matches_model(self) -> None:
        if hasattr(self, "scheduler"):
            state = self.scheduler.impl.snapshot()
            self.check_state(state)
            self.check(model.invariant_scheduler_refines_spec, state, model.abstract(self.scheduler.model))


class SwapSchedulerMachine(SchedulerMachine):
    """Lockstep with the model, preempting by swap -- vLLM's choice for groups of several samples."""

    preemption: ClassVar[Preemption] = "swap"
    samples: ClassVar[st.SearchStrategy[int]] = st.sampled_from([2, 3, 1])


class DeadlockFreedomMachine(SchedulerMachineBase):
    """The implementation alone, over long runs: no model decides for it whether it made progress."""

    @rule(data=st.data(), then_steps=st.integers(0, 3))
    def arrive_request(self, data: st.DataObject, then_steps: int) -> None:
        request = self.draw_request(data)
        try:
            self.scheduler("arrive", request)
            self.accepted(request, self.scheduler.impl.snapshot())
        except RequestTooLarge:
            event("arrive rejected with RequestTooLarge")
        self.step(then_steps)

    @rule(count=st.integers(1, 30))
    def step_rule(self, count: int) -> None:
        self.step(count)

    def step(self, count: int) -> None:
        for _ in range(count):
            before = self.scheduler.impl.snapshot()
            self.stepped(before, self.scheduler("step").actual)


TestSchedulerRecompute = conformance_test(SchedulerMachine)
TestSchedulerSwap = conformance_test(SwapSchedulerMachine)
TestDeadlockFreedom = conformance_test(DeadlockFreedomMachine)
