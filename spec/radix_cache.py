"""Layer 3, second form -- the radix cache (SGLang's RadixAttention), under the reference's conventions.

Rules (lecture §8.1; SGLang ``RadixCache``):

* The cache is a tree over token ids: every cached token is named by the
  whole prefix that ends at it, and holds one *value* (the KV slot its
  caller stored it in).  Prefixes are closed: if ``p + (t,)`` is cached, so
  is ``p``.  Token-granular: any prefix can hit, not only whole blocks.
* ``match_prefix(key)`` returns the values of the longest cached prefix of
  ``key`` and marks that path as just used.
* ``insert(key, values)`` caches ``key`` with one value per token; tokens
  already cached keep their old values (the caller frees its duplicates) and
  the answer is how many leading tokens were already there.  The path is
  marked as used, and then the new tokens: they are newer than the path.
* ``lock(key)`` / ``unlock(key)`` -- SGLang's ``inc_lock_ref`` /
  ``dec_lock_ref`` -- protect a fully cached path while a request reads it.
  Locks are counted per key; unlocking a key that holds no lock is an
  ``InvalidOperation``.
* ``evict(num_tokens)`` removes exactly ``min(num_tokens, evictable)`` tokens,
  one at a time, always an unprotected *leaf* (a token no cached token
  extends), the least recently used first.  It answers the evicted values in
  that order, as any sequence: a tuple, or a view over what it freed (SGLang
  hands its allocator each leaf's tensor, uncopied).  Ties cannot occur: the tokens an operation marks at one time
  lie on one path, so two leaves never share a time.
* Pages: with a page size of ``p`` tokens, keys are cut to whole pages
  before anything else (a key's last ``len(key) % p`` tokens are ignored,
  SGLang's ``RadixKey.page_aligned``), a match hits whole pages only, a lock
  by key names whole pages, and eviction removes a leaf page at a time.  Two
  pages that share leading tokens share no KV: a token is named by its page
  and its place in it (``name_tokens``).
* Namespaces: every operation but ``evict`` takes an optional ``extra_key``
  (a LoRA adapter, a tenant; ``spec.prefix_cache.check_extra_key``).  Keys
  under different extra keys never share a token: a token named ``n`` is
  named ``(e, n)`` under extra key ``e``, as SGLang's child keys are.
  Eviction order spans every namespace.
* Bad arguments (a negative count, values not matching the key, locking an
  uncached key or a partial page, an extra key where none is declared) raise
  ``InvalidOperation`` and change nothing.

Conventions (``spec.conventions.RadixConventions``).  This module is the
reference's: exact eviction, recency per token, locks by key.  The page size
and extra-key namespaces are modelled here for every engine.  SGLang's other
choices -- whole-leaf eviction, recency per node, locks on node handles --
are marked replacements of the functions they change, in
``kvspec.spec.radix_conventions``, which models any declared conventions.

Theory of operation: ``Radix`` is a token-level trie in a dict keyed by
prefix, with a logical clock that advances at each mark; a real
implementation compresses runs of tokens into nodes.  ``abstract`` forgets
the clock: implementations are compared through ``RadixState`` and through
the order of what they evict.

Invariants (tier in brackets):

* ``invariant_radix_prefix_closed`` [safety] -- the cached prefixes form a tree.
* ``invariant_radix_sizes_consistent`` [safety] -- evictable + protected =
  total, and protected counts exactly the tokens on locked paths.
* ``invariant_radix_match_is_longest`` [safety] -- a match returns the values
  of the longest cached prefix of the key.
* ``invariant_radix_locked_never_evicted`` [safety] -- eviction never takes a
  token of a path its caller holds locked (the caller's ledger of the locks
  the cache took).
* ``invariant_radix_evicts_what_was_asked`` [safety] -- eviction frees at least
  ``min(asked, evictable)`` tokens.
* ``invariant_radix_agrees_with_chained_hash`` [safety] -- given the same
  history and room enough that nothing was evicted, the radix tree's hit
  length in whole blocks equals the chained-hash cache's.
* ``invariant_radix_refines_spec`` [convention] -- the implementation is in
  the state of the model of its declared conventions.
  (Eviction order is checked with the pool's ``invariant_eviction_order``.)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import attrs

from kvspec.spec.block_manager import check_tokens
from kvspec.spec.components import component_kind
from kvspec.spec.conventions import REFERENCE, RadixConventions
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import Group, invariant, refinement
from kvspec.spec.prefix_cache import ExtraKey, check_extra_key

Key = tuple[Hashable, ...]  # a cached prefix: its tokens, each named as ``name_tokens`` says


@attrs.frozen
class RadixState:
    """The abstract state: each cached prefix's value, and the locks held per key."""

    values: Mapping[Key, int]
    locks: Mapping[Key, int]

    @property
    def protected(self) -> frozenset[Key]:
        return locked_paths(self.locks)


