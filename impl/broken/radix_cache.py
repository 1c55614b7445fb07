"""Broken radix caches: each breaks a rule of ``kvspec.spec.radix_cache`` and declares what catches it.

Every member is an ``Implementation`` whose radix cache is a small
subclass of the reference.  ``PerNodeRecency`` and ``LockByHandle``
honour SGLang's conventions (declared, so the model follows
them); the members built on them then break a safety rule, which no
convention excuses.  ``CachesPartialPages`` declares a page size of two
tokens and ``IgnoresExtraKeys`` extra-key namespaces, and each breaks what
it declared.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvspec.impl.broken import members
from kvspec.impl.radix_cache import Node, RadixCache
from kvspec.spec import block_pool
from kvspec.spec import radix_cache as spec
from kvspec.spec.block_manager import check_tokens
from kvspec.spec.conventions import Conventions, RadixConventions
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.prefix_cache import ExtraKey

radix = members("radix_cache", "radix cache")  # a member: its radix cache, and the rules that catch it there


def declaring(**choices: Any) -> Conventions:
    """The conventions of a member that declares radix choices other than the reference's."""
    return Conventions(radix=RadixConventions(**choices))


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


radix_evicts_locked_paths = radix(
    "radix cache evicts locked paths", RadixEvictsLockedPaths, spec.invariant_radix_locked_never_evicted
)


class RadixMatchIsNotAUse(RadixCache):
    """A match does not refresh last use, so eviction order follows inserts only."""

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        path = self._walk(self._named(check_tokens(key, allow_empty=True), extra_key))
        return tuple(v for node in path for v in node.values)


radix_match_is_not_a_use = radix(  # its recency stamps differ at the match; its eviction order only later, if ever
    "radix match does not refresh LRU", RadixMatchIsNotAUse, block_pool.invariant_eviction_order
)


class BreaksRecencyTiesTheOtherWay(RadixCache):
    """A legal choice kvspec does not model: recency read off a coarse clock, one that ticks only at an insert
    (SGLang's ``time.monotonic()`` where it is too coarse to tick between a request's calls), and of the leaves
    stamped alike the one queued last goes first (where SGLang's ``TreeNode.__lt__`` finds neither first, its
    heap's arrangement decides).  Only the order unlocked leaves go in differs from the model's (a convention
    finding): no locked token is evicted, and every count is right."""

    def __init__(self, page_size: int = 1) -> None:
        super().__init__(page_size)
        self._inserts = 0

    def insert(self, key: Sequence[int], values: Sequence[int], extra_key: ExtraKey = None) -> int:
        self._inserts += 1
        return super().insert(key, values, extra_key)

    def _tick(self) -> int:
        return self._inserts

    def _entry(self, node: Node) -> tuple[int, int, Node]:
        return node.last_use, -next(self._pushes), node


breaks_recency_ties_the_other_way = radix(
    "a legal choice: recency on a coarse clock, ties broken the other way",
    BreaksRecencyTiesTheOtherWay,
    block_pool.invariant_eviction_order,
)


class MatchDropsLastToken(RadixCache):
    """An off-by-one: a match answers all but the last matched token's value."""

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        return super().match_prefix(key, extra_key)[:-1]


match_drops_last_token = radix(
    "radix match drops its last token",
    MatchDropsLastToken,
    spec.invariant_radix_match_is_longest,
    also=[(spec.invariant_radix_agrees_with_chained_hash, "radix = chained hash")],
)


class ProtectedCountsEveryLock(RadixCache):
    """``protected_size()`` adds up the locked keys' lengths, counting shared prefixes once per lock."""

    def protected_size(self) -> int:
        return sum(len(key) * count for key, count in self._locks.items())


protected_counts_every_lock = radix(
    "protected size counted per lock", ProtectedCountsEveryLock, spec.invariant_radix_sizes_consistent
)


class EvictsOneTokenPerCall(RadixCache):
    """Evicts at most one token however many were asked for."""

    def evict(self, num_tokens: int) -> Sequence[int]:
        return super().evict(min(num_tokens, 1) if isinstance(num_tokens, int) and num_tokens >= 0 else num_tokens)


