"""The reference tiered KV store: per-node tiers, a global directory, cascading demotion.

Each node keeps one record per block it holds (tier, contents, uses, last
use, pins, readiness, lease, ARC list) and one set of keys per tier; the
directory maps a key to the nodes holding it, so ``lookup`` and re-``put``
touch only the replicas.  Making room plans the whole cascade (which victim
moves where, with each ARC tier's target as the copy entering it would adapt
it) before moving anything, so an operation that runs out of room changes
nothing (but the ARC adaptation a refused put may make where the conventions
say so).  Every convention of ``StoreConventions`` is supported: the factory
``KVStore`` builds the reference's, ``with_conventions(c)`` another profile.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence

import attrs

from kvspec.spec.conventions import StoreConventions, StorePolicy
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.kv_store import Location, StoreState, Tokens
from kvspec.spec.kv_store_policies import STORE_POLICIES, ArcLists

REFERENCE = StoreConventions()


@attrs.define
class Block:
    tier: int
    tokens: Tokens
    uses: int
    last_use: int
    pins: int = 0
    ready: bool = True
    lease_until: float = 0.0
    frequent: bool = False  # ARC: used again since stored


@attrs.define
class Ghosts:
    """An ARC tier's ghost lists (oldest first) and the target size of its recent list."""

    recent: OrderedDict[Hashable, None] = attrs.field(factory=OrderedDict)
    frequent: OrderedDict[Hashable, None] = attrs.field(factory=OrderedDict)
    target: float = 0.0


class Tier:
    """One tier of one node: its keys kept sorted in policy order as copies come, go and are used.

    The order is a sort on a rank: (last use) for LRU, (uses, last use) for LFU, (used again, last use)
    for ARC -- recent copies first, then frequent ones.  A last use is a tick of the store's clock, so
    no two copies of a node share a rank.
    """

    def __init__(self, policy: StorePolicy) -> None:
        self.policy = policy
        self._entries: list[tuple[tuple[int, ...], Hashable]] = []
        self._ranks: dict[Hashable, tuple[int, ...]] = {}

    def rank(self, block: Block) -> tuple[int, ...]:
        if self.policy == "lfu":
            return block.uses, block.last_use
        return (int(block.frequent), block.last_use) if self.policy == "arc" else (block.last_use,)

    def add(self, key: Hashable, block: Block) -> None:
        rank = self._ranks[key] = self.rank(block)
        bisect.insort(self._entries, (rank, key))

    def discard(self, key: Hashable) -> None:
        rank = self._ranks.pop(key, None)
        if rank is not None:
            del self._entries[bisect.bisect_left(self._entries, (rank,))]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._ranks

    def __iter__(self) -> Iterator[Hashable]:
        return (key for _, key in self._entries)

    def lists(self) -> tuple[list[Hashable], list[Hashable]]:
        """ARC's recent and frequent lists, each least recently used first."""
        recent = [key for rank, key in self._entries if not rank[0]]
        return recent, [key for rank, key in self._entries[len(recent) :]]


class Node:
    def __init__(self, policies: Sequence[StorePolicy]) -> None:
        self.blocks: dict[Hashable, Block] = {}
        self.tiers = [Tier(policy) for policy in policies]
        self.ghosts = [Ghosts() for _ in policies]


