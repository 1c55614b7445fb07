"""Broken contiguous allocators: each breaks one rule of ``kvspec.spec.contiguous`` and must be caught.

Every member is an ``Implementation`` whose allocator is a one-method
subclass of the reference; the meta-tests name the invariant that catches it.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvspec.impl.broken import members
from kvspec.impl.contiguous import ContiguousAllocator
from kvspec.spec import contiguous as contiguous_spec
from kvspec.spec.contiguous import Ledger
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.invariants import invariant_result_matches_spec

allocator = members("contiguous_allocator", "contiguous allocators")  # an allocator, and what catches it there


class CoalescesWithNonBuddy(ContiguousAllocator):
    """Merges a freed block with the free block just after it when that block is not its buddy."""

    def _return_buddy(self, offset: int, size: int) -> None:
        after = next((s for s, offsets in self._free_by_size.items() if offset + size in offsets), None)
        if after is not None and (after != size or offset + size != offset ^ size):
            self._free_by_size[after].remove(offset + size)
            self._free_by_size.setdefault(size + after, set()).add(offset)
            return
        super()._return_buddy(offset, size)


coalesces_with_non_buddy = allocator(  # a misaligned block then splits into halves that lose slots
    "coalesces with a non-buddy",
    CoalescesWithNonBuddy,
    contiguous_spec.invariant_buddy_blocks_aligned,
    contiguous_spec.invariant_slots_conserved,
)


class NeverCoalesces(ContiguousAllocator):
    """Returns a freed block as it is, leaving its free buddy beside it."""

    def _return_buddy(self, offset: int, size: int) -> None:
        self._free_by_size.setdefault(size, set()).add(offset)


never_coalesces = allocator(  # a request the merged buddies would hold is then refused: a false out-of-memory
    "never coalesces",
    NeverCoalesces,
    contiguous_spec.invariant_free_space_coalesced,
    contiguous_spec.invariant_refused_only_when_no_run_fits,
)


class LeaksOnFree(ContiguousAllocator):
    """Forgets the region without returning its slots to the free space."""

    def free(self, request_id: int) -> None:
        self._lookup(request_id)
        del self._regions[request_id]


leaks_on_free = allocator("leaks a region on free", LeaksOnFree, contiguous_spec.invariant_slots_conserved)


class OverlappingPlacement(ContiguousAllocator):
    """Hands out a free block of exactly the right size but leaves it free: the next request gets it too."""

    def _take_buddy(self, size: int) -> int:
        if self._free_by_size.get(size):
            return min(self._free_by_size[size])
        return super()._take_buddy(size)


overlapping_placement = allocator(
    "places regions over free blocks", OverlappingPlacement, contiguous_spec.invariant_regions_disjoint
)


class RoundsDown(ContiguousAllocator):
    """Gives a buddy region the power of two below the request when the request is not one."""

    def allocate(self, request_id: int, slots: int) -> int:
        offset = super().allocate(request_id, slots)
        region = self._regions[request_id]
        if region.size > slots > 1:
            region.size //= 2
            self._return_buddy(offset + region.size, region.size)
        return offset


rounds_down = allocator("rounds a buddy region down", RoundsDown, contiguous_spec.invariant_region_fits)


class PlacesInLastFit(ContiguousAllocator):
    """First-fit that takes the last hole that fits: safe, but not the placement it declares."""

    def _take_hole(self, size: int) -> int:
        fitting = [offset for offset in self._hole_offsets if self._hole_sizes[offset] >= size]
        if len(fitting) > 1:
            self._hole_offsets.remove(fitting[-1])
            self._hole_offsets.insert(0, fitting[-1])
        try:
            return super()._take_hole(size)
        finally:
            self._hole_offsets.sort()


places_in_last_fit = allocator("first-fit takes the last hole", PlacesInLastFit, invariant_result_matches_spec)


class GivesUpAtTheFirstHole(ContiguousAllocator):
    """First-fit that tries the lowest hole alone and reports out of memory when it is too small, though a
    later hole -- the largest, even -- would hold the request: the caller waits, or preempts, for nothing."""

    def _take_hole(self, size: int) -> int:
        first = self._hole_sizes[self._hole_offsets[0]] if self._hole_offsets else 0
        if first < size:
            raise OutOfBlocks(size, first, "contiguous slots")
        return super()._take_hole(size)


gives_up_at_the_first_hole = allocator(
    "first-fit gives up at the first hole",
    GivesUpAtTheFirstHole,
    contiguous_spec.invariant_refused_only_when_no_run_fits,
)


class PrefillWritesOneToken(ContiguousAllocator):
    """Records one token for every write, however many were written: the region looks emptier than it is."""

    def append(self, request_id: int, n: int) -> None:
        super().append(request_id, min(n, 1) if type(n) is int else n)


prefill_writes_one_token = allocator(
    "a write of n tokens records one", PrefillWritesOneToken, contiguous_spec.invariant_arena_refines_spec
)


class LedgerCountsRoundingAsTokens(ContiguousAllocator):
    """Counts the slots the buddy allocator rounded up as tokens rather than internal fragmentation."""

    def ledger(self, final_lengths: Mapping[int, int]) -> Ledger:
        honest = super().ledger(final_lengths)
        rounding = sum(region.size - region.requested for region in self._regions.values())
        return Ledger(
            tokens=honest.tokens + rounding,
            reserved=honest.reserved,
            internal=honest.internal - rounding,
            external=honest.external,
            free=honest.free,
        )


ledger_counts_rounding_as_tokens = allocator(
    "ledger counts rounded-up slots as tokens", LedgerCountsRoundingAsTokens, contiguous_spec.invariant_ledger_exact
)
