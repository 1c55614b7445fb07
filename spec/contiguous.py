"""Layer 6 -- contiguous KV allocators: where the memory went before paging.

Rules (vLLM §3 and Fig. 3, lecture §3):

* Before PagedAttention, a request's KV cache was one contiguous tensor.  The
  device's KV memory is a flat *arena* of ``capacity`` token slots; each
  admitted request owns one *region* of it, an offset and a size, from
  admission until it finishes.  A contiguous region cannot grow in place, so
  a request must ask at admission for every slot it will ever write.
* How many slots it asks for is the *reservation* (``reserved_slots``):
  ``max`` reserves the model's maximum length for every request (Orca Max);
  ``exact`` reserves prompt + true output length (Orca Oracle, an upper bound
  no real system reaches because output lengths are unknown in advance).
* Where the region goes is the *placement*, declared by the allocator:
  ``buddy`` (the allocator the vLLM paper assumes for Orca) cuts the arena
  into the binary decomposition of ``capacity``, largest chunk first, so each
  chunk starts at a multiple of its size.  ``allocate`` rounds the request up
  to a power of two, takes the smallest free block that fits (the lowest
  offset among equals) and halves it, freeing the upper half, until it has
  the right size.  ``free`` returns the block and merges it with its buddy --
  the block at ``offset XOR size`` -- while that buddy is free and whole.
  ``first-fit`` gives exactly the slots asked for, at the lowest-offset hole
  that holds them, and ``free`` merges a hole with the holes beside it.
* ``append(request, n)`` writes ``n`` more tokens into the region, never past
  the slots the request asked for.  ``free(request)`` ends the request.
* Errors: no free block large enough now raises ``OutOfBlocks`` (a finishing
  request may make room) -- and only then: free slots that would hold the
  region once merged as ``free`` merges (holes side by side; under ``buddy``
  an aligned window of the region's size) must be given.  A request no empty
  arena could place raises ``RequestTooLarge``; a duplicate, unknown or
  malformed request, or writing past the reservation, raises
  ``InvalidOperation``.  Each changes nothing.

The ledger (vLLM Fig. 3) says where every slot goes, given each live
request's final length (``ledger``):

* *tokens* -- slots holding a token's K and V now;
* *reserved* -- slots the request will fill before it finishes: they will be
  used, but sit idle for the request's whole life (the paper's reservation);
* *internal fragmentation* -- slots of a region past the request's final
  length: over-reservation and the allocator's rounding, never used;
* *external fragmentation* -- free slots outside the largest free block:
  free, but only in pieces smaller than the largest request the arena could
  place right now;
* *free* -- the largest free block.

Paging's ledger has tokens, internal fragmentation only in each sequence's
last block, and free blocks; the serving simulator
(``kvspec.experiments.serving``) puts both side by side.

Theory of operation: ``ArenaState`` is both the model and what an
implementation's ``snapshot()`` returns (regions and free blocks in offset
order); transitions are pure functions returning a new ``ArenaState``.

Invariants (tier in brackets; ``ARENA`` groups those over a snapshot), checked
after every step by ``kvspec.properties.test_contiguous``:

* ``invariant_regions_disjoint`` [safety] -- no slot lies in two blocks
  (region or free).
* ``invariant_slots_conserved`` [safety] -- regions and free blocks tile the arena.
* ``invariant_region_fits`` [safety] -- each region holds at least the slots
  its request asked for, and its tokens fit in them.
* ``invariant_buddy_blocks_aligned`` [convention] -- under ``buddy`` every
  block is a power of two starting at a multiple of its size.
* ``invariant_free_space_coalesced`` [convention] -- no free block is left
  beside its free buddy (``buddy``) or beside another free hole (``first-fit``).
* ``invariant_refused_only_when_no_run_fits`` [safety] -- a request is refused
  only when no run of free slots could hold its region.
* ``invariant_ledger_exact`` [safety] -- the allocator's ledger classifies
  every slot exactly as the spec does, given each request's final length.
* ``invariant_arena_refines_spec`` [convention] -- the implementation's state
  is the model's: the placement's choice of block, split and merge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol, runtime_checkable

import attrs

from kvspec.spec.components import component_kind
from kvspec.spec.errors import InvalidOperation, OutOfBlocks, RequestTooLarge
from kvspec.spec.invariants import Group, diff_states, invariant, refinement

Placement = Literal["buddy", "first-fit"]
PLACEMENTS: tuple[Placement, ...] = ("buddy", "first-fit")
Reservation = Literal["max", "exact"]
RESERVATIONS: tuple[Reservation, ...] = ("max", "exact")


@attrs.frozen
class Region:
    """One request's contiguous slots: ``[offset, offset + size)``."""

    request_id: int
    offset: int
    size: int
    requested: int  # the slots the request asked for; ``size`` is what the placement gave
    tokens: int = 0