class KVStore:
    def __init__(
        self,
        nodes: int,
        capacities: Sequence[int],
        policies: Sequence[StorePolicy],
        conventions: StoreConventions = REFERENCE,
    ) -> None:
        names = conventions.tiers
        if not isinstance(nodes, int) or nodes < 1 or (conventions.max_nodes and nodes > conventions.max_nodes):
            raise InvalidOperation(f"a store needs 1..{conventions.max_nodes or 'any'} nodes, got {nodes!r}")
        if len(capacities) != len(names) or any(not isinstance(c, int) or c < 1 for c in capacities):
            raise InvalidOperation(f"need a positive capacity for each tier {names}, got {tuple(capacities)!r}")
        supported = [p for p in conventions.policies if p in STORE_POLICIES]
        if len(policies) != len(names) or any(p not in supported for p in policies):
            raise InvalidOperation(f"need a policy from {tuple(supported)} for each tier, got {tuple(policies)!r}")
        self.capacities = tuple(capacities)
        self.policies = tuple(policies)
        self.conventions = conventions
        self._nodes: list[Node | None] = [Node(self.policies) for _ in range(nodes)]
        self._directory: dict[Hashable, set[int]] = {}
        self._clock = 0
        self._now = 0.0

    # -- policy order -------------------------------------------------------------------

    def _order(self, node: Node, tier: int, target: float | None = None) -> list[Hashable]:
        if self.conventions.victims == "engine":  # the evictor picks: no order to state, keys by repr
            return sorted(node.tiers[tier], key=repr)
        if self.policies[tier] != "arc":
            return list(node.tiers[tier])
        recent, frequent = node.tiers[tier].lists()
        bound = int(node.ghosts[tier].target if target is None else target)
        order = []
        while recent or frequent:
            order.append(recent.pop(0) if not frequent or (recent and len(recent) >= bound) else frequent.pop(0))
        return order

    def _free(self, block: Block) -> bool:
        return block.ready and not block.pins and block.lease_until <= self._now

    def _victim(self, node: Node, tier: int, target: float | None = None) -> Hashable | None:
        if self.policies[tier] != "arc":
            return next((key for key in node.tiers[tier] if self._free(node.blocks[key])), None)
        recent, frequent = node.tiers[tier].lists()
        bound = int(node.ghosts[tier].target if target is None else target)
        lists = [recent, frequent, recent] if len(recent) >= bound else [frequent, recent]
        return next((key for keys in lists for key in keys if self._free(node.blocks[key])), None)

    # -- ARC ghosts -----------------------------------------------------------------------

    def _adapted(self, node: Node, tier: int, key: Hashable) -> float:
        """The target of ``tier`` once ``key`` entered it (a ghost hit adapts it)."""
        ghosts = node.ghosts[tier]
        if self.policies[tier] != "arc":
            return ghosts.target
        if key in ghosts.recent:
            return min(ghosts.target + max(1.0, len(ghosts.frequent) / len(ghosts.recent)), self.capacities[tier])
        if key in ghosts.frequent:
            return max(ghosts.target - max(1.0, len(ghosts.recent) / len(ghosts.frequent)), 0.0)
        return ghosts.target

    def _enter(self, node: Node, tier: int, key: Hashable) -> None:
        ghosts = node.ghosts[tier]
        ghosts.target = self._adapted(node, tier, key)
        for memory in (ghosts.recent, ghosts.frequent):
            if key in memory:
                memory.move_to_end(key)

    def _leave(self, node: Node, tier: int, key: Hashable) -> None:
        if self.policies[tier] == "arc":
            ghosts = node.ghosts[tier]
            memory = ghosts.frequent if node.blocks[key].frequent else ghosts.recent
            memory[key] = None
            memory.move_to_end(key)
            while len(memory) > self.capacities[tier]:
                memory.popitem(last=False)

    def _admit(self, node: Node, tier: int, key: Hashable) -> None:
        node.ghosts[tier].recent.pop(key, None)
        node.ghosts[tier].frequent.pop(key, None)

    # -- making room ------------------------------------------------------------------------

    def _node(self, node: object) -> Node:
        if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(self._nodes):
            raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(self._nodes) - 1})")
        state = self._nodes[node]
        if state is None:
            raise InvalidOperation(f"node {node} has failed; restart it first")
        return state

    def _room_plan(self, node: Node, tier: int, entering: Hashable) -> list[tuple[Hashable, int]]:
        """The (victim, tier it leaves) moves, top down, that make room in ``tier`` for ``entering``."""
        plan: list[tuple[Hashable, int]] = []
        while tier < len(self.capacities) and len(node.tiers[tier]) >= self.capacities[tier]:
            victim = None
            if self.conventions.eviction == "on_demand":
                victim = self._victim(node, tier, self._adapted(node, tier, entering))
            if victim is None:
                raise OutOfBlocks(1, 0, what=f"free slots in the {self.conventions.tiers[tier]} tier")
            plan.append((victim, tier))
            entering, tier = victim, tier + 1
        return plan

    def _apply(self, index: int, node: Node, plan: list[tuple[Hashable, int]], entering: Hashable, tier: int) -> None:
        """Run ``plan`` (``_room_plan(node, tier, entering)``): every tier entered adapts, every victim becomes a
        ghost of the tier it leaves, then the moves run bottom first, so each lands in a freed slot."""
        for key, level in [(entering, tier), *((victim, level + 1) for victim, level in plan)]:
            if level < len(self.capacities):
                self._enter(node, level, key)
        for victim, level in plan:
            self._leave(node, level, victim)
        for victim, level in reversed(plan):
            if level + 1 == len(self.capacities):
                self._drop(index, node, victim)
            else:
                self._move(node, victim, level + 1)

    def _move(self, node: Node, key: Hashable, tier: int) -> None:
        block = node.blocks[key]
        node.tiers[block.tier].discard(key)
        block.tier = tier
        node.tiers[tier].add(key, block)
        self._admit(node, tier, key)

    def _drop(self, index: int, node: Node, key: Hashable) -> None:
        block = node.blocks.pop(key)
        node.tiers[block.tier].discard(key)
        holders = self._directory[key]
        holders.discard(index)
        if not holders:
            del self._directory[key]

    def _insert(self, index: int, node: Node, key: Hashable, block: Block) -> None:
        node.blocks[key] = block
        node.tiers[block.tier].add(key, block)
        self._directory.setdefault(key, set()).add(index)
        self._admit(node, block.tier, key)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _use(self, node: Node, key: Hashable) -> None:
        block, tier = node.blocks[key], node.tiers[node.blocks[key].tier]
        in_tier = key in tier  # a copy being promoted is out of every tier for the while
        tier.discard(key)
        block.uses, block.last_use, block.frequent = block.uses + 1, self._tick(), True
        if in_tier:
            tier.add(key, block)

    def _in_use(self, block: Block) -> bool:
        return not self._free(block)

    # -- operations ---------------------------------------------------------------------------

    def _writable(
        self, node: int, key: Hashable, tokens: Sequence[int]
    ) -> tuple[Node, Tokens, list[tuple[int, Block]]]:
        """A put's node, contents and the key's replicas, once its arguments are checked."""
        here = self._node(node)
        if key is None:
            raise InvalidOperation("None is not a block key")
        contents = tuple(tokens)
        if not contents or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in contents):
            raise InvalidOperation(f"a block's contents are one or more token ids, got {contents!r}")
        return here, contents, [(n, self._node(n).blocks[key]) for n in sorted(self._directory.get(key, ()))]

    def _check_not_in_flight(self, key: Hashable, contents: Tokens, replicas: list[tuple[int, Block]]) -> None:
        in_flight = [n for n, block in replicas if self._in_use(block) and block.tokens != contents]
        if in_flight:
            raise InvalidOperation(f"block {key!r} is in flight on node(s) {in_flight}: re-put it after the transfer")

    def put(self, node: int, key: Hashable, tokens: Sequence[int]) -> None:
        with self._refusal_adapts(node, key):
            self._put(node, key, tokens)

    @contextlib.contextmanager
    def _refusal_adapts(self, node: int, key: Hashable) -> Iterator[None]:
        """Where the conventions say so (``refusal_adapts_policy``), a put refused for want of room has still shown
        the writer's first tier a store miss of ``key``: an ARC tier adapts to its ghost."""
        try:
            yield
        except OutOfBlocks:
            here = self._node(node)
            if self.conventions.refusal_adapts_policy and key not in here.blocks:
                self._enter(here, 0, key)
            raise

    def _put(self, node: int, key: Hashable, tokens: Sequence[int]) -> None:
        here, contents, replicas = self._writable(node, key, tokens)
        if replicas and self.conventions.reput != "refresh":
            mine = here.blocks.get(key)
            if self.conventions.reput == "touch" and mine is not None and mine.ready:
                self._use(here, key)
            return
        self._check_not_in_flight(key, contents, replicas)
        mine = here.blocks.get(key)
        if mine is None:
            plan = self._room_plan(here, 0, key)
            self._write_replicas(node, replicas, contents)
            self._apply(node, here, plan, key, 0)
            ready = self.conventions.stores == "immediate"
            block = Block(tier=0, tokens=contents, uses=1, last_use=self._tick(), ready=ready)
            self._insert(node, here, key, self._leased_from_the_start(block))
            return
        if self._promotable(mine) and not self._promote(node, here, key):
            raise OutOfBlocks(1, 0, what=f"free slots in node {node}'s {self.conventions.tiers[0]} tier")
        self._write_replicas(node, replicas, contents)
        self._use(here, key)

    def put_replicated(self, node: int, key: Hashable, tokens: Sequence[int], factor: int) -> tuple[int, ...]:
        """A put on ``node``, then fresh copies on the next live nodes in ring order until ``factor`` distinct
        nodes hold the key; every target's room is planned before anything is written."""
        with self._refusal_adapts(node, key):
            return self._put_replicated(node, key, tokens, factor)

    def _put_replicated(self, node: int, key: Hashable, tokens: Sequence[int], factor: int) -> tuple[int, ...]:
        self._node(node)
        live = [(node + step) % len(self._nodes) for step in range(len(self._nodes))]
        live = [n for n in live if self._nodes[n] is not None]
        if not isinstance(factor, int) or isinstance(factor, bool) or not 1 <= factor <= len(live):
            raise InvalidOperation(f"a put cannot place {factor!r} replicas on distinct nodes: {len(live)} are live")
        _, contents, replicas = self._writable(node, key, tokens)
        if replicas and self.conventions.reput != "refresh":
            self._put(node, key, contents)
            return tuple(sorted(self._directory[key]))
        self._check_not_in_flight(key, contents, replicas)
        targets = [n for n in self._replica_targets(live, factor) if n != node and key not in self._node(n).blocks]
        plans = [(n, self._room_plan(self._node(n), 0, key)) for n in targets]
        self._put(node, key, contents)
        for target, plan in plans:
            there = self._node(target)
            self._apply(target, there, plan, key, 0)
            block = Block(
                tier=0, tokens=contents, uses=1, last_use=self._tick(), ready=self.conventions.stores == "immediate"
            )
            self._insert(target, there, key, self._leased_from_the_start(block))
        return tuple(sorted(self._directory[key]))

    def _replica_targets(self, ring: list[int], factor: int) -> list[int]:
        """The nodes after the writer (``ring[0]``) that complete ``factor`` replicas."""
        return ring[1:factor]

    def _write_replicas(self, writer: int, replicas: list[tuple[int, Block]], contents: Tokens) -> None:
        for _, block in replicas:
            block.tokens = contents

    def _promotable(self, block: Block) -> bool:
        return block.tier != 0 and self.conventions.promotion and not self._in_use(block)

    def _promote(self, index: int, node: Node, key: Hashable) -> bool:
        """Move ``key`` to the first tier; False (and nothing moved) if no room can be made."""
        block = node.blocks[key]
        node.tiers[block.tier].discard(key)  # out of its tier first: its slot is the cascade's to use
        try:
            plan = self._room_plan(node, 0, key)
        except OutOfBlocks:
            node.tiers[block.tier].add(key, block)
            return False
        self._apply(index, node, plan, key, 0)
        block.tier = 0
        node.tiers[0].add(key, block)
        self._admit(node, 0, key)
        return True

    def get(self, node: int, key: Hashable) -> Tokens | None:
        here = self._node(node)
        block = here.blocks.get(key)
        if block is None or not block.ready:
            return None
        self._use(here, key)
        if self._promotable(block):
            self._promote(node, here, key)
        if self.conventions.read_lease:
            block.lease_until = max(block.lease_until, self._now + self.conventions.read_lease)
        return block.tokens

    def demote(self, node: int, tier: int) -> Hashable | None:
        here = self._node(node)
        self._check_tier(tier)
        if tier == len(self.capacities) - 1:
            raise InvalidOperation(f"{self.conventions.tiers[tier]} is the last tier: evict from it instead")
        victim = self._victim(here, tier)
        if victim is None:
            return None
        plan = self._room_plan(here, tier + 1, victim)
        self._leave(here, tier, victim)
        self._apply(node, here, plan, victim, tier + 1)
        self._move(here, victim, tier + 1)
        return victim

    def evict(self, node: int, tier: int) -> Hashable | None:
        here = self._node(node)
        self._check_tier(tier)
        victim = self._victim(here, tier)
        if victim is not None:
            self._leave(here, tier, victim)
            self._drop(node, here, victim)
        return victim

    def replicate(self, key: Hashable, source: int, target: int) -> None:
        origin, there = self._node(source), self._node(target)
        if key not in origin.blocks:
            raise InvalidOperation(f"node {source} holds no block {key!r}")
        if not origin.blocks[key].ready:
            raise InvalidOperation(f"block {key!r} on node {source} is still being stored")
        if key in there.blocks:
            raise InvalidOperation(f"node {target} already holds block {key!r}")
        plan = self._room_plan(there, 0, key)
        self._apply(target, there, plan, key, 0)
        block = Block(tier=0, tokens=origin.blocks[key].tokens, uses=1, last_use=self._tick())
        self._insert(target, there, key, self._leased_from_the_start(block))

    def _leased_from_the_start(self, block: Block) -> Block:
        if self.conventions.leases_new_copies:
            block.lease_until = self._now + self.conventions.read_lease
        return block

    def pin(self, node: int, key: Hashable) -> None:
        block = self._held(node, key)
        if not block.ready:
            raise InvalidOperation(f"block {key!r} on node {node} is still being stored: nothing to transfer yet")
        block.pins += 1

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
        self._nodes[node] = Node(self.policies)

    def lookup(self, key: Hashable) -> tuple[Location, ...]:
        return tuple(sorted((n, self._tier_of(n, key)) for n in self._directory.get(key, ())))

    def find(self, node: int, key: Hashable) -> str:
        block = self._node(node).blocks.get(key)
        return "miss" if block is None else ("hit" if block.ready else "pending")

    def complete(self, node: int, key: Hashable, ok: bool) -> None:
        here = self._node(node)
        if not isinstance(ok, bool):
            raise InvalidOperation(f"a store completes ok (True) or failed (False), not {ok!r}")
        block = here.blocks.get(key)
        if block is None or block.ready:
            return
        if ok:
            block.ready = True
        else:
            self._drop(node, here, key)

    def remove(self, node: int, key: Hashable) -> None:
        block = self._held(node, key)
        if self._in_use(block):
            raise InvalidOperation(f"block {key!r} on node {node} is in use (pinned, leased or being stored)")
        self._drop(node, self._node(node), key)

    def advance(self, seconds: float) -> None:
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not 0 <= seconds < math.inf:
            raise InvalidOperation(f"time advances by a finite, non-negative number of seconds, not {seconds!r}")
        self._now += seconds

    def settle(self) -> tuple[tuple[int, Hashable], ...]:
        """The background evictor's work, done: each tier at its watermark, last tier first, gives up victims
        (down a tier that has room, or out of the last) until it is below the watermark."""
        if self.conventions.eviction == "on_demand":
            return ()
        dropped: list[tuple[int, Hashable]] = []
        for index, node in enumerate(self._nodes):
            for tier in reversed(range(len(self.capacities))):
                if node is not None:
                    self._drain(index, node, tier, dropped)
        return tuple(sorted(dropped, key=repr))

    def _drain(self, index: int, node: Node, tier: int, dropped: list[tuple[int, Hashable]]) -> None:
        mark = max(1, math.ceil(self.conventions.watermark * self.capacities[tier]))
        last = tier == len(self.capacities) - 1
        while len(node.tiers[tier]) >= mark and (last or len(node.tiers[tier + 1]) < self.capacities[tier + 1]):
            victim = self._victim(node, tier)
            if victim is None:
                return
            self._leave(node, tier, victim)
            if last:
                self._drop(index, node, victim)
                dropped.append((index, victim))
            else:
                self._enter(node, tier + 1, victim)
                self._move(node, victim, tier + 1)

    # -- reading -------------------------------------------------------------------------------

    def _tier_of(self, node: int, key: Hashable) -> int:
        return self._node(node).blocks[key].tier

    def _held(self, node: int, key: Hashable) -> Block:
        block = self._node(node).blocks.get(key)
        if block is None:
            raise InvalidOperation(f"node {node} holds no block {key!r}")
        return block

    def _check_tier(self, tier: object) -> None:
        names = self.conventions.tiers
        if not isinstance(tier, int) or isinstance(tier, bool) or not 0 <= tier < len(names):
            raise InvalidOperation(f"tier {tier!r} is not a tier (0..{len(names) - 1}: {', '.join(names)})")

    def _arc_lists(self, node: Node, tier: int) -> ArcLists:
        recent, frequent = node.tiers[tier].lists()
        ghosts = node.ghosts[tier]
        return ArcLists(
            recent=tuple(recent),
            frequent=tuple(frequent),
            recent_ghosts=tuple(ghosts.recent),
            frequent_ghosts=tuple(ghosts.frequent),
            target=ghosts.target,
        )

    def snapshot(self) -> StoreState:
        live = [(index, node) for index, node in enumerate(self._nodes) if node is not None]
        blocks = [((index, key), block) for index, node in live for key, block in node.blocks.items()]
        tiers = range(len(self.capacities))
        return StoreState(
            capacities=self.capacities,
            alive=tuple(node is not None for node in self._nodes),
            tiers=tuple(
                tuple(tuple(self._order(node, tier)) for tier in tiers) if node else ((),) * len(tiers)
                for node in self._nodes
            ),
            contents={place: block.tokens for place, block in blocks},
            pins={place: block.pins for place, block in blocks if block.pins},
            directory={
                key: tuple(sorted((n, self._tier_of(n, key)) for n in holders))
                for key, holders in self._directory.items()
            },
            names=self.conventions.tiers,
            pending=frozenset(place for place, block in blocks if not block.ready),
            leases={place: block.lease_until for place, block in blocks if block.lease_until > self._now},
            arc={
                (index, tier): self._arc_lists(node, tier)
                for index, node in live
                for tier in tiers
                if self.policies[tier] == "arc"
            },
        )


def with_conventions(conventions: StoreConventions) -> Callable[..., KVStore]:
    """The reference store's factory under another profile of conventions."""
    return functools.partial(KVStore, conventions=conventions)
