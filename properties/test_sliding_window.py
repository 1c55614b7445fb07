"""Sliding-window tables: the window manager against ``kvspec.spec.sliding_window``'s model.

The machine admits sequences into a few fixed slots with windows of 1-3
blocks, appends to them (so blocks slide out and are reused at once, or, under
the ``ring`` convention, the ring wraps over the tokens that slid out), frees
them, and sends out-of-contract calls; the table rule of the declared
convention is checked, and the pool's invariants with the entries *in windows*
as the holders.  An admission or append refused for want of blocks is retried
after a free, and (as often as not) after the next admission or append.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.conformance import run_conformance
from kvspec.impl.sliding_window import RingSlidingWindowManager
from kvspec.properties.harness import LockstepMachine, conformance_test
from kvspec.spec import block_pool
from kvspec.spec import sliding_window as model
from kvspec.spec.conventions import Conventions, WindowConventions
from kvspec.spec.implementation import Implementation

SEQS = st.integers(0, 3)
COUNTS = st.one_of(st.integers(0, 9), st.integers(-1, 0))


class SlidingWindowMachine(LockstepMachine):
    uses = frozenset({"block_pool", "sliding_window_manager"})
    judges = ("sliding_window", "block_pool", "invariants")

    @initialize(capacity=st.integers(1, 8), block_size=st.integers(1, 3), blocks=st.integers(1, 3), data=st.data())
    def start(self, capacity: int, block_size: int, blocks: int, data: st.DataObject) -> None:
        window = data.draw(st.integers(max(1, (blocks - 1) * block_size), blocks * block_size), label="window")
        policy = data.draw(st.sampled_from(self.conventions.pool.policies), label="policy")
        self.record(f"windows = sliding_window_manager(capacity={capacity}, block_size={block_size}, window={window})")
        pool = block_pool.new_pool(capacity, policy, self.conventions.pool)
        spec = model.new_windows(block_size, window, pool, self.conventions.window)
        impl = self.implementation.component("sliding_window_manager")(
            self.implementation.component("block_pool")(capacity, policy), block_size, window
        )
        self.windows = self.subject("windows", model, spec, impl)
        self.refused: tuple[str, int, int] | None = None

    def grow(self, operation: str, seq: int, n: int) -> None:
        before = self.windows.model
        if self.windows(operation, seq, n) is None:
            self.refused = (operation, seq, n)
            return
        after = self.windows.model
        if self.conventions.window.slid_out == "ring":
            wrapped = n > 0 and after.lengths[seq] > after.window
            event("the ring wrapped over tokens that slid out" if wrapped else "the ring kept every token")
            return
        slid = sum(1 for s, t in after.tables.items() for b in t if b is None) > sum(
            1 for s, t in before.tables.items() if s in after.tables for b in t if b is None
        )
        event("blocks slid out of the window" if slid else "window kept every block")

    @rule(seq=SEQS, length=COUNTS, data=st.data())
    def add_sequence(self, seq: int, length: int, data: st.DataObject) -> None:
        self.grow("add_sequence", seq, length)
        self.maybe_retry(data)

    @rule(seq=SEQS, n=COUNTS, data=st.data())
    def append(self, seq: int, n: int, data: st.DataObject) -> None:
        self.grow("append", seq, n)
        self.maybe_retry(data)

    @rule(seq=SEQS)
    def free(self, seq: int) -> None:
        """Free a sequence; then retry the admission or append refused last, as a scheduler does."""
        if self.windows("free", seq) is not None:
            self.retry_refused()

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
        self.check(model.invariant_window_blocks_exact, state, self.conventions.window)
        self.check_group(block_pool.STATE, state.pool, model.holders(state.tables))
        self.check(model.invariant_window_refines_spec, state, model.abstract(self.windows.model))


TestSlidingWindow = conformance_test(SlidingWindowMachine)


def ring_reference() -> Implementation:
    """The reference's ring (``slid_out="ring"``, HF transformers' shape) over the reference pool."""
    return Implementation(
        name="reference, sliding window as a ring",
        sliding_window_manager=RingSlidingWindowManager,
        conventions=Conventions(window=WindowConventions(slid_out="ring")),
    )


def test_the_reference_ring_conforms() -> None:
    verdict = run_conformance(ring_reference, layers=["sliding-window"], profile="ci")
    assert verdict.conforms, str(verdict)
