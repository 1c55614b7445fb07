"""Broken tiered stores: each breaks one rule of ``kvspec.spec.kv_store`` and must be caught.

Every factory returns an ``Implementation`` whose store is a one-method
subclass of the reference; ``properties/meta/test_teeth_kv_store.py`` names
the invariant that catches each.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.broken import caught_by
from kvspec.impl.kv_store import Block, KVStore, Node
from kvspec.spec import kv_store as store_spec
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.kv_store import TIERS, Tokens


class DemotionDropsTheBlock(KVStore):
    """``demote`` forgets the victim instead of moving it down."""

    def demote(self, node: int, tier: int) -> Hashable | None:
        here = self._node(node)
        victim = super().demote(node, tier)
        if victim is not None:
            self._drop(node, here, victim)
        return victim


class EvictsPinnedBlocks(KVStore):
    """Victims are taken in policy order whether a transfer has them pinned or not."""

    def _victim(self, node: Node, tier: int) -> Hashable | None:
        return next(iter(self._order(node, tier)), None)


class StaleReplicaAfterReput(KVStore):
    """A re-put rewrites only the writer's copy; other nodes keep the old tokens."""

    def _write_replicas(self, writer: int, replicas: list[tuple[int, Block]], contents: Tokens) -> None:
        super()._write_replicas(writer, [(n, block) for n, block in replicas if n == writer], contents)


class CapacityPerNode(KVStore):
    """Counts a node's blocks against the node's total, so one tier fills past its size."""

    def _room_plan(self, node: Node, tier: int) -> list[tuple[Hashable, int]]:
        if len(node.blocks) < sum(self.capacities):
            return []
        victim = self._victim(node, len(TIERS) - 1)
        if victim is None:
            raise OutOfBlocks(1, 0, what="unpinned slots on the node")
        return [(victim, len(TIERS) - 1)]


class LookupNamesDeadNode(KVStore):
    """A node fault silences the node but leaves its directory entries behind."""

    def fail(self, node: int) -> None:
        self._ghosts = {**getattr(self, "_ghosts", {}), node: self._node(node)}
        self._nodes[node] = None

    def _tier_of(self, node: int, key: Hashable) -> int:
        return (self._nodes[node] or self._ghosts[node]).blocks[key].tier


def _with_store(name: str, store: type[KVStore]) -> Implementation:
    return Implementation(name=name, block_pool=BlockPool, kv_store=store)


@caught_by(store_spec.invariant_demotion_keeps_the_block, "tiered KV store (node faults)")
def demotion_drops_the_block() -> Implementation:
    return _with_store("broken: demotion drops the block", DemotionDropsTheBlock)


@caught_by(store_spec.invariant_pinned_never_evicted, "tiered KV store (node faults)")
def evicts_pinned_blocks() -> Implementation:
    return _with_store("broken: evicts pinned blocks", EvictsPinnedBlocks)


@caught_by(store_spec.invariant_replicas_agree, "tiered KV store (node faults)")
def stale_replica_after_reput() -> Implementation:
    return _with_store("broken: stale replica after re-put", StaleReplicaAfterReput)


@caught_by(store_spec.invariant_tier_capacity, "tiered KV store (node faults)")
def capacity_per_node() -> Implementation:
    return _with_store("broken: capacity counted per node", CapacityPerNode)


@caught_by(store_spec.invariant_lookup_names_live_holders, "tiered KV store (node faults)")
def lookup_names_dead_node() -> Implementation:
    return _with_store("broken: lookups keep naming a failed node", LookupNamesDeadNode)
