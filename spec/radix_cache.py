"""Layer 3, second form -- the radix cache (SGLang's RadixAttention).

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
  marked as used.
* ``lock(key)`` / ``unlock(key)`` -- SGLang's ``inc_lock_ref`` /
  ``dec_lock_ref`` on the node ending ``key`` -- protect a fully cached path
  while a request reads it.  Locks are counted per key; unlocking a key that
  holds no lock is an ``InvalidOperation``.
* ``evict(num_tokens)`` removes exactly ``min(num_tokens, evictable)`` tokens,
  one at a time, always an unprotected *leaf* (a token no cached token
  extends), the least recently used first.  It answers the evicted values in
  that order.  Ties cannot occur: each operation marks one path, so two
  leaves never share a time.
* Bad arguments (a negative count, values not matching the key, locking an
  uncached key) raise ``InvalidOperation`` and change nothing.

Theory of operation: ``Radix`` is a token-level trie in a dict keyed by
prefix, with a logical clock; a real implementation compresses runs of
tokens into nodes (and splits them when a match, insert or lock ends inside
one).  ``abstract`` forgets the clock: implementations are compared through
``RadixState`` and through the order of what they evict.

Invariants:

* ``invariant_radix_prefix_closed`` -- the cached prefixes form a tree.
* ``invariant_radix_sizes_consistent`` -- evictable + protected = total, and
  protected counts exactly the tokens on locked paths.
* ``invariant_radix_match_is_longest`` -- a match returns the values of the
  longest cached prefix of the key.
* ``invariant_radix_locked_never_evicted`` -- eviction never takes a token of
  a locked path, and takes exactly what was asked when it can.
* ``invariant_radix_agrees_with_chained_hash`` -- given the same history and
  room enough that nothing was evicted, the radix tree's hit length in whole
  blocks equals the chained-hash cache's.
* ``invariant_radix_refines_spec`` -- the implementation is in the model's state.
  (Eviction order is checked with the pool's ``invariant_eviction_order``.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec.block_manager import check_tokens
from kvspec.spec.block_pool import diff_states
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import invariant

Key = tuple[int, ...]


@attrs.frozen
class RadixState:
    """The abstract state: each cached prefix's value, and the locks held per key."""

    values: Mapping[Key, int]
    locks: Mapping[Key, int]

    @property
    def protected(self) -> frozenset[Key]:
        return frozenset(key[:i] for key in self.locks for i in range(1, len(key) + 1))


@runtime_checkable
class RadixCache(Protocol):
    """What a radix cache offers; thin enough to wrap SGLang's ``RadixCache``."""

    def match_prefix(self, key: Sequence[int]) -> tuple[int, ...]: ...
    def insert(self, key: Sequence[int], values: Sequence[int]) -> int: ...
    def lock(self, key: Sequence[int]) -> None: ...
    def unlock(self, key: Sequence[int]) -> None: ...
    def evict(self, num_tokens: int) -> tuple[int, ...]: ...
    def total_size(self) -> int: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def snapshot(self) -> RadixState: ...


# -- the model -------------------------------------------------------------------


@attrs.frozen
class Radix:
    """Token-level trie: prefix -> (value, last use); locks per key; a logical clock."""

    values: Mapping[Key, int]
    last_use: Mapping[Key, int]
    locks: Mapping[Key, int]
    clock: int


def new_radix() -> Radix:
    return Radix(values={}, last_use={}, locks={}, clock=0)


def abstract(radix: Radix) -> RadixState:
    return RadixState(values=dict(radix.values), locks=dict(radix.locks))


def _longest_cached(radix: Radix, key: Key) -> int:
    length = 0
    while length < len(key) and key[: length + 1] in radix.values:
        length += 1
    return length


def _touch(radix: Radix, key: Key, length: int) -> Radix:
    clock = radix.clock + 1
    touched = {key[: i + 1]: clock for i in range(length)}
    return attrs.evolve(radix, last_use={**radix.last_use, **touched}, clock=clock)


def match_prefix(radix: Radix, key: Sequence[int]) -> tuple[Radix, tuple[int, ...]]:
    key = check_tokens(key, allow_empty=True)
    length = _longest_cached(radix, key)
    values = tuple(radix.values[key[: i + 1]] for i in range(length))
    return _touch(radix, key, length), values


