"""The reference page manager (spec.radix_pages): a page pool under the reference radix cache, in SGLang's shape.

Free pages sit in a heap, so the lowest-numbered is handed out first
(``page_reuse="lowest_first"``); ``LastFreedFirstPageManager`` keeps them in
a list handed out from its front, each freeing putting its pages there
(``"last_freed_first"``, SGLang's paged allocator).  A running request keeps
its tokens and slots in lists, as SGLang's ``req_to_token`` row does.
Eviction is the radix cache's: the pages of the slots it answers go back.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence

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


class LowestFirst:
    """Free pages in a heap: the lowest-numbered is handed out first."""

    def __init__(self, num_pages: int) -> None:
        self._heap = list(range(num_pages))

    def __len__(self) -> int:
        return len(self._heap)

    def take(self, count: int) -> list[int]:
        return [heapq.heappop(self._heap) for _ in range(count)]

    def put_back(self, pages: Iterable[int]) -> None:
        for page in pages:
            heapq.heappush(self._heap, page)

    def pages(self) -> frozenset[int]:
        return frozenset(self._heap)


class LastFreedFirst:
    """Free pages in a list handed out from its front; a freeing puts its pages at the front, in its order."""

    def __init__(self, num_pages: int) -> None:
        self._list = deque(range(num_pages))

    def __len__(self) -> int:
        return len(self._list)

    def take(self, count: int) -> list[int]:
        return [self._list.popleft() for _ in range(count)]

    def put_back(self, pages: Iterable[int]) -> None:
        self._list.extendleft(reversed(list(pages)))

    def pages(self) -> frozenset[int]:
        return frozenset(self._list)


class RadixPageManager:
    """``num_pages`` pages of ``page_size`` slots, their cached pages in a radix tree; the lowest free page first."""

    radix_cache = RadixCache  # the tree's class
    free_pages: type[LowestFirst | LastFreedFirst] = LowestFirst  # the order free pages go out in (``page_reuse``)

    def __init__(self, num_pages: int, page_size: int) -> None:
        self._page_size = check_block_size(page_size)
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise InvalidOperation(f"a pool needs at least one page, got {num_pages!r}")
        self._cache = self.radix_cache(page_size)
        self._free = self.free_pages(num_pages)
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
        self._return(held.slots[held.cached : present])  # the duplicates
        self._return(held.slots[whole:])  # the partial last page (without keep: everything past the match)

    def evict(self, num_tokens: int) -> Sequence[int]:
        evicted = self._cache.evict(num_tokens)
        self._return_evicted(evicted)
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
        return PagesState(self._page_size, self._free.pages(), cache, requests, tuple(self._contents))

    # -- internals -----------------------------------------------------------------

    def _room(self, pages: int) -> bool:
        return pages <= len(self._free) + self._cache.evictable_size() // self._page_size

    def _take(self, count: int) -> list[int]:
        """The next ``count`` free pages, after evicting leaf pages for what is short (``_room`` said enough)."""
        short = count - len(self._free)
        if short > 0:
            self._return_evicted(self._cache.evict(short * self._page_size))
        return self._free.take(count)

    def _return(self, slots: Sequence[int]) -> None:
        """One freeing of the pages of ``slots``, lowest first."""
        self._free.put_back(sorted({slot // self._page_size for slot in slots}))

    def _return_evicted(self, evicted: Sequence[int]) -> None:
        """The pages of an eviction's slots, freed leaf after leaf in its tokens' order: read from the last back."""
        self._free.put_back(dict.fromkeys(slot // self._page_size for slot in reversed(evicted)))

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


class LastFreedFirstPageManager(RadixPageManager):
    """Declares ``page_reuse="last_freed_first"``: the page freed last is handed out first, as SGLang's."""

    free_pages = LastFreedFirst
