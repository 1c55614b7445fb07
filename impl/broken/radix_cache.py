"""Broken radix caches: each breaks a rule of ``kvspec.spec.radix_cache`` and declares what catches it.

Every factory returns an ``Implementation`` whose radix cache is a small
subclass of the reference.  ``WholeLeaves``, ``PerNodeRecency`` and
``LockByHandle`` honour SGLang's conventions (declared, so the model follows
them); the members built on them then break a safety rule, which no
convention excuses.  ``CachesPartialPages`` declares a page size of two
tokens and ``IgnoresExtraKeys`` extra-key namespaces, and each breaks what
it declared.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from kvspec.impl.broken import caught_by, member
from kvspec.impl.radix_cache import Node, RadixCache
from kvspec.spec import block_pool
from kvspec.spec import radix_cache as spec
from kvspec.spec.block_manager import check_tokens
from kvspec.spec.conventions import Conventions, RadixConventions
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.implementation import Implementation
from kvspec.spec.prefix_cache import ExtraKey


def evict_leaves(cache: RadixCache, num_tokens: int, whole: bool, evictable: Callable[[Node], bool]) -> tuple[int, ...]:
    """Evict from ``cache``'s least recently used ``evictable`` leaves: whole nodes, or exactly the tokens asked."""
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise InvalidOperation(f"cannot evict {num_tokens!r} tokens")
    order = itertools.count()
    leaves = [(n.last_use, next(order), n) for n in cache._nodes() if not n.children and evictable(n)]
    heapq.heapify(leaves)
    evicted: list[int] = []
    while len(evicted) < num_tokens and leaves:
        _, _, node = heapq.heappop(leaves)
        take = len(node.key) if whole else min(num_tokens - len(evicted), len(node.key))
        evicted += node.values[: -take - 1 : -1]
        cache._total -= take
        if take < len(node.key):
            node.key, node.values = node.key[:-take], node.values[:-take]
            break
        parent = node.parent
        assert parent is not None, "a leaf in the tree has a parent"
        del parent.children[node.key[0]]
        node.parent = None
        cache._nodes_count -= 1
        if parent is not cache._root and not parent.children and evictable(parent):
            heapq.heappush(leaves, (parent.last_use, next(order), parent))
    return tuple(evicted)


class RadixEvictsLockedPaths(RadixCache):
    """Ignores lock counts when choosing leaves to evict (SGLang's ``lock_ref`` skipped)."""

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        return evict_leaves(self, num_tokens, whole=False, evictable=lambda node: True)


class RadixMatchIsNotAUse(RadixCache):
    """A match does not refresh last use, so eviction order follows inserts only."""

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        path = self._walk(self._named(check_tokens(key, allow_empty=True), extra_key))
        return tuple(v for node in path for v in node.values)


class MatchDropsLastToken(RadixCache):
    """An off-by-one: a match answers all but the last matched token's value."""

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        return super().match_prefix(key, extra_key)[:-1]


class ProtectedCountsEveryLock(RadixCache):
    """``protected_size()`` adds up the locked keys' lengths, counting shared prefixes once per lock."""

    def protected_size(self) -> int:
        return sum(len(key) * count for key, count in self._locks.items())


class EvictsOneTokenPerCall(RadixCache):
    """Evicts at most one token however many were asked for."""

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        return super().evict(min(num_tokens, 1) if isinstance(num_tokens, int) and num_tokens >= 0 else num_tokens)


class SplitsOnlyWhatItLocks(RadixCache):
    """Refuses an uncached key before walking: a refused lock must not split a node, which whole-leaf eviction
    and per-node recency see."""

    def lock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        named = self._named(check_tokens(key, allow_empty=False), extra_key, whole_pages=True)
        if named not in self.snapshot().values:
            raise InvalidOperation(f"cannot lock {tuple(key)}: it is not cached")
        super().lock(key, extra_key)


class WholeLeaves(SplitsOnlyWhatItLocks):
    """SGLang's eviction: whole unlocked leaf nodes, least recently used first, until enough are gone."""

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        return evict_leaves(self, num_tokens, whole=True, evictable=lambda node: not node.lock_ref)


class WholeLeavesIgnoringLocks(RadixCache):
    """Whole leaves, chosen without looking at their locks."""

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        return evict_leaves(self, num_tokens, whole=True, evictable=lambda node: True)


class PerNodeRecency(SplitsOnlyWhatItLocks):
    """SGLang's recency: a walk stamps each node it visits, whole, and only then splits the last one; the upper
    part a split cuts off is stamped when it is cut."""

    def _stamp_visited(self, key: Sequence[int], extra_key: ExtraKey) -> None:
        named, node, depth, now = (
            self._named(check_tokens(key, allow_empty=True), extra_key),
            self._root,
            0,
            next(self._clock),
        )
        while depth < len(named) and named[depth] in node.children:
            node = node.children[named[depth]]
            node.last_use = now
            if named[depth : depth + len(node.key)] != node.key:
                break  # the walk ends inside this node
            depth += len(node.key)
        self._push_if_evictable(node)  # its tail, once split off, is a leaf stamped now

    def _split(self, node: Node, at: int) -> Node:
        upper = super()._split(node, at)
        upper.last_use = next(self._clock)
        return upper

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        self._stamp_visited(key, extra_key)
        return super().match_prefix(key, extra_key)

    def insert(self, key: Sequence[int], values: Sequence[int], extra_key: ExtraKey = None) -> int:
        if len(check_tokens(values, allow_empty=True)) == len(check_tokens(key, allow_empty=True)):
            self._stamp_visited(key, extra_key)  # a refused insert marks nothing
        return super().insert(key, values, extra_key)


