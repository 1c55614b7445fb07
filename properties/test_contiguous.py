"""Layer 6 conformance: contiguous allocators against ``kvspec.spec.contiguous``'s model.

Requests arrive with a prompt and a true output length, reserve slots by the
machine's reservation (``max`` or ``exact``), write their prompt, decode one
token at a time and finish; invalid calls (unknown or duplicate requests,
writing past the reservation, requests no arena could place) are mixed in.
Tiny arenas make exhaustion and buddy merges common; the A100 arena
(12,596 slots, OPT-13B's 2,048-token context) shows the realistic shape.
Once an example, with the free space in pieces, requests are sized at the
brim (``at_the_brim``); every refusal is checked against the allocator's own
free space before the call.  After every step the arena invariants hold,
the allocator's ledger is the spec's given each request's true final
length, and the state is the model's.  The caller keeps its own record of
each live request (``Request``: what it asked for, what it wrote, its true
final length), following what the allocator carried out: the ledger is judged
on it, never on the model.
"""

from __future__ import annotations

import attrs
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.spec import contiguous as model
from kvspec.spec.contiguous import PLACEMENTS, RESERVATIONS, Placement, Reservation


@attrs.define
class Request:
    """The caller's record of one live request."""

    asked: int  # the slots it asked for
    final: int | None  # its true final length; None once an out-of-contract call on it was carried out
    written: int = 0  # the tokens it wrote


