"""The reference radix cache (spec.radix_cache), in SGLang's shape.

Nodes hold runs of tokens with their values; children are keyed by their
first token.  Tokens are stored by the names the spec gives them
(``spec.radix_cache.name_tokens``): with pages or an extra key, a name
carries the page and the extra key, so a child's first token names its
first page and its namespace (SGLang's child key), and a walk matches whole
pages without counting them.  A match, insert or lock that ends inside a node splits it, so
that last-use times and lock counts are per node.  ``lock_ref`` counts the
locks held at or below a node (SGLang's ``inc_lock_ref`` walks to the root).
Eviction pops unlocked leaves from a heap ordered by last use and trims only
as many tokens from the last one as are still needed.

Speed: a node's key and values are views -- a run of the key and values
tuples it was inserted from -- so inserting, splitting, trimming and freeing a
node copy no token and touch no token's int (a node left holding under a
quarter of its tuples copies its run, so the tree keeps alive at most four
times what it caches).  Keys are compared a node at a time by C-level slice
comparison (a binary search finds where a key leaves a node).  A key or values
list is checked in C (a long one through ``array("Q")``); a ``Tokens`` is
checked once, when it is made, as SGLang makes a request's ``RadixKey`` once,
and hashes once (a lock looks its key up).  Eviction answers its values as a view
(``EvictedValues``) over each leaf's run of them, as SGLang hands its allocator each
leaf's tensor: it copies no value.  The eviction heap lives as long as the tree: a node is
pushed whenever it may have become the least recently used unlocked leaf
(created, touched, unlocked, or left childless), and an entry is checked when
it reaches the top -- a stale one (the node since touched, locked, extended or
removed) is dropped.  The heap is rebuilt from the tree when stale entries
outnumber the nodes.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from kvspec.spec.block_manager import check_tokens
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.prefix_cache import ExtraKey, check_extra_key
from kvspec.spec.radix_cache import Key, RadixState, name_tokens

LONG_KEY = 128  # tokens from which a key is checked through an array (see _plain_ints)


class Tokens(tuple[int, ...]):
    """Token ids (or values) checked once, as SGLang builds a request's ``RadixKey`` once: every call takes
    them as they are, and a lock, which looks its key up by hash, hashes a long key once."""

    _hash: int

    def __new__(cls, tokens: Sequence[int]) -> Tokens:
        return super().__new__(cls, _tokens(tokens))

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash


def _tokens(tokens: Any) -> tuple[int, ...]:
    """``check_tokens`` with the common case (a list or tuple of plain ints) checked in C."""
    kind = type(tokens)
    if kind is Tokens:
        return tokens  # checked when it was made
    if (kind is tuple or kind is list) and _plain_ints(tokens):
        return tokens if kind is tuple else tuple(tokens)
    return check_tokens(tokens, allow_empty=True)


def _plain_ints(tokens: Sequence[Any]) -> bool:
    """Whether every token is a non-negative int, or else, rarely, something the exact check must answer.

    A long key goes through ``array("Q")``, which takes exactly the integers 0 .. 2**64 - 1 and bools -- and
    a bool can only sit where the array holds 0 or 1, so only those tokens need their type looked at; a short
    one is cheaper to check token by token.
    """
    if len(tokens) < LONG_KEY:
        return set(map(type, tokens)) <= {int} and (not tokens or min(tokens) >= 0)
    try:
        words = np.frombuffer(array("Q", tokens), dtype=np.uint64)
    except (TypeError, OverflowError):
        return False
    return not any(type(tokens[i]) is bool for i in np.flatnonzero(words <= 1).tolist())


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


class EvictedValues(Sequence[int]):
    """What an eviction gave up, deepest token first: a view over the run of each leaf's stored values it took, in
    the order taken.  A node's values are immutable tuples (a node trimmed later takes a new run of them), so the
    view never changes; it reads, compares, hashes and prints as the tuple of its values."""

    __slots__ = ("_runs", "_length", "_values")

    def __init__(self, runs: list[tuple[tuple[int, ...], int, int]], length: int) -> None:
        self._runs = runs  # (stored, start, end): the values stored[start:end], read from the end back
        self._length = length
        self._values: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[int]:
        for stored, start, end in self._runs:
            yield from stored[end - 1 : start - 1 if start else None : -1]

    def __reversed__(self) -> Iterator[int]:
        for stored, start, end in reversed(self._runs):
            yield from stored[start:end]

    def __getitem__(self, index: Any) -> Any:
        return self.values[index]

    @property
    def values(self) -> tuple[int, ...]:
        if self._values is None:
            self._values = tuple(self)
        return self._values

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EvictedValues | tuple):
            return len(other) == self._length and self.values == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.values)

    def __repr__(self) -> str:
        return repr(self.values)


class Node:
    """A run of the tree: its key is ``tokens[start:end]`` and its values ``stored[start:end]``."""

    __slots__ = ("tokens", "stored", "start", "end", "children", "parent", "lock_ref", "last_use")

    def __init__(
        self, tokens: Key, stored: tuple[int, ...], start: int, end: int, parent: Node | None, last_use: int
    ) -> None:
        self.tokens, self.stored, self.start, self.end = tokens, stored, start, end
        self._compact()
        self.children: dict[Hashable, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_use = last_use

    @property
    def key(self) -> Key:
        return self.tokens[self.start : self.end]

    @key.setter
    def key(self, key: Key) -> None:
        """A key assigned is the whole run (assign its values alike)."""
        self.tokens, self.start, self.end = key, 0, len(key)

    @property
    def values(self) -> tuple[int, ...]:
        return self.stored[self.start : self.end]

    @values.setter
    def values(self, values: tuple[int, ...]) -> None:
        self.stored, self.start, self.end = values, 0, len(values)

    def _compact(self) -> None:
        """Copy the run out of its tuples when it holds under a quarter of them, which it would keep alive."""
        start, end = self.start, self.end
        if 4 * (end - start) < len(self.tokens):
            self.tokens, self.stored = self.tokens[start:end], self.stored[start:end]
            self.start, self.end = 0, end - start


class RadixCache:
    """A compressed token tree with per-node last-use times and lock counts; ``page_size`` tokens per page."""

    def __init__(self, page_size: int = 1) -> None:
        self._page_size = page_size
        self._root = Node((), (), 0, 0, None, 0)
        self._clock = itertools.count(1)
        self._locks: Counter[Key] = Counter()
        self._total = 0
        self._protected = 0
        self._nodes_count = 0  # nodes below the root
        self._heap: list[tuple[int, int, Node]] = []  # (last use, push order, node): maybe-evictable leaves
        self._pushes = itertools.count()

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        path = self._walk(self._named(_tokens(key), extra_key))
        self._touch(path)
        if len(path) == 1:
            return path[0].values
        return tuple(itertools.chain.from_iterable([node.values for node in path]))

    def insert(self, key: Sequence[int], values: Sequence[int], extra_key: ExtraKey = None) -> int:
        tokens, stored = _tokens(key), _tokens(values)
        if len(stored) != len(tokens):
            raise InvalidOperation(f"{len(stored)} values for a key of {len(tokens)} tokens")
        named = self._named(tokens, extra_key)
        path = self._walk(named)
        present = self._depth_of(path)
        if present < len(named):
            parent = path[-1] if path else self._root
            leaf = Node(named, stored, present, len(named), parent, 0)  # no partial last page
            parent.children[named[present]] = leaf
            self._total += len(named) - present
            self._nodes_count += 1
            path.append(leaf)
        self._touch(path)
        return present

    def lock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        named = self._named(_tokens(key) or check_tokens(key, allow_empty=False), extra_key, whole_pages=True)
        path = self._walk(named)
        if not path or self._depth_of(path) != len(named):
            raise InvalidOperation(f"cannot lock {tuple(key)}: it is not cached")
        for node in path:
            if node.lock_ref == 0:
                self._protected += node.end - node.start
            node.lock_ref += 1
        self._locks[named] += 1  # a lookup and a store: a long key hashes in O(length), a Tokens once

    def unlock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        named = self._named(_tokens(key) or check_tokens(key, allow_empty=False), extra_key, whole_pages=True)
        held = self._locks.get(named)
        if not held:
            raise InvalidOperation(f"cannot unlock {tuple(key)}: it holds no lock")
        path = self._walk(named)
        for node in path:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= node.end - node.start
        self._push_if_evictable(path[-1])
        if held == 1:
            self._locks.pop(named)
        else:
            self._locks[named] = held - 1

    def evict(self, num_tokens: int) -> Sequence[int]:
        if type(num_tokens) is not int or num_tokens < 0:
            raise InvalidOperation(f"cannot evict {num_tokens!r} tokens")
        heap, count, runs = self._heap, 0, []
        while count < num_tokens and heap:
            last_use, _, node = heap[0]
            if node.parent is None or node.children or node.lock_ref or node.last_use != last_use:
                heapq.heappop(heap)  # stale: removed, extended, locked or touched since it was pushed
                continue
            wanted, start, end = num_tokens - count, node.start, node.end
            take = min(wanted + -wanted % self._page_size, end - start)  # whole pages
            runs.append((node.stored, end - take, end))
            count += take
            self._total -= take
            if end - take > start:
                node.end = end - take
                node._compact()
                break
            heapq.heappop(heap)
            parent = node.parent
            assert parent is not None  # checked above: only attached nodes are evicted
            del parent.children[node.tokens[start]]
            node.parent = None
            self._nodes_count -= 1
            if parent is not self._root:
                self._push_if_evictable(parent)
        return EvictedValues(runs, count)

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

    def _named(self, key: tuple[int, ...], extra_key: ExtraKey, whole_pages: bool = False) -> Key:
        """``key`` as the tree stores it: cut to whole pages (or, ``whole_pages``, refused if it is not), named."""
        page_size = self._page_size
        if page_size == 1 and extra_key is None:
            return key
        cut = len(key) - len(key) % page_size
        if whole_pages and cut < len(key):
            raise InvalidOperation(f"{key} is not a whole number of pages of {page_size} tokens")
        return name_tokens(key[:cut], page_size, check_extra_key(extra_key))

    def _walk(self, key: Key) -> list[Node]:
        """The nodes along the longest cached prefix of ``key``, splitting the last at its end."""
        node, depth, path, length = self._root, 0, [], len(key)
        while depth < length:
            child = node.children.get(key[depth])
            if child is None:
                break
            start, end = child.start, child.end
            width = end - start
            if (child.tokens is key and start == depth) or key[depth : depth + width] == child.tokens[start:end]:
                shared = width  # a node inserted from this very key, at this depth, matches unread
            else:
                shared = _shared(key, depth, child.tokens[start:end])
                child = self._split(child, shared)
            path.append(child)
            node, depth = child, depth + shared
        return path

    def _depth_of(self, path: list[Node]) -> int:
        return sum([node.end - node.start for node in path])

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after ``at`` tokens; the new upper part takes its place under the parent."""
        parent = node.parent
        assert parent is not None  # the root is never split
        start, tokens = node.start, node.tokens
        upper = Node(tokens, node.stored, start, start + at, parent, node.last_use)
        upper.lock_ref = node.lock_ref
        self._nodes_count += 1
        upper.children[tokens[start + at]] = node
        parent.children[tokens[start]] = upper
        node.start, node.parent = start + at, upper
        node._compact()
        return upper

    def _touch(self, path: Sequence[Node]) -> None:
        now = self._tick()
        for node in path:
            node.last_use = now
        if path:
            self._push_if_evictable(path[-1])  # only the last node of a path can be a leaf

    def _push_if_evictable(self, node: Node) -> None:
        if node.children or node.lock_ref:
            return
        heap = self._heap
        if len(heap) > 2 * self._nodes_count + 64:  # mostly stale entries: rebuild from the tree
            heap[:] = [self._entry(n) for n in self._nodes() if not n.children and not n.lock_ref]
            heapq.heapify(heap)
            return  # the rebuilt heap holds ``node``
        heapq.heappush(heap, self._entry(node))

    def _tick(self) -> int:
        """The time a walk stamps on the nodes it uses: every walk its own."""
        return next(self._clock)

    def _entry(self, node: Node) -> tuple[int, int, Node]:
        """``node``'s place in the eviction heap: by last use (no two leaves share one), then as pushed."""
        return node.last_use, next(self._pushes), node

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