@attrs.frozen
class FreeBlock:
    offset: int
    size: int


@attrs.frozen
class ArenaState:
    """The abstract state of a contiguous allocator: the model, and what ``snapshot()`` returns."""

    capacity: int
    placement: Placement
    regions: tuple[Region, ...]  # in offset order
    free: tuple[FreeBlock, ...]  # in offset order


@attrs.frozen
class Ledger:
    """Where the arena's slots go (see the module docstring); the five shares add up to capacity."""

    tokens: int
    reserved: int
    internal: int
    external: int
    free: int

    @property
    def total(self) -> int:
        return self.tokens + self.reserved + self.internal + self.external + self.free


@runtime_checkable
class ContiguousAllocator(Protocol):
    """What a contiguous allocator offers; ``contiguous_allocator(capacity, placement)`` builds one."""

    @property
    def capacity(self) -> int: ...
    @property
    def placement(self) -> Placement: ...
    def allocate(self, request_id: int, slots: int) -> int: ...  # the region's offset
    def append(self, request_id: int, n: int) -> None: ...
    def free(self, request_id: int) -> None: ...
    def ledger(self, final_lengths: Mapping[int, int]) -> Ledger: ...
    def snapshot(self) -> ArenaState: ...


# -- arithmetic the model and implementations share ------------------------------------


CONTIGUOUS_ALLOCATOR = component_kind(
    "contiguous_allocator", ContiguousAllocator, builds="contiguous_allocator(capacity, placement)"
)


def reserved_slots(reservation: Reservation, prompt_len: int, output_len: int, max_length: int) -> int:
    """The slots a request asks for at admission under ``reservation``."""
    return max_length if reservation == "max" else prompt_len + output_len


def region_size(placement: Placement, slots: int) -> int:
    """The slots the placement gives a request that asks for ``slots``: buddy rounds up to a power of two."""
    return 1 << (slots - 1).bit_length() if placement == "buddy" else slots


def buddy_chunks(capacity: int) -> tuple[FreeBlock, ...]:
    """The binary decomposition of ``capacity``, largest first: each chunk starts at a multiple of its size."""
    chunks, offset = [], 0
    for bit in reversed(range(capacity.bit_length())):
        if capacity >> bit & 1:
            chunks.append(FreeBlock(offset, 1 << bit))
            offset += 1 << bit
    return tuple(chunks)


def largest_region(capacity: int, placement: Placement) -> int:
    """The largest region an empty arena can place."""
    return buddy_chunks(capacity)[0].size if placement == "buddy" else capacity


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the model -------------------------------------------------------------------------


def new_arena(capacity: int, placement: Placement) -> ArenaState:
    if not _is_count(capacity) or capacity < 1:
        raise InvalidOperation(f"arena capacity must be a positive int, got {capacity!r}")
    if placement not in PLACEMENTS:
        raise InvalidOperation(f"unknown placement {placement!r}; choose from {PLACEMENTS}")
    free = buddy_chunks(capacity) if placement == "buddy" else (FreeBlock(0, capacity),)
    return ArenaState(capacity=capacity, placement=placement, regions=(), free=free)


def _region(arena: ArenaState, request_id: object) -> Region:
    for region in arena.regions:
        if region.request_id == request_id and _is_count(request_id):
            return region
    raise InvalidOperation(f"request {request_id!r} holds no region")


def _with_free(arena: ArenaState, free: list[FreeBlock], regions: list[Region]) -> ArenaState:
    by_offset = sorted(free, key=lambda block: block.offset)
    return attrs.evolve(arena, free=tuple(by_offset), regions=tuple(sorted(regions, key=lambda region: region.offset)))