evicts_one_token_per_call = radix(
    "evicts one token per call", EvictsOneTokenPerCall, spec.invariant_radix_evicts_what_was_asked
)


class SplitsOnlyWhatItLocks(RadixCache):
    """Refuses an uncached key before walking: a refused lock must not split a node, which whole-leaf eviction
    and per-node recency see."""

    def lock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        named = self._named(check_tokens(key, allow_empty=False), extra_key, whole_pages=True)
        if named not in self.snapshot().values:
            raise InvalidOperation(f"cannot lock {tuple(key)}: it is not cached")
        super().lock(key, extra_key)


class WholeLeavesIgnoringLocks(RadixCache):
    """Whole leaves, chosen without looking at their locks."""

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        return evict_leaves(self, num_tokens, whole=True, evictable=lambda node: True)


whole_leaves_ignoring_locks = radix(
    "whole-leaf eviction ignores locks",
    WholeLeavesIgnoringLocks,
    spec.invariant_radix_locked_never_evicted,
    conventions=declaring(eviction_granularity="whole_leaves"),
)


class PerNodeRecency(SplitsOnlyWhatItLocks):
    """SGLang's recency: a walk stamps each node it visits, whole, and only then splits the last one."""

    def _entered(self, named: spec.Key) -> Iterator[tuple[int, Node]]:
        """The nodes a walk of ``named`` enters, each with the depth it starts at, splitting none: a node is
        entered when its first token is the next one, whether or not the rest of it matches."""
        node, depth = self._root, 0
        while depth < len(named) and named[depth] in node.children:
            node = node.children[named[depth]]
            yield depth, node
            depth += len(node.key)

    def _stamp_visited(self, key: Sequence[int], extra_key: ExtraKey) -> None:
        named = self._named(check_tokens(key, allow_empty=True), extra_key)
        node, now = self._root, next(self._clock)
        for depth, node in self._entered(named):  # the last one entered (or the root) is pushed below
            node.last_use = now
            if named[depth : depth + len(node.key)] != node.key:
                break  # the walk ends inside this node
        self._push_if_evictable(node)  # its tail, once split off, is a leaf stamped now

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
        return tuple(value for _, node in self._entered(named) for value in node.values)


per_node_match_reads_whole_node = radix(
    "per-node recency, match reads whole nodes",
    PerNodeMatchReadsWholeNode,
    spec.invariant_radix_match_is_longest,
    conventions=declaring(recency="per_node"),
)


class LockByHandle(RadixCache):
    """SGLang's locks: a match of the key, then a lock on the node it ends at; the root (no cached prefix) is a
    no-op."""

    def lock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        self.match_prefix(key, extra_key)
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


handle_lock_lost_in_split = radix(
    "handle lock lost when its node splits",
    HandleLockLostInSplit,
    spec.invariant_radix_sizes_consistent,
    conventions=declaring(lock_by="handle"),
)


class CachesPartialPages(RadixCache):
    """Declares pages of two tokens, but caches a key's partial last page too, and hands it out on a match."""

    def __init__(self) -> None:
        super().__init__(page_size=2)

    def _named(self, key: tuple[int, ...], extra_key: ExtraKey, whole_pages: bool = False) -> spec.Key:
        return spec.name_tokens(key, self._page_size, extra_key)


caches_partial_pages = radix(  # its tree holds the partial page from the insert on, before any answer differs
    "pages of 2, the partial last page cached",
    CachesPartialPages,
    spec.invariant_radix_match_is_longest,
    spec.invariant_radix_refines_spec,
    conventions=declaring(page_size=2),
)


class IgnoresExtraKeys(RadixCache):
    """Takes an extra key and drops it: one LoRA adapter's requests hit another's KV."""

    def _named(self, key: tuple[int, ...], extra_key: ExtraKey, whole_pages: bool = False) -> spec.Key:
        return super()._named(key, None, whole_pages)


ignores_extra_keys = radix(
    "extra keys ignored",
    IgnoresExtraKeys,
    spec.invariant_radix_match_is_longest,
    conventions=declaring(extra_key_namespaces=True),
)