class ContiguousMachine(LockstepMachine):
    uses = frozenset({"contiguous_allocator"})
    judges = ("contiguous", "invariants")
    capacities = st.integers(1, 24)
    max_lengths = st.integers(2, 12)

    @initialize(data=st.data(), placement=st.sampled_from(PLACEMENTS), reservation=st.sampled_from(RESERVATIONS))
    def start(self, data: st.DataObject, placement: Placement, reservation: Reservation) -> None:
        capacity = data.draw(self.capacities, label="capacity")
        self.max_length = data.draw(self.max_lengths, label="max_length")
        self.reservation = reservation
        self.record(f"arena = contiguous_allocator(capacity={capacity}, placement={placement!r})")
        self.record(f"# reservation {reservation!r}, maximum length {self.max_length}")
        arena = self.implementation.contiguous_allocator(capacity, placement)
        refinement = (model.invariant_arena_refines_spec, lambda arena: arena)  # the model is its own abstraction
        self.arena = self.subject("arena", model, model.new_arena(capacity, placement), arena, refinement=refinement)
        self.requests: dict[int, Request] = {}  # each live request, as the caller knows it
        self.next_id = 0
        self.probed_the_brim = False

    def live(self) -> list[int]:
        return sorted(self.requests)

    def growing(self) -> list[int]:
        return [rid for rid, r in sorted(self.requests.items()) if r.final is not None and r.written < r.final]

    def final_lengths(self) -> dict[int, int]:
        """The true final length of each live request, where the caller knows it."""
        return {rid: r.final for rid, r in self.requests.items() if r.final is not None}

    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        """Admit a request: reserve its slots, then write its prompt (the prefill).  First, as often as not, a
        live request finishes, as one does between two admissions: drawn here, so that swarm testing (which
        turns the ``free`` rule off in many examples) never leaves an example without frees and merges."""
        if bool(self.live()) and data.draw(st.booleans(), label="a request finishes first"):
            self._free(data.draw(st.sampled_from(self.live()), label="finished"))
        self.maybe_at_the_brim(data)
        final = data.draw(st.integers(2, self.max_length), label="final_length")
        prompt = data.draw(st.integers(1, final - 1), label="prompt")
        slots = model.reserved_slots(self.reservation, prompt, final - prompt, self.max_length)
        request_id, self.next_id = self.next_id, self.next_id + 1
        if self._allocate(request_id, slots, final):
            self._append(request_id, prompt)

    @rule(data=st.data())
    def allocate_any(self, data: st.DataObject) -> None:
        self.maybe_at_the_brim(data)
        request_id = data.draw(st.sampled_from([*self.live(), self.next_id, -1]), label="request")
        slots = data.draw(st.integers(-1, self.arena.model.capacity + 2), label="slots")
        if request_id == self.next_id:
            self.next_id += 1
        self._allocate(request_id, slots)

    @rule(data=st.data())
    def punch_holes(self, data: st.DataObject) -> None:
        self.maybe_at_the_brim(data)
        self.punch(data)

    def punch(self, data: st.DataObject, merge: bool = True) -> None:
        """Small requests side by side, then every other one freed: holes that placement must choose among;
        then, if ``merge`` and drawn, the others too."""
        placed = []
        for _ in range(data.draw(st.integers(2, 4), label="count")):
            request_id, self.next_id = self.next_id, self.next_id + 1
            slots = data.draw(st.integers(1, 2), label="slots")
            if self._allocate(request_id, slots):
                placed.append(request_id)
        for request_id in placed[::2]:
            self._free(request_id)
        if merge and data.draw(st.booleans(), label="then the others"):  # each beside a free neighbour: merges
            for request_id in placed[1::2]:
                self._free(request_id)

    def maybe_at_the_brim(self, data: st.DataObject) -> None:
        """Drawn inside most rules, so that swarm testing never turns it off: three times in four (zero, the
        choice the shrinker makes, is no), until an example has probed the brim once."""
        if not self.probed_the_brim and data.draw(st.integers(0, 3), label="allocate at the brim") > 0:
            self.at_the_brim(data)

    def at_the_brim(self, data: st.DataObject) -> None:
        """Once an example, with the free space in pieces (holes punched first if it is not): one slot more
        than the largest piece, which must be refused, then one more than the lowest piece, which a later
        one must hold (where an allocator that looks no further than the first hole refuses falsely)."""
        if len(self.arena.model.free) < 2:
            self.punch(data, merge=False)
        pieces = self.arena.model.free
        if len(pieces) < 2:
            return
        self.probed_the_brim = True
        largest = model.largest_region(self.arena.model.capacity, self.arena.model.placement)
        for slots in (max(piece.size for piece in pieces) + 1, pieces[0].size + 1):
            if model.region_size(self.arena.model.placement, slots) <= largest:
                request_id, self.next_id = self.next_id, self.next_id + 1
                self._allocate(request_id, slots)

    def _allocate(self, request_id: int, slots: int, final: int | None = None) -> bool:
        """Allocate for a request whose true final length is ``final`` (default: every slot it asks for); a refusal
        of a fresh request (the allocator left as it was) is checked against its own free space before the call.
        A second allocation for a live request, or one for no slot, carried out: the caller knows no final length."""
        before = self.arena.snapshot()
        answer = self.arena("allocate", request_id, slots)
        if answer is None:
            if slots >= 1 and request_id not in self.requests and self.arena.snapshot() == before:
                self.check(model.invariant_refused_only_when_no_run_fits, before, slots)
                event("allocation refused, the free space in pieces" if len(before.free) > 1 else "allocation refused")
            return False
        out_of_contract = request_id in self.requests or slots < 1
        self.requests[request_id] = Request(slots, None if out_of_contract else slots if final is None else final)
        if before.free and before.free[0].size < model.region_size(before.placement, slots):
            event("placed past a free block too small for it")
        event(
            "allocation split a block" if len(self.arena.model.free) > 1 else "allocation left one free block or none"
        )
        return True

    @precondition(lambda self: self.growing())
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        self._append(data.draw(st.sampled_from(self.growing()), label="request"), 1)

    @rule(data=st.data(), n=st.integers(-1, 4))
    def append_any(self, data: st.DataObject, n: int) -> None:
        self.maybe_at_the_brim(data)
        request_id = data.draw(st.sampled_from([*self.live(), self.next_id]), label="request")
        self._append(request_id, n)

    def _append(self, request_id: int, n: int) -> None:
        """Write ``n`` tokens; a request then ends no shorter than what it holds.  A write past what it asked for,
        or of no count, carried out: the caller knows no final length."""
        request = self.requests.get(request_id)
        if self.arena("append", request_id, n) is None or request is None:
            return
        if request.final is None or not 0 <= n <= request.asked - request.written:
            request.final = None
            return
        request.written += n
        request.final = max(request.final, request.written)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.maybe_at_the_brim(data)
        self._free(data.draw(st.sampled_from([*self.live(), *self.live(), self.next_id]), label="request"))

    def _free(self, request_id: int) -> None:
        if self.arena("free", request_id) is not None:
            self.requests.pop(request_id, None)
            event("free merged blocks" if len(self.arena.model.free) <= 1 else "free left several free blocks")

    @invariant()
    def arena_matches_spec(self) -> None:
        state = self.arena.snapshot()
        self.check_group(model.ARENA, state)
        final_lengths = self.final_lengths()
        self.check(model.invariant_ledger_exact, self.arena.impl.ledger(final_lengths), state, final_lengths)
        self.check(model.invariant_arena_refines_spec, state, self.arena.model)


class A100ContiguousMachine(ContiguousMachine):
    """OPT-13B on an A100-40GB: 12,596 slots (the buddy arena is 8,192 + 4,096 + 256 + 32 + 16 + 4), 2,048 context."""

    capacities = st.just(12_596)
    max_lengths = st.just(2048)


TestContiguous = conformance_test(ContiguousMachine, "contiguous allocators")
TestA100Contiguous = conformance_test(A100ContiguousMachine, "contiguous allocators (A100, 12,596 slots)", examples=0.2)
