"""The reference tiered KV store: per-node tiers, a global directory, cascading demotion.

Each node keeps one record per block it holds (tier, contents, uses, last
use, pins) and one set of keys per tier; the directory maps a key to the
nodes holding it, so ``lookup`` and re-``put`` touch only the replicas.
Making room plans the whole cascade (which victim moves where) before moving
anything, so an operation that runs out of room changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs

from kvspec.spec.block_pool import POLICIES, Policy
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.kv_store import TIERS, Location, StoreState, Tokens


@attrs.define
class Block:
    tier: int
    tokens: Tokens
    uses: int
    last_use: int
    pins: int = 0


class Node:
    def __init__(self) -> None:
        self.blocks: dict[Hashable, Block] = {}
        self.tiers: list[set[Hashable]] = [set() for _ in TIERS]


class KVStore:
    def __init__(self, nodes: int, capacities: Sequence[int], policies: Sequence[Policy]) -> None:
        if not isinstance(nodes, int) or nodes < 1:
            raise InvalidOperation(f"a store needs a positive number of nodes, got {nodes!r}")
        if len(capacities) != len(TIERS) or any(not isinstance(c, int) or c < 1 for c in capacities):
            raise InvalidOperation(f"need a positive capacity for each tier {TIERS}, got {tuple(capacities)!r}")
        if len(policies) != len(TIERS) or any(p not in POLICIES for p in policies):
            raise InvalidOperation(f"need a policy from {POLICIES} for each tier, got {tuple(policies)!r}")
        self.capacities = tuple(capacities)
        self.policies = tuple(policies)
        self._nodes: list[Node | None] = [Node() for _ in range(nodes)]
        self._directory: dict[Hashable, set[int]] = {}
        self._clock = 0

    # -- helpers ------------------------------------------------------------------

    def _node(self, node: object) -> Node:
        if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(self._nodes):
            raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(self._nodes) - 1})")
        state = self._nodes[node]
        if state is None:
            raise InvalidOperation(f"node {node} has failed; restart it first")
        return state

    def _order(self, node: Node, tier: int) -> list[Hashable]:
        if self.policies[tier] == "lru":
            return sorted(node.tiers[tier], key=lambda key: node.blocks[key].last_use)
        return sorted(node.tiers[tier], key=lambda key: (node.blocks[key].uses, node.blocks[key].last_use))

    def _victim(self, node: Node, tier: int) -> Hashable | None:
        return next((key for key in self._order(node, tier) if node.blocks[key].pins == 0), None)

    def _room_plan(self, node: Node, tier: int) -> list[tuple[Hashable, int]]:
        """The (victim, from tier) moves, top down, that free one slot of ``tier``."""
        plan: list[tuple[Hashable, int]] = []
        while tier < len(TIERS) and len(node.tiers[tier]) >= self.capacities[tier]:
            victim = self._victim(node, tier)
            if victim is None:
                raise OutOfBlocks(1, 0, what=f"unpinned slots in the {TIERS[tier]} tier")
            plan.append((victim, tier))
            tier += 1
        return plan

    def _apply(self, index: int, node: Node, plan: list[tuple[Hashable, int]]) -> None:
        for victim, tier in reversed(plan):  # bottom first, so each move lands in a freed slot
            if tier + 1 == len(TIERS):
                self._drop(index, node, victim)
            else:
                block = node.blocks[victim]
                node.tiers[tier].discard(victim)
                node.tiers[tier + 1].add(victim)
                block.tier = tier + 1

    def _drop(self, index: int, node: Node, key: Hashable) -> None:
        block = node.blocks.pop(key)
        node.tiers[block.tier].discard(key)
        holders = self._directory[key]
        holders.discard(index)
        if not holders:
            del self._directory[key]

    def _insert(self, index: int, node: Node, key: Hashable, block: Block) -> None:
        node.blocks[key] = block
        node.tiers[block.tier].add(key)
        self._directory.setdefault(key, set()).add(index)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- operations ------------------------------------------------------------------

    def put(self, node: int, key: Hashable, tokens: Sequence[int]) -> None:
        here = self._node(node)
        if key is None:
            raise InvalidOperation("None is not a block key")
        contents = tuple(tokens)
        if not contents or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in contents):
            raise InvalidOperation(f"a block's contents are one or more token ids, got {contents!r}")
        replicas = [(n, self._node(n).blocks[key]) for n in sorted(self._directory.get(key, ()))]
        pinned = [n for n, block in replicas if block.pins and block.tokens != contents]
        if pinned:
            raise InvalidOperation(f"block {key!r} is in flight on node(s) {pinned}: re-put it after the transfer")
        mine = here.blocks.get(key)
        if mine is None:
            plan = self._room_plan(here, 0)
            self._write_replicas(node, replicas, contents)
            self._apply(node, here, plan)
            self._insert(node, here, key, Block(tier=0, tokens=contents, uses=1, last_use=self._tick()))
            return
        if not mine.pins and mine.tier != 0 and not self._promote(node, here, key):
            raise OutOfBlocks(1, 0, what=f"unpinned slots in node {node}'s {TIERS[0]} tier")
        self._write_replicas(node, replicas, contents)
        mine.uses, mine.last_use = mine.uses + 1, self._tick()

    def _write_replicas(self, writer: int, replicas: list[tuple[int, Block]], contents: Tokens) -> None:
        for _, block in replicas:
            block.tokens = contents

    def _promote(self, index: int, node: Node, key: Hashable) -> bool:
        """Move ``key`` to the GPU tier; False (and nothing moved) if no room can be made."""
        block = node.blocks[key]
        node.tiers[block.tier].discard(key)  # out of its tier first: its slot is the cascade's to use
        try:
            plan = self._room_plan(node, 0)
        except OutOfBlocks:
            node.tiers[block.tier].add(key)
            return False
        self._apply(index, node, plan)
        block.tier = 0
        node.tiers[0].add(key)
        return True

    def get(self, node: int, key: Hashable) -> Tokens | None:
        here = self._node(node)
        block = here.blocks.get(key)
        if block is None:
            return None
        block.uses, block.last_use = block.uses + 1, self._tick()
        if not block.pins and block.tier != 0:
            self._promote(node, here, key)
        return block.tokens

    def demote(self, node: int, tier: int) -> Hashable | None:
        here = self._node(node)
        self._check_tier(tier)
        if tier == len(TIERS) - 1:
            raise InvalidOperation(f"{TIERS[tier]} is the last tier: evict from it instead")
        victim = self._victim(here, tier)
        if victim is None:
            return None
        self._apply(node, here, [(victim, tier), *self._room_plan(here, tier + 1)])
        return victim

    def evict(self, node: int, tier: int) -> Hashable | None:
        here = self._node(node)
        self._check_tier(tier)
        victim = self._victim(here, tier)
        if victim is not None:
            self._drop(node, here, victim)
        return victim

    def replicate(self, key: Hashable, source: int, target: int) -> None:
        origin, there = self._node(source), self._node(target)
        if key not in origin.blocks:
            raise InvalidOperation(f"node {source} holds no block {key!r}")
        if key in there.blocks:
            raise InvalidOperation(f"node {target} already holds block {key!r}")
        plan = self._room_plan(there, 0)
        self._apply(target, there, plan)
        self._insert(target, there, key, Block(tier=0, tokens=origin.blocks[key].tokens, uses=1, last_use=self._tick()))

    def pin(self, node: int, key: Hashable) -> None:
        self._held(node, key).pins += 1

    def unpin(self, node: int, key: Hashable) -> None:
        block = self._held(node, key)
        if block.pins == 0:
            raise InvalidOperation(f"block {key!r} on node {node} is not pinned")
        block.pins -= 1

    def fail(self, node: int) -> None:
        here = self._node(node)
        for key in list(here.blocks):
            self._drop(node, here, key)
        self._nodes[node] = None

    def restart(self, node: int) -> None:
        if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(self._nodes):
            raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(self._nodes) - 1})")
        if self._nodes[node] is not None:
            raise InvalidOperation(f"node {node} is alive: only a failed node restarts")
        self._nodes[node] = Node()

    def lookup(self, key: Hashable) -> tuple[Location, ...]:
        return tuple(sorted((n, self._tier_of(n, key)) for n in self._directory.get(key, ())))

    def _tier_of(self, node: int, key: Hashable) -> int:
        return self._node(node).blocks[key].tier

    def _held(self, node: int, key: Hashable) -> Block:
        block = self._node(node).blocks.get(key)
        if block is None:
            raise InvalidOperation(f"node {node} holds no block {key!r}")
        return block

    @staticmethod
    def _check_tier(tier: object) -> None:
        if not isinstance(tier, int) or isinstance(tier, bool) or not 0 <= tier < len(TIERS):
            raise InvalidOperation(f"tier {tier!r} is not a tier (0..{len(TIERS) - 1}: {', '.join(TIERS)})")

    def snapshot(self) -> StoreState:
        live = [(index, node) for index, node in enumerate(self._nodes) if node is not None]
        return StoreState(
            capacities=self.capacities,
            alive=tuple(node is not None for node in self._nodes),
            tiers=tuple(
                tuple(tuple(self._order(node, tier)) for tier in range(len(TIERS))) if node else ((),) * len(TIERS)
                for node in self._nodes
            ),
            contents={(index, key): block.tokens for index, node in live for key, block in node.blocks.items()},
            pins={(index, key): b.pins for index, node in live for key, b in node.blocks.items() if b.pins},
            directory={
                key: tuple(sorted((n, self._tier_of(n, key)) for n in holders))
                for key, holders in self._directory.items()
            },
        )
