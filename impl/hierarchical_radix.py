"""The reference hierarchical radix cache (spec.hierarchical_radix), in the shape of SGLang's ``HiRadixCache``.

Nodes hold runs of tokens with their device slots and the KV those hold, and the slots of their host copy
in a ``HostPool`` (which holds the host copies' KV).  A walk that ends inside a node splits it, and the
split cuts every field of the node at the same place -- device slots, their KV, host slots -- and leaves
both halves in the transfers the node was in; so status changes (on the device or not, backed up or not,
in a transfer or not) always fall between nodes.  Writes and loads in flight are the sets of nodes they
cover (SGLang's ``ongoing_write_through`` and ``ongoing_load_back``), landed all at once by
``finish_writes`` and ``finish_loads``.  Eviction scans the tree for the least recently used candidate
node and takes tokens from its end, splitting off what it takes; the reference is small, not fast.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from kvspec.spec.block_manager import check_tokens
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.hierarchical_radix import Copies, HierState
from kvspec.spec.radix_cache import Key

Slots = tuple[int, ...]


class HostPool:
    """The host tier: ``capacity`` slots, the lowest free handed out first, each holding a KV once written."""

    def __init__(self, capacity: int) -> None:
        self.held: list[int | None] = [None] * capacity
        self._free = list(range(capacity))

    def free_slots(self) -> int:
        return len(self._free)

    def take(self, count: int) -> Slots:
        self._free.sort()
        taken, self._free = self._free[:count], self._free[count:]
        for slot in taken:
            self.held[slot] = None  # nothing landed yet
        return tuple(taken)

    def give_back(self, slots: Slots) -> None:
        self._free += slots


class Node:
    __slots__ = ("key", "device", "device_kv", "host", "parent", "children", "last_use")

    def __init__(self, key: Key, parent: Node | None, last_use: int) -> None:
        self.key = key
        self.device: Slots | None = None  # the device slots, one a token; None off the device
        self.device_kv: Slots | None = None  # the KV those slots hold; None while a load fills them
        self.host: Slots | None = None  # the host pool's slots of the host copy; None without one
        self.parent = parent
        self.children: dict[object, Node] = {}
        self.last_use = last_use


class HierarchicalRadixCache:
    """A two-tier radix cache: device copies given by the caller, host copies in its own pool."""

    def __init__(self, host_capacity: int) -> None:
        self._root = Node((), None, 0)
        self._pool = HostPool(host_capacity)
        self._clock = itertools.count(1)
        self._writing: set[Node] = set()
        self._loading: set[Node] = set()

    # -- operations -----------------------------------------------------------------

    def match_prefix(self, key: Sequence[int]) -> tuple[tuple[int, ...], int]:
        path = self._walk(check_tokens(key, allow_empty=True))
        self._touch(path)
        on_device = self._device_run(path)
        values = tuple(slot for node in path[:on_device] for slot in node.device or ())
        return values, sum(len(node.key) for node in path[on_device:])

    def insert(self, key: Sequence[int], values: Sequence[int]) -> int:
        tokens, stored = check_tokens(key, allow_empty=True), check_tokens(values, allow_empty=True)
        if len(stored) != len(tokens):
            raise InvalidOperation(f"{len(stored)} values for a key of {len(tokens)} tokens")
        path = self._walk(tokens)
        on_device = self._device_run(path)
        walked = path[:on_device]
        self._touch(walked)
        present = depth = sum(len(node.key) for node in walked)
        given = []
        for node in path[on_device:]:  # held on the host alone: the caller's recomputed KV goes on the device
            node.device = node.device_kv = stored[depth : depth + len(node.key)]
            depth += len(node.key)
            given.append(node)
        if depth < len(tokens):
            parent = path[-1] if path else self._root
            leaf = Node(tokens[depth:], parent, 0)
            leaf.device = leaf.device_kv = stored[depth:]
            parent.children[tokens[depth]] = leaf
            given.append(leaf)
        if given:
            self._touch(given)
        return present

    def write_through(self, key: Sequence[int]) -> int:
        path = self._walk(check_tokens(key, allow_empty=True))
        targets = [node for node in path[: self._device_run(path)] if node.host is None]
        needed = sum(len(node.key) for node in targets)
        short = needed - self._pool.free_slots()
        if short > 0:
            host_alone = sum(len(node.key) for node in self._nodes() if node.device is None)
            if short > host_alone:
                raise OutOfBlocks(needed, self._pool.free_slots() + host_alone, "host slots")
            self.evict_host(short)
        for node in targets:
            node.host = self._pool.take(len(node.key))
            self._writing.add(node)
        return needed

    def finish_writes(self) -> int:
        landed = 0
        for node in self._writing:
            assert node.host is not None and node.device_kv is not None, "a write-through pins its device copy"
            for slot, kv in zip(node.host, node.device_kv, strict=False):  # one host slot a token
                self._pool.held[slot] = kv
            landed += len(node.key)
        self._writing.clear()
        return landed

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        check_count(num_tokens)
        freed: list[int] = []
        while len(freed) < num_tokens:
            leaves = [node for node in self._nodes() if self._evictable_from_device(node)]
            if not leaves:
                break
            node = self._cut_tail(min(leaves, key=lambda n: n.last_use), num_tokens - len(freed))
            freed += reversed(self._free_device_copy(node))
        return tuple(freed)

    def evict_host(self, num_tokens: int) -> int:
        check_count(num_tokens)
        dropped = 0
        while dropped < num_tokens:
            leaves = [node for node in self._nodes() if self._evictable_from_host(node)]
            if not leaves:
                break
            node = self._cut_tail(self._host_victim(leaves), num_tokens - dropped)
            dropped += self._drop_host_copy(node)
        return dropped

    def load_back(self, key: Sequence[int], values: Sequence[int]) -> int:
        tokens, slots = check_tokens(key, allow_empty=True), check_tokens(values, allow_empty=True)
        path = self._walk(tokens)
        hit = path[self._device_run(path) :]
        if len(slots) != sum(len(node.key) for node in hit):
            raise InvalidOperation(
                f"{len(slots)} device slots to load a host hit of {sum(len(n.key) for n in hit)} tokens"
            )
        offset = 0
        for node in hit:
            node.device, node.device_kv = slots[offset : offset + len(node.key)], None
            offset += len(node.key)
            self._loading.add(node)
        return len(slots)

    def finish_loads(self) -> int:
        landed = 0
        for node in self._loading:
            assert node.host is not None, "a load pins its host copy"
            node.device_kv = tuple(self._kv_on_host(slot) for slot in node.host)
            landed += len(node.key)
        self._loading.clear()
        return landed

    def snapshot(self) -> HierState:
        copies: dict[Key, Copies] = {}
        stack: list[tuple[Key, Node]] = [((), self._root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                path = prefix
                for i, token in enumerate(child.key):
                    path += (token,)
                    copies[path] = self._copies(child, i)
                stack.append((path, child))
        return HierState(copies)

    # -- internals -----------------------------------------------------------------

    def _copies(self, node: Node, i: int) -> Copies:
        return Copies(
            device=None if node.device is None else node.device[i],
            device_kv=None if node.device_kv is None else node.device_kv[i],
            host=node.host is not None,
            host_kv=None if node.host is None else self._pool.held[node.host[i]],
        )

    def _kv_on_host(self, slot: int) -> int:
        kv = self._pool.held[slot]
        assert kv is not None, "a host copy is loaded only once its write has landed"
        return kv

    def _walk(self, key: Key) -> list[Node]:
        """The nodes along the longest cached prefix of ``key``, the last split at its end."""
        node, depth, path = self._root, 0, []
        while depth < len(key) and (child := node.children.get(key[depth])) is not None:
            shared = next((i for i, (a, b) in enumerate(zip(child.key, key[depth:], strict=False)) if a != b), None)
            if shared is None:
                shared = min(len(child.key), len(key) - depth)
            if shared < len(child.key):
                child = self._split(child, shared)
            path.append(child)
            node, depth = child, depth + shared
        return path

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after ``at`` tokens, every field at the same place; the upper part takes its place."""
        parent = node.parent
        assert parent is not None, "the root is never split"
        upper = Node(node.key[:at], parent, node.last_use)
        upper.device, node.device = cut(node.device, at)
        upper.device_kv, node.device_kv = cut(node.device_kv, at)
        upper.host, node.host = cut(node.host, at)
        for transfer in (self._writing, self._loading):
            if node in transfer:
                transfer.add(upper)
        upper.children[node.key[at]] = node
        parent.children[node.key[0]] = upper
        node.key, node.parent = node.key[at:], upper
        return upper

    def _cut_tail(self, node: Node, wanted: int) -> Node:
        """``node``'s last ``wanted`` tokens as a node of their own (the whole node if it has no more)."""
        if wanted < len(node.key):
            self._split(node, len(node.key) - wanted)
        return node

    def _device_run(self, path: list[Node]) -> int:
        """How many leading nodes of ``path`` are on the device (the rest are held on the host alone)."""
        return next((i for i, node in enumerate(path) if node.device is None), len(path))

    def _evictable_from_device(self, node: Node) -> bool:
        on_device_below = any(child.device is not None for child in node.children.values())
        pinned = node in self._writing or node in self._loading
        return node.device is not None and not on_device_below and not pinned

    def _evictable_from_host(self, node: Node) -> bool:
        return node.device is None and node.host is not None and not node.children

    def _host_victim(self, leaves: list[Node]) -> Node:
        return min(leaves, key=lambda node: node.last_use)

    def _free_device_copy(self, node: Node) -> Slots:
        """Demote ``node`` to its host copy, or drop it if it has none; its device slots."""
        assert node.device is not None, "only a node on the device is evicted from it"
        freed = node.device
        if node.host is None:
            self._detach(node)
        node.device = node.device_kv = None
        return freed

    def _drop_host_copy(self, node: Node) -> int:
        assert node.host is not None, "only a node with a host copy is evicted from the host"
        self._pool.give_back(node.host)
        node.host = None
        self._detach(node)
        return len(node.key)

    def _detach(self, node: Node) -> None:
        assert node.parent is not None and not node.children, "only a leaf leaves the tree"
        del node.parent.children[node.key[0]]

    def _touch(self, path: list[Node]) -> None:
        now = next(self._clock)
        for node in path:
            node.last_use = now

    def _nodes(self) -> Iterator[Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def cut(slots: Slots | None, at: int) -> tuple[Slots | None, Slots | None]:
    return (None, None) if slots is None else (slots[:at], slots[at:])


def check_count(num_tokens: object) -> None:
    if type(num_tokens) is not int or num_tokens < 0:
        raise InvalidOperation(f"cannot evict {num_tokens!r} tokens")
