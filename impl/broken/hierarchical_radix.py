"""Broken hierarchical radix caches: each breaks a rule of ``kvspec.spec.hierarchical_radix`` and declares what
catches it.

Every member is an ``Implementation`` whose ``hierarchical_radix_cache`` (an extension: ``Implementation`` has no
field for it) is a small subclass of the reference; each is a mistake in a code path of SGLang's
``HiRadixCache`` (``python/sglang/srt/mem_cache/hiradix_cache.py``) that its own checks do not stop.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.impl.broken import members
from kvspec.impl.hierarchical_radix import HierarchicalRadixCache, Node, Slots
from kvspec.spec import hierarchical_radix as spec
from kvspec.spec.block_manager import check_tokens

# A member: its hierarchical radix cache, and the rules that catch it there.
hicache = members(spec.HIERARCHICAL_RADIX_CACHE.name, "hierarchical radix cache (HiCache)")


class EvictsWhileWriting(HierarchicalRadixCache):
    """Device eviction ignores writes in flight: SGLang pins a node it writes through with ``inc_lock_ref`` in
    ``write_backup`` (not under write-back, which evicts only after ``writing_check``); an engine that takes the
    write-back branch's "no need to lock" under write-through frees the slot the host copy is still read from."""

    def _evictable_from_device(self, node: Node) -> bool:
        on_device_below = any(child.device is not None for child in node.children.values())
        return node.device is not None and not on_device_below and node not in self._loading

    def finish_writes(self) -> int:
        for node in self._writing:  # its device slots were freed: what lands is whatever they hold now
            node.device_kv = node.device_kv or tuple(-1 for _ in node.key)
        return super().finish_writes()


evicts_while_writing = hicache(
    "device eviction frees a slot its write-through still reads",
    EvictsWhileWriting,
    spec.invariant_hicache_write_through_pins_device,
)


class ReclaimsHostPoolFromTheFront(HierarchicalRadixCache):
    """Host eviction reclaims the host copy in the lowest host slots, as a host pool run as a ring does, whatever
    the tree says: a parent is backed up before its children (``write_backup`` waits for the parent to be
    ``backuped``), so that is often an internal node's copy, and its children are left under a node with none."""

    def _evictable_from_host(self, node: Node) -> bool:
        return node.device is None and node.host is not None

    def _host_victim(self, leaves: list[Node]) -> Node:
        return min(leaves, key=lambda node: min(node.host or (0,)))

    def _drop_host_copy(self, node: Node) -> int:
        if not node.children:
            return super()._drop_host_copy(node)
        assert node.host is not None, "only a node with a host copy is evicted from the host"
        self._pool.give_back(node.host)
        node.host = None  # the children stay, under a node that holds nothing
        return len(node.key)


host_evicts_internal_nodes = hicache(
    "host eviction reclaims the front of its pool, an internal node's copy",
    ReclaimsHostPoolFromTheFront,
    spec.invariant_hicache_every_token_readable,
)


class TakesLoadingNodesForHostOnly(HierarchicalRadixCache):
    """Tells "held on the host alone" by the device KV having landed (SGLang's ``evicted`` is ``value is None``,
    and ``load_back`` sets ``value`` at once; an engine that sets it when the load lands gets this): a node whose
    load is in flight looks host-only, and host eviction frees the host copy the load is reading."""

    def _evictable_from_host(self, node: Node) -> bool:
        return node.device_kv is None and node.host is not None and not node.children

    def _drop_host_copy(self, node: Node) -> int:
        self._loading.discard(node)
        return super()._drop_host_copy(node)


host_evicts_loading_nodes = hicache(
    "host eviction frees the copy a load is reading",
    TakesLoadingNodesForHostOnly,
    spec.invariant_hicache_host_evicts_only_leaves,
)


class HostEvictsMostRecentlyUsed(HierarchicalRadixCache):
    """A legal choice kvspec does not model: the host tier gives up its most recently used leaf first (SGLang's
    ``mru`` eviction policy, whose heap orders host leaves too).  Only which host-only leaf goes differs from the
    model's -- never a copy in use, a token with a device copy, or one a cached token extends -- and
    ``evict_host`` answers only how many went: the cache's state shows it (a convention finding)."""

    def _host_victim(self, leaves: list[Node]) -> Node:
        return max(leaves, key=lambda node: node.last_use)


host_evicts_most_recently_used = hicache(
    "a legal choice: the host tier evicts its most recently used leaf first",
    HostEvictsMostRecentlyUsed,
    spec.invariant_hicache_refines_spec,
)


class ServesStaleDeviceSlots(HierarchicalRadixCache):
    """Demotion frees a node's device slots but the node keeps them (``_evict_backuped`` without
    ``node.value = None``), and a match answers them: a host hit served from freed slots, never loaded back."""

    def __init__(self, host_capacity: int) -> None:
        super().__init__(host_capacity)
        self._stale: dict[Node, Slots] = {}

    def _free_device_copy(self, node: Node) -> Slots:
        freed = super()._free_device_copy(node)
        self._stale[node] = freed
        return freed

    def match_prefix(self, key: Sequence[int]) -> tuple[tuple[int, ...], int]:
        path = self._walk(check_tokens(key, allow_empty=True))
        self._touch(path)
        values: list[int] = []
        for node in path:
            slots = node.device or self._stale.get(node)
            if slots is None or len(slots) != len(node.key):
                break
            values += slots
        return tuple(values), 0


serves_host_hit_without_load_back = hicache(
    "a host hit served from freed device slots, without load-back",
    ServesStaleDeviceSlots,
    spec.invariant_hicache_hit_read_from_device,
)


class SplitKeepsWholeHostCopyBelow(HierarchicalRadixCache):
    """A split gives the upper half its share of the host copy but leaves the lower half the whole of it (SGLang's
    ``_split_node`` taking ``new_node.host_value = child.host_value[:split_len]`` without trimming
    ``child.host_value``): the lower half's tokens read the upper half's host slots, and a write landing into
    them overwrites the upper half's KV."""

    def _split(self, node: Node, at: int) -> Node:
        host = node.host
        upper = super()._split(node, at)
        node.host = host
        return upper


split_leaves_host_copy_on_wrong_half = hicache(
    "a split leaves the whole host copy on the lower half",
    SplitKeepsWholeHostCopyBelow,
    spec.invariant_hicache_copies_hold_their_kv,
)