class PerNodeMatchReadsWholeNode(PerNodeRecency):
    """Per-node recency, and a match that answers the values of every node it visits, whole."""

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        self._stamp_visited(key, extra_key)
        named = self._named(check_tokens(key, allow_empty=True), extra_key)
        node, depth, values = self._root, 0, list[int]()
        while depth < len(named) and named[depth] in node.children:
            node = node.children[named[depth]]
            values += node.values
            depth += len(node.key)
        return tuple(values)


class LockByHandle(RadixCache):
    """SGLang's locks: on the node a match of the key ends at; the root (no cached prefix) is a no-op."""

    def lock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        named = self._named(check_tokens(key, allow_empty=True), extra_key)
        path = self._walk(named)
        if not path:
            return
        for node in path:
            if node.lock_ref == 0:
                self._protected += len(node.key)
            node.lock_ref += 1
        self._locks[named[: self._depth_of(path)]] += 1

    def unlock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        path = self._walk(self._named(check_tokens(key, allow_empty=True), extra_key))
        if not path:
            return
        depth = self._depth_of(path)
        if not self._locks.get(self._named(tuple(key[:depth]), extra_key)):
            raise InvalidOperation(f"cannot unlock {tuple(key[:depth])}: it holds no lock")
        super().unlock(key[:depth], extra_key)


class HandleLockLostInSplit(LockByHandle):
    """Locks by handle, but splitting a locked node leaves the new upper part unlocked."""

    def _split(self, node: Node, at: int) -> Node:
        upper = super()._split(node, at)
        upper.lock_ref = 0
        return upper


class CachesPartialPages(RadixCache):
    """Declares pages of two tokens, but caches a key's partial last page too, and hands it out on a match."""

    def __init__(self) -> None:
        super().__init__(page_size=2)

    def _named(self, key: tuple[int, ...], extra_key: ExtraKey, whole_pages: bool = False) -> spec.Key:
        return spec.name_tokens(key, self._page_size, extra_key)


class IgnoresExtraKeys(RadixCache):
    """Takes an extra key and drops it: one LoRA adapter's requests hit another's KV."""

    def _named(self, key: tuple[int, ...], extra_key: ExtraKey, whole_pages: bool = False) -> spec.Key:
        return super()._named(key, None, whole_pages)


def _with_radix(name: str, radix: Callable[[], RadixCache], **conventions: object) -> Implementation:
    declared = Conventions(radix=RadixConventions(**conventions))  # type: ignore[arg-type]
    return member(name, declared, radix_cache=radix)


@caught_by(spec.invariant_radix_refines_spec, "radix cache")
@caught_by(spec.invariant_radix_locked_never_evicted, "radix cache")
def radix_evicts_locked_paths() -> Implementation:
    return _with_radix("broken: radix cache evicts locked paths", RadixEvictsLockedPaths)


@caught_by(block_pool.invariant_eviction_order, "radix cache")
def radix_match_is_not_a_use() -> Implementation:
    return _with_radix("broken: radix match does not refresh LRU", RadixMatchIsNotAUse)


@caught_by(spec.invariant_radix_agrees_with_chained_hash, "radix = chained hash")
@caught_by(spec.invariant_radix_match_is_longest, "radix cache")
def match_drops_last_token() -> Implementation:
    return _with_radix("broken: radix match drops its last token", MatchDropsLastToken)


@caught_by(spec.invariant_radix_sizes_consistent, "radix cache")
def protected_counts_every_lock() -> Implementation:
    return _with_radix("broken: protected size counted per lock", ProtectedCountsEveryLock)


@caught_by(spec.invariant_radix_evicts_what_was_asked, "radix cache")
def evicts_one_token_per_call() -> Implementation:
    return _with_radix("broken: evicts one token per call", EvictsOneTokenPerCall)


@caught_by(spec.invariant_radix_locked_never_evicted, "radix cache")
def whole_leaves_ignoring_locks() -> Implementation:
    return _with_radix(
        "broken: whole-leaf eviction ignores locks", WholeLeavesIgnoringLocks, eviction_granularity="whole_leaves"
    )


@caught_by(spec.invariant_radix_match_is_longest, "radix cache")
def per_node_match_reads_whole_node() -> Implementation:
    return _with_radix(
        "broken: per-node recency, match reads whole nodes", PerNodeMatchReadsWholeNode, recency="per_node"
    )


@caught_by(spec.invariant_radix_sizes_consistent, "radix cache")
def handle_lock_lost_in_split() -> Implementation:
    return _with_radix("broken: handle lock lost when its node splits", HandleLockLostInSplit, lock_by="handle")


@caught_by(spec.invariant_radix_match_is_longest, "radix cache")
def caches_partial_pages() -> Implementation:
    return _with_radix("broken: pages of 2, the partial last page cached", CachesPartialPages, page_size=2)


@caught_by(spec.invariant_radix_match_is_longest, "radix cache")
def ignores_extra_keys() -> Implementation:
    return _with_radix("broken: extra keys ignored", IgnoresExtraKeys, extra_key_namespaces=True)
