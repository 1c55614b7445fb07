"""Layer 3, radix form over a page pool -- SGLang's KV memory: token slots in pages, owned by a radix cache.

Rules (SGLang's paged ``TokenToKVPoolAllocator`` under its ``RadixCache``; lecture §8.1):

* The pool holds ``num_pages`` pages of ``page_size`` token slots; slot ``s``
  is offset ``s % page_size`` of page ``s // page_size``.  Every page is
  *free*, *cached* (its slots are the values of one cached page of the radix
  tree, ``kvspec.spec.radix_cache`` with this page size) or *private* to one
  running request -- exactly one of the three.
* ``admit(request, tokens)`` -- match ``tokens`` in the tree (a use of the
  path: SGLang's scheduler matches every waiting request before it sizes the
  batch), lock the matched whole pages, and take a page for every further
  ``page_size`` tokens: free pages first (in the order the declared
  ``page_reuse`` says), then pages the tree evicts, least recently used leaf
  page first.  Position ``i`` of the request lives in its matched value, or
  at offset ``i % page_size`` of a new page.  The answer is the number of tokens the cache supplied.  With
  too few free and evictable pages the answer is ``None`` and nothing is
  taken: the request waits, and only its match's use remains.  Never
  otherwise: the pages it needs are counted against the free ones and every
  cached page no lock protects once its match is locked (``room``).
* ``decode(request, token)`` -- one more token; after a full page it takes a
  new page (evicting if it must), else -- no page free or evictable, and
  only then -- ``OutOfBlocks`` and no change: the caller preempts someone and
  tries again.
* ``release(request, keep)`` -- the request leaves.  With ``keep`` (a finish,
  early or not, or a preemption that caches what it computed) its whole
  pages are inserted with their slots; pages of tokens the tree held already
  are duplicates and go back to the pool, as does the partial last page.
  Without (an abort, or SGLang's ``retract_decode``) every page it does not
  share with the tree goes back.  Either way its lock is released.
* ``evict(num_tokens)`` -- the tree gives up at least ``num_tokens`` tokens,
  whole leaf pages; their pages go back to the pool.  The answer is the
  evicted slots (any sequence of them, as the radix cache's).
* Every slot records the token whose KV was written there last
  (``contents``): the stand-in for the KV itself.
* Bad calls (an id that is not an int, admitting a running request, any
  other call on a request that is not running, an empty prompt, a negative
  count) raise ``InvalidOperation`` and change nothing.

Conventions (``spec.conventions.RadixConventions``): the tree's, as
``spec.radix_conventions`` models them at this page size, and one of the
pool's, ``page_reuse`` -- which free page is handed out next, the one
choice that decides every slot number (refinement compares them):

* ``lowest_first`` (the reference) -- the lowest-numbered free page first.
* ``last_freed_first`` -- a marked replacement (``_put_back``): the free
  pages are a list handed out from its front, and every freeing puts its
  pages at the front, so the page freed last is reused first (SGLang's
  ``PagedTokenToKVPoolAllocator`` outside disaggregation, ``need_sort=False``:
  ``free`` prepends the pages it frees, lowest first; ``free_segment``, an
  evicted leaf's pages, in its tokens' order).  A release frees its
  duplicate pages, then its partial last page (two ``free`` calls); an
  eviction frees leaf after leaf, so the leaf it took last comes first.  The
  pool starts lowest first.

Theory of operation: ``Pages`` is the spec's radix model
(``spec.radix_conventions``: the declared radix conventions, at this page
size) beside the free pages, in the order they are handed out, and the
running requests' slots; every transition is pure.

Invariants (tier in brackets):

* ``invariant_pages_single_owner`` [safety] -- no page, and so no slot, has
  two owners among the pool, the cache and the running requests.
* ``invariant_pages_conserved`` [safety] -- free + evictable + protected +
  the requests' private slots = total (SGLang's ``check_memory``).
* ``invariant_pages_quiescent`` [safety] -- with no request running,
  everything cached is evictable and no lock is held.
* ``invariant_pages_evicted_whole`` [safety] -- an eviction frees whole pages.
* ``invariant_pages_refused_only_when_short`` [safety] -- an admission or a
  decode is refused only when the free pages and those the tree could evict
  (a new request's match locked) are fewer than it may take (an admission, a
  page for its last token at least: ``room``).
* ``invariant_pages_refusal_leaves_nothing`` [safety] -- a refused admission
  leaves the locks, the free pages and the cache as they were.
* ``invariant_pages_read_back`` [safety] -- each running request's slots, and
  each cached token's slot, hold that token.
* ``invariant_pages_refine_spec`` [convention] -- the implementation is in
  the model's state.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec import radix_cache, radix_conventions
from kvspec.spec.block_manager import blocks_for, check_block_size, check_tokens
from kvspec.spec.components import component_kind
from kvspec.spec.conventions import REFERENCE, RadixConventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.invariants import Group, invariant, refinement
from kvspec.spec.radix_cache import Radix, RadixState

RequestId = int
NEVER_WRITTEN = -1


@attrs.frozen
class Held:
    """A running request: its tokens, the slot of each, and how many leading tokens the cache supplied."""

    tokens: tuple[int, ...]
    slots: tuple[int, ...]
    cached: int  # whole pages, locked in the tree while the request runs


@attrs.frozen
class PagesState:
    """The abstract state ``snapshot()`` returns."""

    page_size: int
    free: frozenset[int]
    cache: RadixState
    requests: Mapping[RequestId, Held]
    contents: tuple[int, ...]  # per slot, the token written there last (``NEVER_WRITTEN``: none)


@runtime_checkable
class RadixPageManager(Protocol):
    """What ``Implementation.radix_page_manager(num_pages, page_size)`` returns."""

    def admit(self, request_id: RequestId, tokens: Sequence[int]) -> int | None: ...
    def decode(self, request_id: RequestId, token: int) -> None: ...
    def release(self, request_id: RequestId, keep: bool) -> None: ...
    def evict(self, num_tokens: int) -> Sequence[int]: ...
    def available_size(self) -> int: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def snapshot(self) -> PagesState: ...


# -- the model -------------------------------------------------------------------


RADIX_PAGE_MANAGER = component_kind(
    "radix_page_manager", RadixPageManager, builds="radix_page_manager(num_pages, page_size)"
)


@attrs.frozen
class Pages:
    page_size: int
    radix: Radix
    free: tuple[int, ...]  # in the order they are handed out
    requests: Mapping[RequestId, Held]
    contents: tuple[int, ...]


def new_pages(num_pages: int, page_size: int, conventions: RadixConventions = REFERENCE.radix) -> Pages:
    page_size = check_block_size(page_size)
    if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
        raise InvalidOperation(f"a pool needs at least one page, got {num_pages!r}")
    radix = radix_conventions.new_radix(attrs.evolve(conventions, page_size=page_size))
    return Pages(page_size, radix, tuple(range(num_pages)), {}, (NEVER_WRITTEN,) * (num_pages * page_size))


def abstract(pages: Pages) -> PagesState:
    return PagesState(
        pages.page_size, frozenset(pages.free), radix_cache.abstract(pages.radix), dict(pages.requests), pages.contents
    )


def admit(pages: Pages, request_id: RequestId, tokens: Sequence[int]) -> tuple[Pages, int | None]:
    tokens = check_tokens(tokens, allow_empty=False)
    if _check_id(request_id) in pages.requests:
        raise InvalidOperation(f"request {request_id} is running already")
    radix, values = radix_conventions.match_prefix(pages.radix, tokens)
    matched = attrs.evolve(pages, radix=radix)
    if values:
        radix = radix_conventions.lock(radix, tokens[: len(values)])
    try:
        pages, taken = _take(attrs.evolve(pages, radix=radix), blocks_for(len(tokens) - len(values), pages.page_size))
    except OutOfBlocks:
        return matched, None
    p = pages.page_size
    slots = values + tuple(taken[i // p] * p + i % p for i in range(len(tokens) - len(values)))
    held = Held(tokens, slots, len(values))
    return _written(pages, request_id, held, len(values)), len(values)


def decode(pages: Pages, request_id: RequestId, token: int) -> Pages:
    held = _running(pages, request_id)
    (token,) = check_tokens((token,), allow_empty=False)
    if len(held.tokens) % pages.page_size:
        slot = held.slots[-1] + 1
    else:
        pages, (page,) = _take(pages, 1)
        slot = page * pages.page_size
    grown = Held(held.tokens + (token,), held.slots + (slot,), held.cached)
    return _written(pages, request_id, grown, len(held.tokens))


def release(pages: Pages, request_id: RequestId, keep: bool) -> Pages:
    held = _running(pages, request_id)
    if not isinstance(keep, bool):
        raise InvalidOperation(f"keep is a bool, got {keep!r}")
    radix, present, whole = pages.radix, held.cached, held.cached
    if keep:
        whole = len(held.tokens) - len(held.tokens) % pages.page_size
        radix, present = radix_conventions.insert(radix, held.tokens[:whole], held.slots[:whole])
    if held.cached:
        radix = radix_conventions.unlock(radix, held.tokens[: held.cached])
    duplicates = sorted(_pages_of(held.slots[held.cached : present], pages.page_size))
    rest = sorted(_pages_of(held.slots[whole:], pages.page_size))  # the partial last page; without keep, all
    requests = {rid: h for rid, h in pages.requests.items() if rid != request_id}
    return _put_back(attrs.evolve(pages, radix=radix, requests=requests), duplicates, rest)


def evict(pages: Pages, num_tokens: int) -> tuple[Pages, tuple[int, ...]]:
    radix, evicted = radix_conventions.evict(pages.radix, num_tokens)
    # leaf after leaf, each leaf's pages in its tokens' order: the evicted slots read from the last back
    freed = tuple(dict.fromkeys(slot // pages.page_size for slot in reversed(evicted)))
    return _put_back(attrs.evolve(pages, radix=radix), freed), evicted


def evictable_tokens(pages: Pages) -> int:
    return len(pages.radix.values.keys() - radix_cache.abstract(pages.radix).protected)


def _take(pages: Pages, count: int) -> tuple[Pages, tuple[int, ...]]:
    """The first ``count`` free pages, after evicting what is short; ``OutOfBlocks`` if even that is too few."""
    short, p = count - len(pages.free), pages.page_size
    if short > 0:
        evictable = evictable_tokens(pages)
        if short * p > evictable:
            raise OutOfBlocks(count, len(pages.free) + evictable // p, "pages")
        pages, _ = evict(pages, short * p)
    return attrs.evolve(pages, free=pages.free[count:]), pages.free[:count]


def _put_back(pages: Pages, *freeings: Sequence[int]) -> Pages:
    """Modified (``page_reuse="last_freed_first"``): each freeing, in turn, puts its pages at the front of the free
    list, in its order.  The reference keeps the list lowest first."""
    free = pages.free
    for freed in freeings:
        free = tuple(freed) + free
    if pages.radix.conventions.page_reuse == "lowest_first":
        free = tuple(sorted(free))
    return attrs.evolve(pages, free=free)


def _written(pages: Pages, request_id: RequestId, held: Held, start: int) -> Pages:
    """``held`` running, with its tokens from position ``start`` on written into their slots."""
    contents = list(pages.contents)
    for slot, token in zip(held.slots[start:], held.tokens[start:], strict=True):
        contents[slot] = token
    return attrs.evolve(pages, requests={**pages.requests, request_id: held}, contents=tuple(contents))


def _pages_of(slots: Sequence[int], page_size: int) -> frozenset[int]:
    return frozenset(slot // page_size for slot in slots)


def _check_id(request_id: object) -> RequestId:
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise InvalidOperation(f"request ids are ints, got {request_id!r}")
    return request_id


def _running(pages: Pages, request_id: RequestId) -> Held:
    held = pages.requests.get(_check_id(request_id))
    if held is None:
        raise InvalidOperation(f"request {request_id} is not running")
    return held


def private_pages(state: PagesState, request_id: RequestId) -> frozenset[int]:
    """The pages a running request holds that the cache does not: those past its cached prefix."""
    held = state.requests[request_id]
    return _pages_of(held.slots[held.cached :], state.page_size)


# -- invariants ------------------------------------------------------------------


@invariant(
    "a page with two owners is written by one while the other still reads it: the KV of a cached prefix or of "
    "a running request is overwritten",
    "safety",
)
def invariant_pages_single_owner(state: PagesState) -> str | None:
    owners: dict[int, list[str]] = {page: ["the free pool"] for page in state.free}
    for page in _pages_of(tuple(state.cache.values.values()), state.page_size):
        owners.setdefault(page, []).append("the cache")
    for request_id in state.requests:
        for page in private_pages(state, request_id):
            owners.setdefault(page, []).append(f"request {request_id}")
    for page, names in sorted(owners.items()):
        if len(names) > 1:
            return f"page {page} is held by {' and '.join(names)}"
    return None


@invariant(
    "the scheduler admits by free + evictable: slots counted twice over-commit memory, slots counted nowhere are "
    "lost for good",
    "safety",
)
def invariant_pages_conserved(state: PagesState, evictable: int, protected: int, available: int) -> str | None:
    private = sum(len(private_pages(state, rid)) for rid in state.requests) * state.page_size
    total = len(state.contents)
    if available + evictable + protected + private != total:
        return (
            f"free {available} + evictable {evictable} + protected {protected} + held by requests {private} "
            f"= {available + evictable + protected + private} slots, the pool has {total}"
        )
    return None


@invariant(
    "a lock is held on behalf of a running request: one kept after the request left pins its pages for good",
    "safety",
)
def invariant_pages_quiescent(state: PagesState, evictable: int, protected: int) -> str | None:
    if state.requests:
        return None
    if state.cache.locks or protected or evictable != len(state.cache.values):
        locks = sorted(len(key) for key in state.cache.locks)
        return (
            f"no request runs, yet {protected} cached tokens are protected, {evictable} of "
            f"{len(state.cache.values)} evictable, and locks of {locks} tokens are held"
        )
    return None


@invariant(
    "the pool hands out whole pages: a page freed with some of its tokens still cached is handed to a request "
    "that overwrites them",
    "safety",
)
def invariant_pages_evicted_whole(evicted: Sequence[int], page_size: int) -> str | None:
    pages = sorted(_pages_of(evicted, page_size))
    if sorted(evicted) != [page * page_size + offset for page in pages for offset in range(page_size)]:
        return f"evicted slots {sorted(evicted)} are not whole pages of {page_size}"
    return None


def _token(name: Hashable) -> Hashable:
    """The token a cached name stands for (``radix_cache.name_tokens``: with pages, its page and offset)."""
    return name[0][name[1]] if isinstance(name, tuple) else name


@invariant(
    "attention reads a token's KV from its slot: a slot that holds another token's KV corrupts every request "
    "that reads it",
    "safety",
    fails_only_with="a slot is written only by the request that owns its page, so a slot that holds another "
    "token was first given to two owners (invariant_pages_single_owner)",
)
def invariant_pages_read_back(state: PagesState) -> str | None:
    for request_id, held in state.requests.items():
        read = tuple(state.contents[slot] for slot in held.slots)
        if read != held.tokens:
            return f"request {request_id} reads {read} through its slots, its tokens are {held.tokens}"
    for key, slot in state.cache.values.items():
        if state.contents[slot] != _token(key[-1]):
            return f"cached token {_token(key[-1])!r} of a prefix of {len(key)} lives in slot {slot}, which holds {state.contents[slot]}"
    return None


def room(state: PagesState, request_id: RequestId, tokens: Sequence[int]) -> tuple[int, int]:
    """The pages that admitting ``tokens`` (a decode's token, for a running request) may take in ``state``, and
    the pages free or evictable once a new request's match is locked -- both as any engine may count them: a
    new request may take a page for its last token even when the tree holds the whole prompt (the last token's
    logits sample the first new one: SGLang matches at most all tokens but the last, and recomputes that page),
    and its whole match stays locked."""
    p, held = state.page_size, state.requests.get(request_id)
    if held is not None:
        grown = len(held.tokens) + len(tokens)
        needed, locked = blocks_for(grown, p) - blocks_for(len(held.tokens), p), state.cache.protected
    else:
        named = radix_cache.name_tokens(tokens[: len(tokens) - len(tokens) % p], p)
        matched = len(radix_cache.longest_cached(state.cache, named))
        needed = blocks_for(len(tokens) - min(matched, max(len(tokens) - 1, 0) // p * p), p)
        locked = state.cache.protected | set(radix_cache.path(named, matched))
    return needed, len(state.free) + len(state.cache.values.keys() - locked) // p


@invariant(
    "a false out-of-memory keeps a request waiting, and the batch small, while the pages it needs are free or "
    "evictable",
    "safety",
)
def invariant_pages_refused_only_when_short(
    before: PagesState, request_id: RequestId, tokens: Sequence[int]
) -> str | None:
    """An admission (or a running request's decode) of ``tokens`` was refused; ``before`` is the manager's own
    snapshot before the call."""
    needed, available = room(before, request_id, tokens)
    if needed <= available:
        call = "a decode" if request_id in before.requests else "an admission"
        return f"{call} that takes {needed} pages was refused while {available} pages were free or evictable"
    return None


@invariant(
    "a request that waits holds nothing: a lock its refused admission kept pins the prefix for good, a page it took "
    "is lost until restart",
    "safety",
)
def invariant_pages_refusal_leaves_nothing(before: PagesState, after: PagesState) -> str | None:
    if after.cache.locks != before.cache.locks:
        return f"a refused admission left the locks {dict(after.cache.locks)}, they were {dict(before.cache.locks)}"
    if after.free != before.free:
        taken, freed = sorted(before.free - after.free), sorted(after.free - before.free)
        return f"a refused admission took free pages {taken} and freed pages {freed}"
    if after.cache.values != before.cache.values:
        return "a refused admission changed what the tree caches"
    return None


invariant_pages_refine_spec = refinement("invariant_pages_refine_spec")


STATE = Group(
    (invariant_pages_single_owner, invariant_pages_read_back, invariant_pages_quiescent, invariant_pages_conserved)
)
"""The safety rules over a page manager's snapshot, called as ``(state, evictable, protected, available)``."""