def insert(radix: Radix, key: Sequence[int], values: Sequence[int]) -> tuple[Radix, int]:
    key = check_tokens(key, allow_empty=True)
    values = check_tokens(values, allow_empty=True)
    if len(values) != len(key):
        raise InvalidOperation(f"{len(values)} values for a key of {len(key)} tokens")
    present = _longest_cached(radix, key)
    added = {key[: i + 1]: values[i] for i in range(present, len(key))}
    radix = attrs.evolve(radix, values={**radix.values, **added})
    return _touch(radix, key, len(key)), present


def lock(radix: Radix, key: Sequence[int]) -> Radix:
    key = check_tokens(key, allow_empty=False)
    if key not in radix.values:
        raise InvalidOperation(f"cannot lock {key}: it is not cached")
    return attrs.evolve(radix, locks={**radix.locks, key: radix.locks.get(key, 0) + 1})


def unlock(radix: Radix, key: Sequence[int]) -> Radix:
    key = check_tokens(key, allow_empty=False)
    held = radix.locks.get(key, 0)
    if held == 0:
        raise InvalidOperation(f"cannot unlock {key}: it holds no lock")
    locks = {k: n for k, n in radix.locks.items() if k != key}
    if held > 1:
        locks[key] = held - 1
    return attrs.evolve(radix, locks=locks)


def evictable_leaves(radix: Radix) -> list[Key]:
    """Unprotected tokens that no cached token extends, least recently used first."""
    parents = {key[:-1] for key in radix.values}
    protected = abstract(radix).protected
    leaves = [key for key in radix.values if key not in parents and key not in protected]
    return sorted(leaves, key=lambda key: (radix.last_use[key], key))


def evict(radix: Radix, num_tokens: int) -> tuple[Radix, tuple[int, ...]]:
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise InvalidOperation(f"cannot evict {num_tokens!r} tokens")
    values, last_use, evicted = dict(radix.values), dict(radix.last_use), []
    for _ in range(num_tokens):
        leaves = evictable_leaves(attrs.evolve(radix, values=values, last_use=last_use))
        if not leaves:
            break
        evicted.append(values.pop(leaves[0]))
        del last_use[leaves[0]]
    return attrs.evolve(radix, values=values, last_use=last_use), tuple(evicted)


# -- invariants ------------------------------------------------------------------


@invariant("a cached token's KV depends on all before it, so every prefix of a cached path must be cached too")
def invariant_radix_prefix_closed(state: RadixState) -> str | None:
    orphans = sorted(key for key in state.values if len(key) > 1 and key[:-1] not in state.values)
    if orphans:
        return f"cached {orphans[0]} without its prefix {orphans[0][:-1]}"
    return None


@invariant("the scheduler admits by evictable size: a wrong count over-commits memory or strands it")
def invariant_radix_sizes_consistent(state: RadixState, total: int, evictable: int, protected: int) -> str | None:
    expected = len(state.protected & state.values.keys())
    if (total, evictable, protected) != (len(state.values), len(state.values) - expected, expected):
        return (
            f"reports total {total}, evictable {evictable}, protected {protected}; "
            f"the tree holds {len(state.values)} tokens, {expected} of them on locked paths"
        )
    return None


@invariant("a match must reuse the longest cached prefix, and only values cached for exactly that prefix")
def invariant_radix_match_is_longest(expected: Sequence[int], actual: Sequence[int]) -> str | None:
    if tuple(expected) != tuple(actual):
        return f"matched values {tuple(actual)}, the longest cached prefix holds {tuple(expected)}"
    return None


@invariant("a locked path is being read by a running request: evicting it frees KV still in use")
def invariant_radix_locked_never_evicted(
    before: RadixState, after: RadixState, evicted: Sequence[int], asked: int
) -> str | None:
    lost = sorted(before.protected - after.values.keys())
    if lost:
        return f"evicted locked tokens {lost}"
    unprotected = len(before.values.keys() - before.protected)
    if len(evicted) != min(asked, unprotected):
        return f"asked for {asked} of {unprotected} evictable tokens, evicted {len(evicted)}"
    return None


@invariant("a radix tree and a chained-hash cache are two encodings of one cache: block hits must agree")
def invariant_radix_agrees_with_chained_hash(radix_tokens: int, chained_blocks: int, block_size: int) -> str | None:
    if radix_tokens // block_size != chained_blocks:
        return (
            f"radix cache hit {radix_tokens} tokens = {radix_tokens // block_size} blocks of {block_size}, "
            f"chained-hash cache hit {chained_blocks} blocks"
        )
    return None


@invariant("the implementation must be in exactly the state the specification model predicts")
def invariant_radix_refines_spec(actual: RadixState, expected: RadixState) -> str | None:
    if actual != expected:
        return diff_states(actual, expected)
    return None
