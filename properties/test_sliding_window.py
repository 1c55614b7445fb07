"""Sliding-window tables: the window manager against ``kvspec.spec.sliding_window``'s model.

The machine admits sequences into a few fixed slots with windows of 1-3
blocks (whole, or ending inside a block), serves whole requests (admitted,
decoded a token a step, finished), appends to them (so blocks slide out and are reused at once, or, under
the ``ring`` convention, the ring wraps over the tokens that slid out), frees
them, and sends out-of-contract calls.  The table rule of the declared
conventions is judged on the caller's record of what it wrote to each
sequence (``Written``), and the pool's invariants with the entries *in
windows* as the holders.  An admission or append refused for want of blocks
is retried after a free, and (as often as not) after the next admission or
append.  Where slid-out blocks are released at the next allocation, a refused
append releases them too: the model follows (``after_refusal``), and the
states around the refusal are compared without them (``refusal_view``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.conformance import run_conformance
from kvspec.impl.sliding_window import NextTokenWindowManager, RingSlidingWindowManager
from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.spec import block_pool
from kvspec.spec import sliding_window as model
from kvspec.spec.conventions import Conventions
from kvspec.spec.errors import KVSpecError, OutOfBlocks
from kvspec.spec.implementation import Implementation

SLOTS = 4
SEQS = st.integers(0, SLOTS - 1)
COUNTS = st.one_of(st.integers(0, 9), st.integers(-1, 0))


class SlidingWindowMachine(LockstepMachine):
    uses = frozenset({"block_pool", "sliding_window_manager"})
    judges = ("sliding_window", "block_pool", "invariants")

    @initialize(capacity=st.integers(1, 8), block_size=st.integers(1, 3), blocks=st.integers(1, 3), data=st.data())
    def start(self, capacity: int, block_size: int, blocks: int, data: st.DataObject) -> None:
        """A window of ``blocks`` whole blocks, or as often (blocks of more than a token) one that ends inside its
        last block."""
        within = st.integers(1, block_size - 1) if block_size > 1 else st.just(block_size)
        window = (blocks - 1) * block_size + data.draw(st.just(block_size) | within, label="window's last block")
        policy = data.draw(st.sampled_from(self.conventions.pool.policies), label="policy")
        self.record(f"windows = sliding_window_manager(capacity={capacity}, block_size={block_size}, window={window})")
        declared = self.conventions.window
        pool = block_pool.new_pool(capacity, policy, self.conventions.pool)
        spec = model.new_windows(block_size, window, pool, declared)
        impl = self.implementation.component("sliding_window_manager")(
            self.implementation.component("block_pool")(capacity, policy), block_size, window
        )
        view = functools.partial(model.refusal_view, conventions=declared)
        self.windows = self.subject("windows", model, spec, impl, refusal_view=view)
        self.block_size = block_size
        self.written: dict[int, model.Written] = {}  # the caller's record of each sequence it holds
        self.refused: tuple[str, int, int] | None = None

    def grow(self, operation: str, seq: int, n: int) -> None:
        """An admission or an append; the caller's record follows what the implementation carried out."""
        short = self.short_of_room(operation, seq, n)
        before = self.windows.snapshot()
        if self.windows(operation, seq, n) is None:
            if short:  # a refusal may release what slid out, as declared: the model follows
                self.windows.model = model.after_refusal(self.windows.model, seq)
            self.refused = (operation, seq, n)
            return
        record = self.written.get(seq) if operation == "append" else None
        if record is None:
            self.written[seq] = model.Written(n, 0)
        elif n > 0:  # a write; none is no allocation (and fewer, accepted out of contract, wrote nothing)
            self.written[seq] = model.Written(record.tokens + n, record.tokens)
        after = self.windows.snapshot()
        if self.conventions.window.slid_out == "ring":
            wrapped = n > 0 and self.written[seq].tokens > after.window
            event("the ring wrapped over tokens that slid out" if wrapped else "the ring kept every token")
            return
        slid = released_entries(after) > released_entries(before)
        event("blocks slid out of the window" if slid else "window kept every block")

    def short_of_room(self, operation: str, seq: int, n: int) -> bool:
        """Whether the model refuses this call for want of room (not as out of contract)."""
        try:
            getattr(model, operation)(self.windows.model, seq, n)
        except OutOfBlocks:
            return True
        except KVSpecError:
            return False
        return False

    @rule(seq=SEQS, length=COUNTS, data=st.data())
    def add_sequence(self, seq: int, length: int, data: st.DataObject) -> None:
        self.grow("add_sequence", seq, length)
        self.maybe_retry(data)

    @rule(seq=SEQS, n=COUNTS, data=st.data())
    def append(self, seq: int, n: int, data: st.DataObject) -> None:
        self.grow("append", seq, n)
        self.maybe_retry(data)

    @rule(slot=SEQS, extra=st.integers(1, 8))
    def append_past_room(self, slot: int, extra: int) -> None:
        """A chunk of ``extra`` blocks more than the pool has free, to the live sequence nearest ``slot``: refused
        unless what slides out of its window makes room -- and a window released at the next allocation releases
        it even when refused."""
        if self.written:
            seq = min(self.written, key=lambda live: (live - slot) % SLOTS)
            self.grow("append", seq, (self.windows.snapshot().pool.num_free + extra) * self.block_size)

    @rule(seq=SEQS, length=st.integers(1, 9), steps=st.integers(1, 4), finish=st.booleans())
    def serve(self, seq: int, length: int, steps: int, finish: bool) -> None:
        """A request's life in ``seq`` (the one there finished first): admitted, decoded a token a step -- its
        window sliding a token at a time -- and, as often as not, finished."""
        if seq in self.written:
            self.finish(seq)
        self.grow("add_sequence", seq, length)
        for _ in range(steps if seq in self.written else 0):
            self.grow("append", seq, 1)
        if finish and seq in self.written:
            self.finish(seq)

    @rule(seq=SEQS)
    def free(self, seq: int) -> None:
        """Free a sequence; then retry the admission or append refused last, as a scheduler does."""
        if self.finish(seq):
            self.retry_refused()

    def finish(self, seq: int) -> bool:
        """Free ``seq``; whether the implementation did."""
        if self.windows("free", seq) is None:
            return False
        self.written.pop(seq, None)
        return True

    def maybe_retry(self, data: st.DataObject) -> None:
        """Drawn inside admission and append, so that swarm testing never turns it off: as often as not, the
        call refused last again, as a scheduler retries its waiting request at the next step."""
        if self.refused is not None and data.draw(st.booleans(), label="retry the refused call first"):
            self.retry_refused()

    def retry_refused(self) -> None:
        if self.refused is not None:
            (operation, refused_seq, n), self.refused = self.refused, None
            event("revisit: retried a rejected call")
            self.grow(operation, refused_seq, n)

    @rule(seq=SEQS)
    def block_table(self, seq: int) -> None:
        self.windows("block_table", seq)

    @invariant()
    def matches_spec(self) -> None:
        if not hasattr(self, "windows"):
            return
        state = self.windows.snapshot()
        self.check(model.invariant_window_blocks_exact, state, self.conventions.window, dict(self.written))
        self.check_group(block_pool.STATE, state.pool, model.holders(state.tables))
        self.check(model.invariant_window_refines_spec, state, model.abstract(self.windows.model))


def released_entries(state: model.WindowState) -> int:
    """The entries of every table that hold no block: slid out."""
    return sum(1 for table in state.tables.values() for block in table if block is None)


TestSlidingWindow = conformance_test(SlidingWindowMachine, "sliding-window tables")


def ring_reference() -> Implementation:
    """The reference's ring (``slid_out="ring"``, HF transformers' shape) over the reference pool."""
    return Implementation(
        name="reference, sliding window as a ring",
        sliding_window_manager=RingSlidingWindowManager,
        conventions=Conventions(window=RingSlidingWindowManager.conventions),
    )


def next_token_reference() -> Implementation:
    """The reference's window of the next token, released at the next allocation (vLLM's choices)."""
    return Implementation(
        name="reference, the next token's window released at the next allocation",
        sliding_window_manager=NextTokenWindowManager,
        conventions=Conventions(window=NextTokenWindowManager.conventions),
    )


@pytest.mark.parametrize("reference", [ring_reference, next_token_reference])
def test_the_reference_of_each_window_choice_conforms(reference: Callable[[], Implementation]) -> None:
    verdict = run_conformance(reference, titled=["sliding-window"], profile="ci")
    assert verdict.conforms, str(verdict)
