"""The reference radix cache (spec.radix_cache), in SGLang's shape.

Nodes hold runs of tokens with their values; children are keyed by their
first token.  A match, insert or lock that ends inside a node splits it, so
that last-use times and lock counts are per node.  ``lock_ref`` counts the
locks held at or below a node (SGLang's ``inc_lock_ref`` walks to the root).
Eviction pops unlocked leaves from a heap ordered by last use and trims only
as many tokens from the last one as are still needed.

Speed: keys and values are tuples, compared a node at a time by C-level slice
comparison (a binary search finds where a key leaves a node).  The eviction
heap lives as long as the tree: a node is pushed whenever it may have become
the least recently used unlocked leaf (created, touched, unlocked, or left
childless), and an entry is checked when it reaches the top -- a stale one
(the node since touched, locked, extended or removed) is dropped.  The heap is
rebuilt from the tree when stale entries outnumber the nodes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvspec.spec.block_manager import check_tokens
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.radix_cache import Key, RadixState


def _tokens(tokens: Any) -> Key:
    """``check_tokens`` with the common case (a list or tuple of plain ints) checked in C."""
    kind = type(tokens)
    if (kind is tuple or kind is list) and set(map(type, tokens)) <= {int} and (not tokens or min(tokens) >= 0):
        return tokens if kind is tuple else tuple(tokens)
    return check_tokens(tokens, allow_empty=True)


def _shared(key: Key, depth: int, node_key: Key) -> int:
    """How many leading tokens of ``node_key`` equal ``key[depth:]``."""
    segment = key[depth : depth + len(node_key)]
    if segment == node_key[: len(segment)]:
        return len(segment)
    low, high = 0, len(segment)  # segment[:low] matches; the first difference lies before high
    while high - low > 1:
        middle = (low + high) // 2
        if segment[low:middle] == node_key[low:middle]:
            low = middle
        else:
            high = middle
    return low


class Node:
    __slots__ = ("key", "values", "children", "parent", "lock_ref", "last_use")

    def __init__(self, key: Key, values: Key, parent: Node | None, last_use: int) -> None:
        self.key, self.values = key, values
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_use = last_use


class RadixCache:
    """A compressed token tree with per-node last-use times and lock counts."""

    def __init__(self) -> None:
        self._root = Node((), (), None, 0)
        self._clock = itertools.count(1)
        self._locks: Counter[Key] = Counter()
        self._total = 0
        self._protected = 0
        self._nodes_count = 0  # nodes below the root
        self._heap: list[tuple[int, int, Node]] = []  # (last use, push order, node): maybe-evictable leaves
        self._pushes = itertools.count()

    def match_prefix(self, key: Sequence[int]) -> tuple[int, ...]:
        key = _tokens(key)
        path = self._walk(key)
        self._touch(path)
        return tuple(itertools.chain.from_iterable([node.values for node in path]))

    def insert(self, key: Sequence[int], values: Sequence[int]) -> int:
        key, values = _tokens(key), _tokens(values)
        if len(values) != len(key):
            raise InvalidOperation(f"{len(values)} values for a key of {len(key)} tokens")
        path = self._walk(key)
        present = self._depth_of(path)
        if present < len(key):
            parent = path[-1] if path else self._root
            leaf = Node(key[present:], values[present:], parent, 0)
            parent.children[key[present]] = leaf
            self._total += len(leaf.key)
            self._nodes_count += 1
            path.append(leaf)
        self._touch(path)
        return present

    def lock(self, key: Sequence[int]) -> None:
        key = _tokens(key) or check_tokens(key, allow_empty=False)
        path = self._walk(key)
        if not path or self._depth_of(path) != len(key):
            raise InvalidOperation(f"cannot lock {key}: it is not cached")
        for node in path:
            if node.lock_ref == 0:
                self._protected += len(node.key)
            node.lock_ref += 1
        self._locks[key] += 1

    def unlock(self, key: Sequence[int]) -> None:
        key = _tokens(key) or check_tokens(key, allow_empty=False)
        if not self._locks.get(key):
            raise InvalidOperation(f"cannot unlock {key}: it holds no lock")
        path = self._walk(key)
        for node in path:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
        self._push_if_evictable(path[-1])
        self._locks[key] -= 1
        if self._locks[key] == 0:
            del self._locks[key]

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        if type(num_tokens) is not int or num_tokens < 0:
            raise InvalidOperation(f"cannot evict {num_tokens!r} tokens")
        heap, evicted = self._heap, list[int]()
        while len(evicted) < num_tokens and heap:
            last_use, _, node = heap[0]
            if node.parent is None or node.children or node.lock_ref or node.last_use != last_use:
                heapq.heappop(heap)  # stale: removed, extended, locked or touched since it was pushed
                continue
            take = min(num_tokens - len(evicted), len(node.key))
            evicted += node.values[: -take - 1 : -1]
            self._total -= take
            if take < len(node.key):
                node.key, node.values = node.key[:-take], node.values[:-take]
                break
            heapq.heappop(heap)
            parent = node.parent
            assert parent is not None  # checked above: only attached nodes are evicted
            del parent.children[node.key[0]]
            node.parent = None
            self._nodes_count -= 1
            if parent is not self._root:
                self._push_if_evictable(parent)
        return tuple(evicted)

    def total_size(self) -> int:
        return self._total

    def evictable_size(self) -> int:
        return self._total - self._protected

    def protected_size(self) -> int:
        return self._protected

    def snapshot(self) -> RadixState:
        values: dict[Key, int] = {}
        stack: list[tuple[Key, Node]] = [((), self._root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                path = prefix
                for token, value in zip(child.key, child.values, strict=True):
                    path += (token,)
                    values[path] = value
                stack.append((path, child))
        return RadixState(values=values, locks=dict(self._locks))

    # -- internals -----------------------------------------------------------------

    def _walk(self, key: Key) -> list[Node]:
        """The nodes along the longest cached prefix of ``key``, splitting the last at its end."""
        node, depth, path, length = self._root, 0, [], len(key)
        while depth < length:
            child = node.children.get(key[depth])
            if child is None:
                break
            width = len(child.key)
            if key[depth : depth + width] == child.key:
                shared = width
            else:
                shared = _shared(key, depth, child.key)
                child = self._split(child, shared)
            path.append(child)
            node, depth = child, depth + shared
        return path

    def _depth_of(self, path: list[Node]) -> int:
        return sum([len(node.key) for node in path])

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after ``at`` tokens; the new upper part takes its place under the parent."""
        parent = node.parent
        assert parent is not None  # the root is never split
        upper = Node(node.key[:at], node.values[:at], parent, node.last_use)
        upper.lock_ref = node.lock_ref
        self._nodes_count += 1
        upper.children[node.key[at]] = node
        parent.children[node.key[0]] = upper
        node.key, node.values, node.parent = node.key[at:], node.values[at:], upper
        return upper

    def _touch(self, path: Sequence[Node]) -> None:
        now = next(self._clock)
        for node in path:
            node.last_use = now
        if path:
            self._push_if_evictable(path[-1])  # only the last node of a path can be a leaf

    def _push_if_evictable(self, node: Node) -> None:
        if node.children or node.lock_ref:
            return
        heap = self._heap
        if len(heap) > 2 * self._nodes_count + 64:  # mostly stale entries: rebuild from the tree
            heap[:] = [(n.last_use, next(self._pushes), n) for n in self._nodes() if not n.children and not n.lock_ref]
            heapq.heapify(heap)
            return  # the rebuilt heap holds ``node``
        heapq.heappush(heap, (node.last_use, next(self._pushes), node))

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
