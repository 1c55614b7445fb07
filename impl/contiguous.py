"""The reference contiguous allocators: a buddy allocator and a first-fit allocator over one arena.

The buddy allocator keeps one set of free offsets per power-of-two size, so a
block's buddy is found by address in O(1); first-fit keeps the holes as a
sorted list of offsets with their sizes beside them.  Both keep regions in a
dict by request.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import attrs

from kvspec.spec.contiguous import (
    PLACEMENTS,
    ArenaState,
    FreeBlock,
    Ledger,
    Placement,
    Region,
    buddy_chunks,
    largest_region,
    region_size,
)
from kvspec.spec.errors import InvalidOperation, OutOfBlocks, RequestTooLarge


@attrs.define
class Slots:
    """A live request's region, updated in place."""

    offset: int
    size: int
    requested: int
    tokens: int = 0


class ContiguousAllocator:
    """Regions placed by ``placement`` (``buddy`` or ``first-fit``) in an arena of ``capacity`` slots."""

    def __init__(self, capacity: int, placement: Placement = "buddy") -> None:
        if type(capacity) is not int or capacity < 1:
            raise InvalidOperation(f"arena capacity must be a positive int, got {capacity!r}")
        if placement not in PLACEMENTS:
            raise InvalidOperation(f"unknown placement {placement!r}; choose from {PLACEMENTS}")
        self._capacity, self._placement = capacity, placement
        self._largest_region = largest_region(capacity, placement)
        self._regions: dict[int, Slots] = {}
        self._free_by_size: dict[int, set[int]] = {}  # buddy: size -> free offsets
        self._hole_offsets: list[int] = []  # first-fit: sorted
        self._hole_sizes: dict[int, int] = {}  # first-fit: offset -> size
        if placement == "buddy":
            for chunk in buddy_chunks(capacity):
                self._free_by_size[chunk.size] = {chunk.offset}
        else:
            self._add_hole(0, capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def placement(self) -> Placement:
        return self._placement

    def allocate(self, request_id: int, slots: int) -> int:
        if type(request_id) is not int or request_id in self._regions:
            raise InvalidOperation(f"request {request_id!r} is malformed or already holds a region")
        if type(slots) is not int or slots < 1:
            raise InvalidOperation(f"request {request_id} asks for {slots!r} slots")
        size = region_size(self._placement, slots)
        if size > self._largest_region:
            raise RequestTooLarge(f"request {request_id} needs {size} contiguous slots; at most {self._largest_region}")
        offset = self._take_buddy(size) if self._placement == "buddy" else self._take_hole(size)
        self._regions[request_id] = Slots(offset, size, slots)
        return offset

    def append(self, request_id: int, n: int) -> None:
        region = self._lookup(request_id)
        if type(n) is not int or n < 0 or region.tokens + n > region.requested:
            raise InvalidOperation(
                f"request {request_id} holds {region.tokens} of its {region.requested} slots: cannot write {n!r} more"
            )
        region.tokens += n

    def free(self, request_id: int) -> None:
        region = self._lookup(request_id)
        del self._regions[request_id]
        if self._placement == "buddy":
            self._return_buddy(region.offset, region.size)
        else:
            self._return_hole(region.offset, region.size)

    def ledger(self, final_lengths: Mapping[int, int]) -> Ledger:
        tokens = reserved = internal = 0
        for request_id, region in self._regions.items():
            final = final_lengths.get(request_id, region.requested)
            if type(final) is not int or not region.tokens <= final <= region.requested:
                raise InvalidOperation(f"request {request_id}: final length {final!r} is impossible")
            tokens += region.tokens
            reserved += final - region.tokens
            internal += region.size - final
        sizes = self._free_sizes()
        largest = max(sizes, default=0)
        return Ledger(tokens=tokens, reserved=reserved, internal=internal, external=sum(sizes) - largest, free=largest)

    def _largest_free(self) -> int:
        """The largest region that could be placed now."""
        return max(self._free_sizes(), default=0)

    def _free_sizes(self) -> list[int]:
        return [size for size, offsets in self._free_by_size.items() for _ in offsets] + list(self._hole_sizes.values())

    def snapshot(self) -> ArenaState:
        regions = sorted(
            (Region(rid, r.offset, r.size, r.requested, r.tokens) for rid, r in self._regions.items()),
            key=lambda region: region.offset,
        )
        free = [FreeBlock(o, s) for s, offsets in self._free_by_size.items() for o in offsets]
        free += [FreeBlock(o, self._hole_sizes[o]) for o in self._hole_offsets]
        return ArenaState(
            capacity=self._capacity,
            placement=self._placement,
            regions=tuple(regions),
            free=tuple(sorted(free, key=lambda block: block.offset)),
        )

    # -- buddy ------------------------------------------------------------------------------

    def _take_buddy(self, size: int) -> int:
        candidates = [s for s, offsets in self._free_by_size.items() if s >= size and offsets]
        if not candidates:
            raise OutOfBlocks(size, self._largest_free(), "contiguous slots")
        block_size = min(candidates)
        offsets = self._free_by_size[block_size]
        offset = min(offsets)
        offsets.remove(offset)
        while block_size > size:  # keep the lower half, free the upper
            block_size //= 2
            self._free_by_size.setdefault(block_size, set()).add(offset + block_size)
        return offset

    def _return_buddy(self, offset: int, size: int) -> None:
        while offset ^ size in self._free_by_size.get(size, ()):
            self._free_by_size[size].remove(offset ^ size)
            offset, size = min(offset, offset ^ size), 2 * size
        self._free_by_size.setdefault(size, set()).add(offset)

    # -- first-fit ----------------------------------------------------------------------------

    def _take_hole(self, size: int) -> int:
        for offset in self._hole_offsets:
            hole = self._hole_sizes[offset]
            if hole >= size:
                self._remove_hole(offset)
                if hole > size:
                    self._add_hole(offset + size, hole - size)
                return offset
        raise OutOfBlocks(size, self._largest_free(), "contiguous slots")

    def _return_hole(self, offset: int, size: int) -> None:
        after = offset + size
        if after in self._hole_sizes:
            size += self._hole_sizes[after]
            self._remove_hole(after)
        i = bisect.bisect_left(self._hole_offsets, offset)
        before = self._hole_offsets[i - 1] if i > 0 else None
        if before is not None and before + self._hole_sizes[before] == offset:
            size += self._hole_sizes[before]
            self._remove_hole(before)
            offset = before
        self._add_hole(offset, size)

    def _add_hole(self, offset: int, size: int) -> None:
        bisect.insort(self._hole_offsets, offset)
        self._hole_sizes[offset] = size

    def _remove_hole(self, offset: int) -> None:
        self._hole_offsets.remove(offset)
        del self._hole_sizes[offset]

    def _lookup(self, request_id: object) -> Slots:
        region = self._regions.get(request_id) if type(request_id) is int else None
        if region is None:
            raise InvalidOperation(f"request {request_id!r} holds no region")
        return region
