"""The reference page manager (spec.radix_pages): a page pool under the reference radix cache, in SGLang's shape.

Free pages sit in a heap, so the lowest-numbered is handed out first (SGLang
sorts its free pages).  A running request keeps its tokens and slots in
lists, as SGLang's ``req_to_token`` row does.  Eviction is the radix cache's:
the pages of the slots it answers go back to the heap.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import attrs

from kvspec.impl.radix_cache import RadixCache
from kvspec.spec.block_manager import blocks_for, check_block_size, check_tokens
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.radix_pages import NEVER_WRITTEN, Held, PagesState, RequestId


@attrs.define
class Running:
    tokens: list[int]
    slots: list[int]
    cached: int


class RadixPageManager:
    """``num_pages`` pages of ``page_size`` slots, their cached pages in a radix tree."""

    radix_cache = RadixCache  # the tree's class

    def __init__(self, num_pages: int, page_size: int) -> None:
        self._page_size = check_block_size(page_size)
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise InvalidOperation(f"a pool needs at least one page, got {num_pages!r}")
        self._cache = self.radix_cache(page_size)
        self._free = list(range(num_pages))  # a heap
        self._contents = [NEVER_WRITTEN] * (num_pages * page_size)
        self._requests: dict[RequestId, Running] = {}

    def admit(self, request_id: RequestId, tokens: Sequence[int]) -> int | None:
        tokens = check_tokens(tokens, allow_empty=False)
        if self._check_id(request_id) in self._requests:
            raise InvalidOperation(f"request {request_id} is running already")
        cached = self._cache.match_prefix(tokens)
        prefix = tokens[: len(cached)]
        if cached:
            self._cache.lock(prefix)
        new = len(tokens) - len(cached)
        if not self._room(blocks_for(new, self._page_size)):
            if cached:
                self._cache.unlock(prefix)
            return None
        pages, p = self._take(blocks_for(new, self._page_size)), self._page_size
        slots = list(cached) + [pages[i // p] * p + i % p for i in range(new)]
        self._requests[request_id] = Running(list(tokens), slots, len(cached))
        self._write(slots[len(cached) :], tokens[len(cached) :])
        return len(cached)

    def decode(self, request_id: RequestId, token: int) -> None:
        held = self._running(request_id)
        (token,) = check_tokens((token,), allow_empty=False)
        if len(held.tokens) % self._page_size:
            slot = held.slots[-1] + 1
        elif self._room(1):
            slot = self._take(1)[0] * self._page_size
        else:
            raise OutOfBlocks(1, 0, "pages")
        held.tokens.append(token)
        held.slots.append(slot)
        self._write([slot], [token])

    def release(self, request_id: RequestId, keep: bool) -> None:
        held = self._running(request_id)
        if not isinstance(keep, bool):
            raise InvalidOperation(f"keep is a bool, got {keep!r}")
        present = whole = held.cached
        if keep:
            whole = len(held.tokens) - len(held.tokens) % self._page_size
            present = self._cache.insert(held.tokens[:whole], held.slots[:whole])
        if held.cached:
            self._cache.unlock(held.tokens[: held.cached])
        del self._requests[request_id]
        self._return(held.slots[held.cached : present] + held.slots[whole:])

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        evicted = self._cache.evict(num_tokens)
        self._return(evicted)
        return evicted

    def available_size(self) -> int:
        return len(self._free) * self._page_size

    def evictable_size(self) -> int:
        return self._cache.evictable_size()

    def protected_size(self) -> int:
        return self._cache.protected_size()

    def snapshot(self) -> PagesState:
        requests = {rid: Held(tuple(r.tokens), tuple(r.slots), r.cached) for rid, r in self._requests.items()}
        cache = self._cache.snapshot()
        return PagesState(self._page_size, frozenset(self._free), cache, requests, tuple(self._contents))

    # -- internals -----------------------------------------------------------------

    def _room(self, pages: int) -> bool:
        return pages <= len(self._free) + self._cache.evictable_size() // self._page_size

    def _take(self, count: int) -> list[int]:
        """The lowest ``count`` free pages, after evicting leaf pages for what is short (``_room`` said enough)."""
        short = count - len(self._free)
        if short > 0:
            self._return(self._cache.evict(short * self._page_size))
        return [heapq.heappop(self._free) for _ in range(count)]

    def _return(self, slots: Sequence[int]) -> None:
        for page in {slot // self._page_size for slot in slots}:
            heapq.heappush(self._free, page)

    def _write(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        for slot, token in zip(slots, tokens, strict=True):
            self._contents[slot] = token

    @staticmethod
    def _check_id(request_id: object) -> RequestId:
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            raise InvalidOperation(f"request ids are ints, got {request_id!r}")
        return request_id

    def _running(self, request_id: RequestId) -> Running:
        held = self._requests.get(self._check_id(request_id))
        if held is None:
            raise InvalidOperation(f"request {request_id} is not running")
        return held