def allocate(arena: ArenaState, request_id: int, slots: int) -> tuple[ArenaState, int]:
    """Place a region of ``region_size(slots)`` for a new request; answer its offset."""
    if not _is_count(request_id) or any(r.request_id == request_id for r in arena.regions):
        raise InvalidOperation(f"request {request_id!r} is malformed or already holds a region")
    if not _is_count(slots) or slots < 1:
        raise InvalidOperation(f"request {request_id} asks for {slots!r} slots")
    size = region_size(arena.placement, slots)
    if size > largest_region(arena.capacity, arena.placement):
        raise RequestTooLarge(
            f"request {request_id} needs {size} contiguous slots; the arena never has more than "
            f"{largest_region(arena.capacity, arena.placement)}"
        )
    fitting = [block for block in arena.free if block.size >= size]
    if not fitting:
        raise OutOfBlocks(size, max((b.size for b in arena.free), default=0), "contiguous slots")
    if arena.placement == "buddy":
        chosen = min(fitting, key=lambda block: (block.size, block.offset))
        rest = [block for block in arena.free if block != chosen]
        half = chosen.size
        while half > size:  # split, keeping the lower half, freeing the upper
            half //= 2
            rest.append(FreeBlock(chosen.offset + half, half))
    else:
        chosen = fitting[0]  # free blocks are in offset order: the first hole that fits
        rest = [block for block in arena.free if block != chosen]
        if chosen.size > size:
            rest.append(FreeBlock(chosen.offset + size, chosen.size - size))
    region = Region(request_id=request_id, offset=chosen.offset, size=size, requested=slots)
    return _with_free(arena, rest, [*arena.regions, region]), chosen.offset


def append(arena: ArenaState, request_id: int, n: int) -> ArenaState:
    """Write ``n`` more tokens into the request's region, never past what it asked for."""
    region = _region(arena, request_id)
    if not _is_count(n) or n < 0 or region.tokens + n > region.requested:
        raise InvalidOperation(
            f"request {request_id} holds {region.tokens} of its {region.requested} slots: cannot write {n!r} more"
        )
    grown = attrs.evolve(region, tokens=region.tokens + n)
    return attrs.evolve(arena, regions=tuple(grown if r == region else r for r in arena.regions))


def free(arena: ArenaState, request_id: int) -> ArenaState:
    """End the request: its block returns to the free space, merged with its buddy or its neighbours."""
    region = _region(arena, request_id)
    free_blocks = list(arena.free)
    block = FreeBlock(region.offset, region.size)
    if arena.placement == "buddy":
        while (buddy := FreeBlock(block.offset ^ block.size, block.size)) in free_blocks:
            free_blocks.remove(buddy)
            block = FreeBlock(min(block.offset, buddy.offset), 2 * block.size)
    else:
        for neighbour in [
            b for b in free_blocks if b.offset + b.size == block.offset or block.offset + block.size == b.offset
        ]:
            free_blocks.remove(neighbour)
            start = min(block.offset, neighbour.offset)
            block = FreeBlock(start, block.size + neighbour.size)
    regions = [r for r in arena.regions if r != region]
    return _with_free(arena, [*free_blocks, block], regions)


def ledger(arena: ArenaState, final_lengths: Mapping[int, int]) -> Ledger:
    """Classify every slot; a request missing from ``final_lengths`` is taken to fill its reservation."""
    tokens = reserved = internal = 0
    for region in arena.regions:
        final = final_lengths.get(region.request_id, region.requested)
        if not _is_count(final) or not region.tokens <= final <= region.requested:
            raise InvalidOperation(
                f"request {region.request_id} holds {region.tokens} tokens of {region.requested} reserved:"
                f" final length {final!r} is impossible"
            )
        tokens += region.tokens
        reserved += final - region.tokens
        internal += region.size - final
    largest = max((block.size for block in arena.free), default=0)
    external = sum(block.size for block in arena.free) - largest
    return Ledger(tokens=tokens, reserved=reserved, internal=internal, external=external, free=largest)


# -- invariants over snapshots -------------------------------------------------------------


def _blocks(state: ArenaState) -> list[tuple[int, int, str]]:
    held = [(r.offset, r.size, f"request {r.request_id}") for r in state.regions]
    return sorted(held + [(b.offset, b.size, "free") for b in state.free])


@invariant(
    "two requests writing the same slot corrupt each other's attention; a free slot inside a region is handed out twice",
    "safety",
)
def invariant_regions_disjoint(state: ArenaState) -> str | None:
    blocks = _blocks(state)
    for (offset, size, owner), (next_offset, _, next_owner) in zip(blocks, blocks[1:], strict=False):
        if offset + size > next_offset:
            return f"{owner} at [{offset}, {offset + size}) overlaps {next_owner} at {next_offset}"
    outside = [(o, s, owner) for o, s, owner in blocks if o < 0 or s < 1 or o + s > state.capacity]
    if outside:
        return f"blocks outside the arena of {state.capacity} slots: {outside}"
    return None


