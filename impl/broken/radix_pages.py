"""Broken page managers: each breaks a rule of ``kvspec.spec.radix_pages`` as an engine could ship it.

Every member is an ``Implementation`` whose page manager is a small
subclass of the reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvspec.impl.broken import members
from kvspec.impl.radix_cache import RadixCache
from kvspec.impl.radix_pages import LastFreedFirst, LastFreedFirstPageManager, RadixPageManager
from kvspec.spec import radix_pages as spec
from kvspec.spec.conventions import Conventions, RadixConventions
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.radix_pages import RequestId

pages = members("radix_page_manager", "radix pages (SGLang's page manager)")  # a manager, and what catches it


class RelocksWhatItCaches(RadixPageManager):
    """A request that leaves with its KV cached goes through SGLang's ``cache_unfinished_req`` path: the lock
    moves to the newly inserted pages, as for a request that runs on -- but this one was preempted or
    finished early, and nobody releases that lock."""

    def release(self, request_id: RequestId, keep: bool) -> None:
        held = self._requests.get(request_id)
        super().release(request_id, keep)
        if held is not None and keep is True and len(held.tokens) >= self._page_size:
            self._cache.lock(held.tokens[: len(held.tokens) - len(held.tokens) % self._page_size])


relocks_what_it_caches = pages(
    "keeps a lock on what a leaving request cached", RelocksWhatItCaches, spec.invariant_pages_quiescent
)


class RetractKeepsLock(RadixPageManager):
    """A request dropped -- aborted, or retracted for decode memory -- frees its pages but skips
    ``dec_lock_ref`` on its matched prefix, which stays protected for good."""

    def release(self, request_id: RequestId, keep: bool) -> None:
        held = self._requests.get(request_id)
        super().release(request_id, keep)
        if held is not None and keep is False and held.cached:
            self._cache.lock(held.tokens[: held.cached])


retract_keeps_lock = pages("keeps the lock of a dropped request", RetractKeepsLock, spec.invariant_pages_quiescent)


class FreesLastFullPage(RadixPageManager):
    """The partial last page is found as "the page of the last token": when the request ends on a page
    boundary that page is whole, was just inserted into the cache, and goes back to the pool anyway."""

    def release(self, request_id: RequestId, keep: bool) -> None:
        held = self._requests.get(request_id)
        super().release(request_id, keep)
        if held is not None and keep is True and len(held.tokens) % self._page_size == 0:
            self._return(held.slots[-1:])


frees_last_full_page = pages(
    "frees a cached last page", FreesLastFullPage, spec.invariant_pages_single_owner, spec.invariant_pages_conserved
)


class TrimsTokens(RadixCache):
    """Eviction trims a leaf by the tokens still wanted, as a tree of page size 1 would."""

    def evict(self, num_tokens: int) -> Sequence[int]:
        page_size, self._page_size = self._page_size, 1
        try:
            return super().evict(num_tokens)
        finally:
            self._page_size = page_size


class FreesPartialPages(RadixPageManager):
    """The tree's eviction ignores the page size; the manager returns the page of every evicted slot, and some
    of those pages still hold cached tokens."""

    radix_cache = TrimsTokens


frees_partial_pages = pages("evicts partial pages", FreesPartialPages, spec.invariant_pages_evicted_whole)


class EvictsBeforeFree(RadixPageManager):
    """Makes room by evicting as many pages as it needs even while free pages would do: no page is lost, but
    the cache empties early and later requests miss what the model of its declared conventions still holds."""

    def _take(self, count: int) -> list[int]:
        self._return_evicted(self._cache.evict(count * self._page_size))
        return super()._take(count)


evicts_before_free = pages("evicts while pages are free", EvictsBeforeFree, spec.invariant_pages_refine_spec)


class CountsFreePagesAlone(RadixPageManager):
    """Sizes a request by the free pages alone, as a scheduler that reads ``available_size()`` and forgets
    ``evictable_size()``: with the tree warm, a request waits (and a decode preempts) while unlocked cached
    pages could be evicted for it."""

    def _room(self, pages: int) -> bool:
        return pages <= len(self._free)


counts_free_pages_alone = pages(
    "refuses with evictable pages", CountsFreePagesAlone, spec.invariant_pages_refused_only_when_short
)


class DecodeSkipsEviction(RadixPageManager):
    """A decode that needs a page takes a free one or reports out of memory without asking the tree to evict:
    the scheduler retracts a running request while unlocked cached pages could have made room."""

    def decode(self, request_id: RequestId, token: int) -> None:
        held = self._requests.get(request_id)
        if held is not None and len(held.tokens) % self._page_size == 0 and not self._free:
            raise OutOfBlocks(1, 0, "pages")
        super().decode(request_id, token)


decode_skips_eviction = pages(
    "a decode refuses with evictable pages", DecodeSkipsEviction, spec.invariant_pages_refused_only_when_short
)


class RefusalKeepsLock(RadixPageManager):
    """An admission locks its matched prefix before it sizes the rest; refused, it returns without the
    ``dec_lock_ref`` -- the waiting request holds a lock that pins the prefix until it is admitted, or for
    good if it never is."""

    def admit(self, request_id: RequestId, tokens: Sequence[int]) -> int | None:
        answer = super().admit(request_id, tokens)
        if answer is None:
            matched = len(self._cache.match_prefix(tokens))
            if matched:
                self._cache.lock(tokens[:matched])
        return answer


refusal_keeps_lock = pages(
    "a refused admission keeps its lock", RefusalKeepsLock, spec.invariant_pages_refusal_leaves_nothing
)


class QueuedAtTheBack(LastFreedFirst):
    """A free list that takes the pages it is given back at its end: a queue, not a stack."""

    def put_back(self, pages: Iterable[int]) -> None:
        self._list.extend(pages)


class ReusesTheLongestFreed(LastFreedFirstPageManager):
    """Declares SGLang's ``page_reuse="last_freed_first"`` but queues the pages it frees at the back of its free
    list, as a FIFO free list does: the page freed longest ago is handed out first.  No page is lost or shared;
    the slots differ from the model's (a convention finding)."""

    free_pages = QueuedAtTheBack


reuses_the_longest_freed = pages(
    "declares last-freed-first, reuses the page freed longest ago",
    ReusesTheLongestFreed,
    spec.invariant_pages_refine_spec,
    conventions=Conventions(radix=RadixConventions(page_reuse="last_freed_first")),
)