def locked_paths(locks: Mapping[Key, int]) -> frozenset[Key]:
    """Every prefix on a path that holds a lock (a count of zero or less holds none)."""
    return frozenset(key[:i] for key, count in locks.items() if count > 0 for i in range(1, len(key) + 1))


@runtime_checkable
class RadixCache(Protocol):
    """What a radix cache offers; thin enough to wrap SGLang's ``RadixCache``."""

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]: ...
    def insert(self, key: Sequence[int], values: Sequence[int], extra_key: ExtraKey = None) -> int: ...
    def lock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None: ...
    def unlock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None: ...
    def evict(self, num_tokens: int) -> Sequence[int]: ...
    def total_size(self) -> int: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def snapshot(self) -> RadixState: ...


RADIX_CACHE = component_kind("radix_cache", RadixCache, builds="radix_cache()")


# -- the model -------------------------------------------------------------------


@attrs.frozen
class Radix:
    """Token-level trie: prefix -> (value, last use); locks per key; a logical clock."""

    values: Mapping[Key, int]
    last_use: Mapping[Key, int]
    locks: Mapping[Key, int]
    clock: int
    conventions: RadixConventions = REFERENCE.radix


RadixT = TypeVar("RadixT", bound=Radix)  # the chapter's transitions keep the record of spec.radix_conventions


def new_radix(conventions: RadixConventions = REFERENCE.radix) -> Radix:
    return Radix(values={}, last_use={}, locks={}, clock=0, conventions=conventions)


def abstract(radix: Radix) -> RadixState:
    return RadixState(values=dict(radix.values), locks=dict(radix.locks))


def name_tokens(tokens: Sequence[int], page_size: int = 1, extra_key: ExtraKey = None) -> Key:
    """How a cache names the tokens of a key in its abstract state (``RadixState``).

    With page size 1 a token is named by its id; with pages, by its page (the page's token ids) and its
    place in it, so that pages which share leading tokens stay apart; under an extra key ``e``, each name
    ``n`` becomes ``(e, n)``.  A cached token is keyed by the names of the whole prefix ending at it.
    """
    named: list[Hashable] = list(tokens)
    if page_size > 1:
        named = [
            (tuple(tokens[i - i % page_size : i - i % page_size + page_size]), i % page_size)
            for i in range(len(tokens))
        ]
    if extra_key is not None:
        named = [(extra_key, name) for name in named]
    return tuple(named)


def key_of(radix: Radix, key: object, extra_key: object, *, cut: bool) -> Key:
    """``key`` named (``name_tokens``); ``cut``: its partial last page dropped, else a partial page is refused."""
    tokens = check_tokens(key, allow_empty=True)
    extra_key = check_extra_key(extra_key)
    if extra_key is not None and not radix.conventions.extra_key_namespaces:
        raise InvalidOperation(f"extra key {extra_key!r}: this cache declares no extra-key namespaces")
    page_size = radix.conventions.page_size
    if len(tokens) % page_size and not cut:
        raise InvalidOperation(f"{tokens} is not a whole number of pages of {page_size} tokens")
    return name_tokens(tokens[: len(tokens) - len(tokens) % page_size], page_size, extra_key)


def cached_length(radix: Radix, key: Key) -> int:
    """How many leading tokens of ``key`` are cached."""
    length = 0
    while length < len(key) and key[: length + 1] in radix.values:
        length += 1
    return length


def mark(radix: RadixT, used: Iterable[Key]) -> RadixT:
    """Mark the cached prefixes ``used`` as just used: one tick of the clock for all of them."""
    clock = radix.clock + 1
    return attrs.evolve(radix, last_use={**radix.last_use, **dict.fromkeys(used, clock)}, clock=clock)


def path(key: Key, length: int) -> list[Key]:
    """The prefixes of ``key`` up to ``length`` tokens, shallowest first: the tokens of a walk."""
    return [key[: i + 1] for i in range(length)]