@invariant("a slot in no region and no free block is lost until restart: the arena shrinks with every leak", "safety")
def invariant_slots_conserved(state: ArenaState) -> str | None:
    held = sum(r.size for r in state.regions)
    free_slots = sum(b.size for b in state.free)
    if held + free_slots != state.capacity:
        return f"regions hold {held} slots and free blocks {free_slots}, but the arena has {state.capacity}"
    return None


@invariant(
    "a buddy allocator finds a block's buddy by its address: a misaligned block merges with the wrong slots",
    "convention",
)
def invariant_buddy_blocks_aligned(state: ArenaState) -> str | None:
    if state.placement != "buddy":
        return None
    bad = [(o, s, owner) for o, s, owner in _blocks(state) if s & (s - 1) or o % s]
    if bad:
        return f"blocks that are not a power of two at a multiple of their size: {bad}"
    return None


@invariant(
    "free space left in pieces that should have merged refuses requests the merged block would serve", "convention"
)
def invariant_free_space_coalesced(state: ArenaState) -> str | None:
    free_blocks = set(state.free)
    for block in state.free:
        if state.placement == "buddy":
            if FreeBlock(block.offset ^ block.size, block.size) in free_blocks:
                return f"free block at {block.offset} of {block.size} slots and its free buddy were not merged"
        elif any(other.offset == block.offset + block.size for other in free_blocks):
            return f"free hole at {block.offset} of {block.size} slots and the hole after it were not merged"
    return None


@invariant("a request writes every slot it reserved: a region smaller than that overflows into its neighbour", "safety")
def invariant_region_fits(state: ArenaState) -> str | None:
    for region in state.regions:
        if not 0 <= region.tokens <= region.requested <= region.size:
            return (
                f"request {region.request_id} holds {region.tokens} tokens in a region of {region.size} slots"
                f" after asking for {region.requested}"
            )
    return None


def free_runs(state: ArenaState) -> list[FreeBlock]:
    """The runs of free slots: free blocks side by side, merged."""
    runs: list[FreeBlock] = []
    for block in sorted(state.free, key=lambda b: b.offset):
        if runs and runs[-1].offset + runs[-1].size == block.offset:
            runs[-1] = FreeBlock(runs[-1].offset, runs[-1].size + block.size)
        else:
            runs.append(block)
    return runs


def room_for(state: ArenaState, size: int) -> FreeBlock | None:
    """Free slots that could hold a region of ``size``, merged as ``free`` merges: any run under first-fit;
    under buddy an aligned window, which never crosses the arena's chunks (``buddy_chunks``)."""
    for run in free_runs(state):
        start = -(-run.offset // size) * size if state.placement == "buddy" else run.offset
        if start + size <= run.offset + run.size:
            return FreeBlock(start, size)
    return None


@invariant("a false out-of-memory turns a request away, or preempts one, while the slots it needs lie free", "safety")
def invariant_refused_only_when_no_run_fits(before: ArenaState, slots: int) -> str | None:
    """A request for ``slots`` was refused; ``before`` is the allocator's own snapshot before the call."""
    room = room_for(before, region_size(before.placement, slots))
    if room is not None:
        return (
            f"a request for {slots} slots was refused while slots [{room.offset}, {room.offset + room.size}) were free"
        )
    return None


@invariant(
    "the ledger is the fragmentation figure: a slot counted in the wrong share misstates where memory goes", "safety"
)
def invariant_ledger_exact(reported: Ledger, state: ArenaState, final_lengths: Mapping[int, int]) -> str | None:
    """``reported`` is what the allocator's ``ledger(final_lengths)`` answered, ``state`` its own snapshot, and
    ``final_lengths`` the caller's record of each live request's true final length (a request it cannot vouch
    for left out)."""
    expected = ledger(state, final_lengths)
    if reported != expected:
        return diff_states(reported, expected)
    return None


invariant_arena_refines_spec = refinement("invariant_arena_refines_spec")


ARENA = Group(
    members=(
        invariant_regions_disjoint,
        invariant_slots_conserved,
        invariant_region_fits,
        invariant_buddy_blocks_aligned,
        invariant_free_space_coalesced,
    )
)
