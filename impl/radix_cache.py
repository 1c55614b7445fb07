"""The reference radix cache (spec.radix_cache), in SGLang's shape.

Nodes hold runs of tokens with their values; children are keyed by their
first token.  A match, insert or lock that ends inside a node splits it, so
that last-use times and lock counts are per node.  ``lock_ref`` counts the
locks held at or below a node (SGLang's ``inc_lock_ref`` walks to the root).
Eviction pops unlocked leaves from a heap ordered by last use and trims only
as many tokens from the last one as are still needed.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence

from kvspec.spec.block_manager import check_tokens
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.radix_cache import Key, RadixState


class Node:
    __slots__ = ("key", "values", "children", "parent", "lock_ref", "last_use")

    def __init__(self, key: list[int], values: list[int], parent: Node | None, last_use: int) -> None:
        self.key, self.values = key, values
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_use = last_use


class RadixCache:
    """A compressed token tree with per-node last-use times and lock counts."""

    def __init__(self) -> None:
        self._root = Node([], [], None, 0)
        self._clock = itertools.count(1)
        self._locks: Counter[Key] = Counter()
        self._total = 0
        self._protected = 0

    def match_prefix(self, key: Sequence[int]) -> tuple[int, ...]:
        key = check_tokens(key, allow_empty=True)
        path = self._walk(key)
        self._touch(path)
        return tuple(v for node in path for v in node.values)

    def insert(self, key: Sequence[int], values: Sequence[int]) -> int:
        key, values = check_tokens(key, allow_empty=True), check_tokens(values, allow_empty=True)
        if len(values) != len(key):
            raise InvalidOperation(f"{len(values)} values for a key of {len(key)} tokens")
        path = self._walk(key)
        present = sum(len(node.key) for node in path)
        if present < len(key):
            parent = path[-1] if path else self._root
            leaf = Node(list(key[present:]), list(values[present:]), parent, 0)
            parent.children[key[present]] = leaf
            self._total += len(leaf.key)
            path.append(leaf)
        self._touch(path)
        return present

    def lock(self, key: Sequence[int]) -> None:
        key = check_tokens(key, allow_empty=False)
        path = self._walk(key)
        if sum(len(node.key) for node in path) != len(key):
            raise InvalidOperation(f"cannot lock {key}: it is not cached")
        for node in path:
            if node.lock_ref == 0:
                self._protected += len(node.key)
            node.lock_ref += 1
        self._locks[key] += 1

    def unlock(self, key: Sequence[int]) -> None:
        key = check_tokens(key, allow_empty=False)
        if not self._locks.get(key):
            raise InvalidOperation(f"cannot unlock {key}: it holds no lock")
        for node in self._walk(key):
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
        self._locks[key] -= 1
        if self._locks[key] == 0:
            del self._locks[key]

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise InvalidOperation(f"cannot evict {num_tokens!r} tokens")
        leaves = [(n.last_use, id(n), n) for n in self._nodes() if not n.children and self._evictable(n)]
        heapq.heapify(leaves)
        evicted: list[int] = []
        while len(evicted) < num_tokens and leaves:
            _, _, node = heapq.heappop(leaves)
            take = min(num_tokens - len(evicted), len(node.key))
            evicted += node.values[: -take - 1 : -1]
            self._total -= take
            if take < len(node.key):
                del node.key[-take:], node.values[-take:]
                break
            parent = node.parent
            del parent.children[node.key[0]]
            if parent is not self._root and not parent.children and self._evictable(parent):
                heapq.heappush(leaves, (parent.last_use, id(parent), parent))
        return tuple(evicted)

    def total_size(self) -> int:
        return self._total

    def evictable_size(self) -> int:
        return self._total - self._protected

    def protected_size(self) -> int:
        return self._protected

    def snapshot(self) -> RadixState:
        values: dict[Key, int] = {}
        stack = [((), self._root)]
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

    def _walk(self, key: Sequence[int]) -> list[Node]:
        """The nodes along the longest cached prefix of ``key``, splitting the last at its end."""
        node, depth, path = self._root, 0, []
        while depth < len(key) and key[depth] in node.children:
            child = node.children[key[depth]]
            shared = 0
            while shared < len(child.key) and depth + shared < len(key) and child.key[shared] == key[depth + shared]:
                shared += 1
            if shared < len(child.key):
                child = self._split(child, shared)
            path.append(child)
            node, depth = child, depth + shared
        return path

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after ``at`` tokens; the new upper part takes its place under the parent."""
        upper = Node(node.key[:at], node.values[:at], node.parent, node.last_use)
        upper.lock_ref = node.lock_ref
        upper.children[node.key[at]] = node
        node.parent.children[node.key[0]] = upper
        node.key, node.values, node.parent = node.key[at:], node.values[at:], upper
        return upper

    def _evictable(self, node: Node) -> bool:
        return node.lock_ref == 0

    def _touch(self, path: Sequence[Node]) -> None:
        now = next(self._clock)
        for node in path:
            node.last_use = now

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