def match_prefix(radix: Radix, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[Radix, tuple[int, ...]]:
    named = key_of(radix, key, extra_key, cut=True)
    walked = path(named, cached_length(radix, named))
    return mark(radix, walked), tuple(radix.values[prefix] for prefix in walked)


def checked_insert(
    radix: Radix, key: Sequence[int], values: Sequence[int], extra_key: ExtraKey
) -> tuple[Key, tuple[int, ...]]:
    """An insert's key, named, and its values; values that do not match the key are refused."""
    tokens, stored = check_tokens(key, allow_empty=True), check_tokens(values, allow_empty=True)
    if len(stored) != len(tokens):
        raise InvalidOperation(f"{len(stored)} values for a key of {len(tokens)} tokens")
    return key_of(radix, tokens, extra_key, cut=True), stored


def add(radix: RadixT, named: Key, values: Sequence[int], present: int) -> RadixT:
    """Cache ``named`` past its ``present`` cached tokens, newer than the walk that found them."""
    added = {named[: i + 1]: values[i] for i in range(present, len(named))}
    return mark(attrs.evolve(radix, values={**radix.values, **added}), added)


def insert(radix: Radix, key: Sequence[int], values: Sequence[int], extra_key: ExtraKey = None) -> tuple[Radix, int]:
    named, stored = checked_insert(radix, key, values, extra_key)
    present = cached_length(radix, named)
    radix = mark(radix, path(named, present))
    return (radix if present == len(named) else add(radix, named, stored, present)), present


def locked_key(radix: Radix, key: Sequence[int], extra_key: ExtraKey, operation: str) -> Key:
    """The key a lock or unlock names: whole pages, cached."""
    named = key_of(radix, key, extra_key, cut=False)
    if named not in radix.values:  # the empty key (the root) is not cached either
        raise InvalidOperation(f"cannot {operation} {tuple(key)}: it is not cached")
    return named


def add_lock(radix: RadixT, locked: Key) -> RadixT:
    return attrs.evolve(radix, locks={**radix.locks, locked: radix.locks.get(locked, 0) + 1})


def remove_lock(radix: RadixT, locked: Key, key: Sequence[int]) -> RadixT:
    held = radix.locks.get(locked, 0)
    if held == 0:
        raise InvalidOperation(f"cannot unlock {tuple(key)}: it holds no lock")
    locks = {k: n for k, n in radix.locks.items() if k != locked}
    if held > 1:
        locks[locked] = held - 1
    return attrs.evolve(radix, locks=locks)


def lock(radix: RadixT, key: Sequence[int], extra_key: ExtraKey = None) -> RadixT:
    return add_lock(radix, locked_key(radix, key, extra_key, "lock"))


def unlock(radix: Radix, key: Sequence[int], extra_key: ExtraKey = None) -> Radix:
    return remove_lock(radix, locked_key(radix, key, extra_key, "unlock"), key)


def evictable_leaves(radix: Radix) -> list[Key]:
    """Unprotected tokens that no cached token extends, least recently used first (no two share a time)."""
    parents = {key[:-1] for key in radix.values}
    protected = abstract(radix).protected
    leaves = [key for key in radix.values if key not in parents and key not in protected]
    return sorted(leaves, key=radix.last_use.__getitem__)


def leaf_page(radix: Radix, leaf: Key) -> tuple[Key, ...]:
    """The tokens of ``leaf``'s page, deepest first: what one eviction step takes."""
    return tuple(leaf[:i] for i in range(len(leaf), len(leaf) - radix.conventions.page_size, -1))


def without(radix: RadixT, gone: Sequence[Key]) -> tuple[RadixT, tuple[int, ...]]:
    """The cache with ``gone`` evicted, and their values in that order."""
    values = {k: v for k, v in radix.values.items() if k not in gone}
    last_use = {k: t for k, t in radix.last_use.items() if k not in gone}
    return attrs.evolve(radix, values=values, last_use=last_use), tuple(radix.values[key] for key in gone)


def evict_page(radix: Radix) -> tuple[Radix, tuple[int, ...]] | None:
    """Evict the least recently used leaf page, deepest token first; None if nothing is evictable."""
    leaves = evictable_leaves(radix)
    return without(radix, leaf_page(radix, leaves[0])) if leaves else None


def evict(radix: Radix, num_tokens: int) -> tuple[Radix, tuple[int, ...]]:
    return evict_by(radix, num_tokens, evict_page)


def evict_by(
    radix: RadixT, num_tokens: int, step: Callable[[RadixT], tuple[RadixT, tuple[int, ...]] | None]
) -> tuple[RadixT, tuple[int, ...]]:
    """Evict leaf by leaf, ``step`` at a time, until ``num_tokens`` are gone or nothing is evictable."""
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise InvalidOperation(f"cannot evict {num_tokens!r} tokens")
    evicted: tuple[int, ...] = ()
    while len(evicted) < num_tokens and (taken := step(radix)) is not None:
        radix, gone = taken
        evicted += gone
    return radix, evicted


# -- invariants ------------------------------------------------------------------


@invariant(
    "a cached token's KV depends on all before it, so every prefix of a cached path must be cached too",
    "safety",
    fails_only_with="a snapshot read off a tree is prefix closed, and so is every state of the model: "
    "one that is not differs from the model's (invariant_radix_refines_spec)",
)
def invariant_radix_prefix_closed(state: RadixState) -> str | None:
    orphans = [key for key in state.values if len(key) > 1 and key[:-1] not in state.values]
    if orphans:
        orphan = min(orphans, key=len)
        return f"cached {orphan} without its prefix {orphan[:-1]}"
    return None


@invariant(
    "the scheduler admits by evictable size: a wrong count over-commits memory or strands it",
    "safety",
)
def invariant_radix_sizes_consistent(state: RadixState, total: int, evictable: int, protected: int) -> str | None:
    expected = len(state.protected & state.values.keys())
    if (total, evictable, protected) != (len(state.values), len(state.values) - expected, expected):
        return (
            f"reports total {total}, evictable {evictable}, protected {protected}; "
            f"the tree holds {len(state.values)} tokens, {expected} of them on locked paths"
        )
    return None


@invariant(
    "a match must reuse the longest cached prefix, and only values cached for exactly that prefix",
    "safety",
)
def invariant_radix_match_is_longest(before: RadixState, named_key: Key, actual: Sequence[int]) -> str | None:
    """``before`` is the cache's own state when asked; ``named_key`` the key as it names tokens (``name_tokens``)."""
    expected = longest_cached(before, named_key)
    if tuple(expected) != tuple(actual):
        return f"matched values {tuple(actual)}, the longest cached prefix holds {tuple(expected)}"
    return None


def longest_cached(state: RadixState, named_key: Key) -> tuple[int, ...]:
    """The values of the longest prefix of ``named_key`` that ``state`` caches, token by token."""
    values = []
    for end in range(1, len(named_key) + 1):
        value = state.values.get(named_key[:end])
        if value is None:
            break
        values.append(value)
    return tuple(values)


@invariant("a locked path is being read by a running request: evicting it frees KV still in use", "safety")
def invariant_radix_locked_never_evicted(held: frozenset[Key], before: RadixState, after: RadixState) -> str | None:
    """``held``: the tokens on the paths the caller holds locked (``locked_paths`` of its ledger of the locks the
    cache took); ``before``, ``after``: the cache's own states around an eviction."""
    lost = (held & before.values.keys()) - after.values.keys()
    if lost:
        return f"evicted locked tokens {sorted(lost, key=repr)}"
    return None


@invariant("a scheduler evicts to make room: freeing less than it could leaves an admission short", "safety")
def invariant_radix_evicts_what_was_asked(
    before: RadixState, after: RadixState, evicted: Sequence[int], asked: int
) -> str | None:
    unprotected = len(before.values.keys() - before.protected)
    if len(evicted) < min(asked, unprotected):
        return f"asked for {asked} of {unprotected} evictable tokens, evicted {len(evicted)}"
    return None


@invariant(
    "a radix tree and a chained-hash cache are two encodings of one cache: block hits must agree",
    "safety",
)
def invariant_radix_agrees_with_chained_hash(radix_tokens: int, chained_blocks: int, block_size: int) -> str | None:
    if radix_tokens // block_size != chained_blocks:
        return (
            f"radix cache hit {radix_tokens} tokens = {radix_tokens // block_size} blocks of {block_size}, "
            f"chained-hash cache hit {chained_blocks} blocks"
        )
    return None


invariant_radix_refines_spec = refinement("invariant_radix_refines_spec")


STATE = Group((invariant_radix_prefix_closed, invariant_radix_sizes_consistent))
"""The safety rules over a radix cache's snapshot, called as ``(state, total, evictable, protected)``."""
