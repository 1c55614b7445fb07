"""Broken tiered stores: each breaks one rule of ``kvspec.spec.kv_store`` and must be caught.

Every member is an ``Implementation`` whose store is a one-method subclass
of the reference -- built, for the bugs of a convention's mechanism (pending
stores, read leases), under the profile it declares -- and names the
invariant that catches it; ``properties/meta/test_zoo.py`` runs each.  The
members named "a legal choice" make a choice kvspec does not model (or one they
do not declare): a convention rule finds them, and no safety rule may
(``properties/meta/test_no_false_safety.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence

import attrs

from kvspec.impl.broken import members
from kvspec.impl.kv_store import Block, KVStore, Node
from kvspec.spec import invariants
from kvspec.spec import kv_store as store_spec
from kvspec.spec import kv_store_placement as placement_spec
from kvspec.spec.conventions import Conventions, StoreConventions
from kvspec.spec.errors import OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import Invariant
from kvspec.spec.kv_store import TIERS, Tokens

PENDING = StoreConventions(stores="pending")
LEASES = StoreConventions(read_lease=60.0)
BACKGROUND = StoreConventions(eviction="background")
ONE_ARC_TIER = StoreConventions(tiers=("cpu",), policies=("arc",))  # where refusals are common

declare = members("kv_store", "tiered KV store (node faults)")  # a member: its store, and the rules that catch it


def store(
    name: str, component: type[KVStore], *rules: Invariant, built_under: StoreConventions | None = None
) -> Implementation:
    """The member ``broken: name`` whose store is ``component``, caught by each of ``rules``; built, when
    ``built_under`` is given, under those conventions (which it declares) whatever the member is declared to do
    (a safety bug shows whatever is declared)."""
    if built_under is None:
        return declare(name, component, *rules)
    built = functools.partial(component, conventions=built_under)
    return declare(name, built, *rules, conventions=Conventions(store=built_under))


class DemotionDropsTheBlock(KVStore):
    """``demote`` forgets the victim instead of moving it down."""

    def demote(self, node: int, tier: int) -> Hashable | None:
        here = self._node(node)
        victim = super().demote(node, tier)
        if victim is not None:
            self._drop(node, here, victim)
        return victim


demotion_drops_the_block = store(
    "demotion drops the block", DemotionDropsTheBlock, store_spec.invariant_demotion_keeps_the_block
)


class EvictsPinnedBlocks(KVStore):
    """Victims are taken in policy order whether a transfer has them pinned or not."""

    def _victim(self, node: Node, tier: int, target: float | None = None) -> Hashable | None:
        return next(iter(self._order(node, tier, target)), None)


evicts_pinned_blocks = store("evicts pinned blocks", EvictsPinnedBlocks, store_spec.invariant_pinned_never_evicted)


class StaleReplicaAfterReput(KVStore):
    """A re-put rewrites only the writer's copy; other nodes keep the old tokens."""

    def _write_replicas(self, writer: int, replicas: list[tuple[int, Block]], contents: Tokens) -> None:
        super()._write_replicas(writer, [(n, block) for n, block in replicas if n == writer], contents)


stale_replica_after_reput = store(
    "stale replica after re-put", StaleReplicaAfterReput, store_spec.invariant_replicas_agree
)


class CapacityPerNode(KVStore):
    """Counts a node's blocks against the node's total, so one tier fills past its size."""

    def _room_plan(self, node: Node, tier: int, entering: Hashable) -> list[tuple[Hashable, int]]:
        if len(node.blocks) < sum(self.capacities):
            return []
        victim = self._victim(node, len(TIERS) - 1)
        if victim is None:
            raise OutOfBlocks(1, 0, what="unpinned slots on the node")
        return [(victim, len(TIERS) - 1)]


capacity_per_node = store("capacity counted per node", CapacityPerNode, store_spec.invariant_tier_capacity)


class LookupNamesDeadNode(KVStore):
    """A node fault silences the node but leaves its directory entries behind."""

    def fail(self, node: int) -> None:
        self._ghosts = {**getattr(self, "_ghosts", {}), node: self._node(node)}
        self._nodes[node] = None

    def _tier_of(self, node: int, key: Hashable) -> int:
        return (self._nodes[node] or self._ghosts[node]).blocks[key].tier


lookup_names_dead_node = store(
    "lookups keep naming a failed node", LookupNamesDeadNode, store_spec.invariant_lookup_names_live_holders
)


class DirectoryMissesDemotions(KVStore):
    """The directory records a copy's tier when the copy is written or promoted; the demotion
    cascade moves blocks down on the node without telling it, so lookups name the old tier."""

    def _insert(self, index: int, node: Node, key: Hashable, block: Block) -> None:
        super()._insert(index, node, key, block)
        self._placed = {**getattr(self, "_placed", {}), (index, key): block.tier}

    def _promote(self, index: int, node: Node, key: Hashable) -> bool:
        promoted = super()._promote(index, node, key)
        if promoted:
            self._placed[(index, key)] = 0
        return promoted

    def _tier_of(self, node: int, key: Hashable) -> int:
        return self._placed[(node, key)]


directory_misses_demotions = store(
    "the directory misses demotions", DirectoryMissesDemotions, store_spec.invariant_directory_exact
)


class FaultDropsTheDeadNodesKeys(KVStore):
    """A node fault removes the directory entries of every key the node held -- and with them the
    surviving replicas, as if a key lived on one node only."""

    def fail(self, node: int) -> None:
        here = self._node(node)
        for key in list(here.blocks):
            for holder in sorted(self._directory.get(key, ())):
                self._drop(holder, self._node(holder), key)
        self._nodes[node] = None


fault_drops_the_dead_nodes_keys = store(
    "a fault drops every replica of the dead node's keys",
    FaultDropsTheDeadNodesKeys,
    store_spec.invariant_fault_loses_only_the_node,
)


class PromotesStaleBackingCopy(KVStore):
    """Write-through to a backing tier, skipped when the backing tier already holds the key (keys are
    taken for content hashes); promotion reloads the backing copy -- so a re-put is lost once the block
    has gone down a tier and come back."""

    def _insert(self, index: int, node: Node, key: Hashable, block: Block) -> None:
        super()._insert(index, node, key, block)
        self._backing = getattr(self, "_backing", {})
        self._backing.setdefault((index, key), block.tokens)

    def _promote(self, index: int, node: Node, key: Hashable) -> bool:
        promoted = super()._promote(index, node, key)
        if promoted:
            node.blocks[key].tokens = self._backing[(index, key)]
        return promoted

    def _drop(self, index: int, node: Node, key: Hashable) -> None:
        super()._drop(index, node, key)
        self._backing.pop((index, key), None)


promotes_stale_backing_copy = store(
    "promotion reloads a stale backing copy", PromotesStaleBackingCopy, store_spec.invariant_get_returns_put
)


class ReadsTheSwappedBuffer(KVStore):
    """A promoting ``get`` swaps the copy with the GPU tier's victim, then answers from the buffer the
    copy was read from -- which the swap has just filled with the demoted victim."""

    def get(self, node: int, key: Hashable) -> Tokens | None:
        here = self._node(node)
        block = here.blocks.get(key)
        if block is None or block.pins or block.tier == 0:
            return super().get(node, key)
        gpu = set(here.tiers[0])
        tokens = super().get(node, key)
        swapped = sorted(gpu - set(here.tiers[0]), key=repr)
        return here.blocks[swapped[0]].tokens if swapped and swapped[0] in here.blocks else tokens


reads_the_swapped_buffer = store(
    "a promoting get reads the buffer it swapped out",
    ReadsTheSwappedBuffer,
    store_spec.invariant_request_reads_its_tokens,
    store_spec.invariant_get_returns_put,
)


class GetIsNotAUse(KVStore):
    """A hit promotes the copy but does not touch its recency or count, so the block a request
    just read is the first one LRU (and LFU) evicts."""

    def get(self, node: int, key: Hashable) -> Tokens | None:
        here = self._node(node)
        block = here.blocks.get(key)
        if block is None:
            return None
        if not block.pins and block.tier != 0:
            self._promote(node, here, key)
        return block.tokens


get_is_not_a_use = store("a get is not counted as a use", GetIsNotAUse, store_spec.invariant_store_refines_spec)


class ReadsPendingStores(KVStore):
    """A hit on a copy still being stored reads its buffer as if the transfer had landed."""

    def get(self, node: int, key: Hashable) -> Tokens | None:
        block = self._node(node).blocks.get(key)
        return block.tokens if block is not None and not block.ready else super().get(node, key)


reads_pending_stores = store(
    "a hit reads a copy still being stored",
    ReadsPendingStores,
    store_spec.invariant_pending_never_read,
    built_under=PENDING,
)


class KeepsFailedStores(KVStore):
    """A store whose transfer failed is marked complete all the same."""

    def complete(self, node: int, key: Hashable, ok: bool) -> None:
        super().complete(node, key, True)


keeps_failed_stores = store(
    "a failed store is kept", KeepsFailedStores, store_spec.invariant_failed_store_leaves_miss, built_under=PENDING
)


class EvictsLeasedCopies(KVStore):
    """Read leases are granted but eviction only skips pinned and pending copies."""

    def _free(self, block: Block) -> bool:
        return block.ready and not block.pins


evicts_leased_copies = store(
    "eviction ignores read leases", EvictsLeasedCopies, store_spec.invariant_pinned_never_evicted, built_under=LEASES
)


class ForcedRemoveDropsCopiesInUse(KVStore):
    """``remove`` drops the copy whatever holds it and releases its pins (LMCache's forced remove)."""

    def remove(self, node: int, key: Hashable) -> None:
        self._held(node, key)
        self._drop(node, self._node(node), key)


forced_remove_drops_copies_in_use = store(
    "a forced remove drops a copy in use",
    ForcedRemoveDropsCopiesInUse,
    invariants.invariant_out_of_contract_call_rejected,
)


class ArcForgetsGhosts(KVStore):
    """ARC without its ghost lists: a victim leaves no trace, so a key coming back never adapts the target."""

    def _leave(self, node: Node, tier: int, key: Hashable) -> None:
        pass


arc_forgets_ghosts = store("ARC keeps no ghosts", ArcForgetsGhosts, store_spec.invariant_store_refines_spec)


class ReplicaTwiceOnTheWriter(KVStore):
    """The replica targets are counted from the writer itself (an off-by-one in the ring), so the writer is
    picked a second time and a factor-r put lands on r - 1 distinct nodes: two of its replicas share one
    node, and one fault takes both.  Mooncake's master places a put's ``replica_num`` replicas over the
    mounted segments by its allocation strategy, the preferred segment first: a strategy that does not
    exclude the segments an object already uses puts two replicas in one segment."""

    def _replica_targets(self, ring: list[int], factor: int) -> list[int]:
        return ring[: factor - 1]


replica_twice_on_the_writer = store(
    "a replicated put places two replicas on the writer",
    ReplicaTwiceOnTheWriter,
    placement_spec.invariant_replicas_on_distinct_nodes,
)


class Draining(KVStore):
    """Knows when the background evictor's batch is under way (``draining``), for the members that break it."""

    draining = False

    def _drain(self, index: int, node: Node, tier: int, dropped: list[tuple[int, Hashable]]) -> None:
        self.draining = True
        try:
            super()._drain(index, node, tier, dropped)
        finally:
            self.draining = False


class LastTierDrainedInArrivalOrder(Draining):
    """The background evictor drains the last tier as a queue, the copies that arrived there first going
    first, whatever the tier's policy says -- as an offloading backend whose disk tier is an insertion-ordered
    dict popped from the front, a hit read in place there never moved to its end (LMCache's local disk
    backend and vLLM's CPU offloading keep their LRU in an ``OrderedDict`` moved on every touch; forgetting
    the move on one path makes it this queue)."""

    def _move(self, node: Node, key: Hashable, tier: int) -> None:
        super()._move(node, key, tier)
        self._arrived(node).pop(key, None)
        if tier == len(self.capacities) - 1:
            self._arrived(node)[key] = None

    def _insert(self, index: int, node: Node, key: Hashable, block: Block) -> None:
        super()._insert(index, node, key, block)
        if block.tier == len(self.capacities) - 1:
            self._arrived(node)[key] = None

    def _arrived(self, node: Node) -> dict[Hashable, None]:
        queues: dict[int, dict[Hashable, None]] = self.__dict__.setdefault("queues", {})
        return queues.setdefault(id(node), {})

    def _victim(self, node: Node, tier: int, target: float | None = None) -> Hashable | None:
        if tier != len(self.capacities) - 1 or not self.draining:
            return super()._victim(node, tier, target)
        queue = [key for key in self._arrived(node) if key in node.tiers[tier]]
        return next((key for key in queue if self._free(node.blocks[key])), None)


last_tier_drained_in_arrival_order = store(
    "the background evictor drains the last tier in arrival order",
    LastTierDrainedInArrivalOrder,
    placement_spec.invariant_tier_eviction_order,
    built_under=BACKGROUND,
)


class BatchEvictionTakesCopiesInUse(Draining):
    """The background evictor's batch walks each tier in policy order and takes the first copies it meets,
    forgetting to skip those in use: vLLM's CPU offloading manager (``LRUOffloadingManager.prepare_store``)
    evicts a batch in one pass over its blocks, skipping those with ``ref_cnt > 0`` (being loaded) -- this
    pass does not skip them."""

    def _free(self, block: Block) -> bool:
        return self.draining or super()._free(block)


batch_eviction_takes_copies_in_use = store(
    "batched eviction takes copies in use",
    BatchEvictionTakesCopiesInUse,
    store_spec.invariant_pinned_never_evicted,
    built_under=BACKGROUND,
)


class FullTierPutTakesACopyInUse(KVStore):
    """A put that finds no copy it may evict in its way does not refuse: it takes the policy's first copy all
    the same, pinned or not, so that the write path never fails -- the refusal the spec expects becomes a
    transfer's memory overwritten."""

    putting = False

    def put(self, node: int, key: Hashable, tokens: Sequence[int]) -> None:
        self.putting = True
        try:
            super().put(node, key, tokens)
        finally:
            self.putting = False

    def _victim(self, node: Node, tier: int, target: float | None = None) -> Hashable | None:
        chosen = super()._victim(node, tier, target)
        if chosen is None and self.putting:
            return next(iter(self._order(node, tier, target)), None)
        return chosen


full_tier_put_takes_a_copy_in_use = store(
    "a put into a tier of copies in use takes one",
    FullTierPutTakesACopyInUse,
    store_spec.invariant_pinned_never_evicted,
)


class RefusedPutHasDroppedACopy(KVStore):
    """Declares that a refused put may adapt its policy (``refusal_adapts_policy``), and makes room from the bottom
    up: it frees a slot at the deepest tier that can give one up, dropping that tier's victim, before it looks
    for a copy to move into it from each tier above -- and when one has none to give up, it refuses with the
    dropped copy gone.  The convention lets a refusal move a policy's preference, never a copy: this one loses a
    block to a call that wrote nothing."""

    def _put(self, node: int, key: Hashable, tokens: Sequence[int]) -> None:
        try:
            super()._put(node, key, tokens)
        except OutOfBlocks:
            here = self._node(node)
            victims = [(tier, self._victim(here, tier)) for tier in range(len(self.capacities))]
            deepest = [(tier, victim) for tier, victim in victims if victim is not None]
            if deepest:
                tier, victim = deepest[-1]
                self._leave(here, tier, victim)
                self._drop(node, here, victim)
            raise


refused_put_has_dropped_a_copy = store(
    "a refused put has dropped a copy",
    RefusedPutHasDroppedACopy,
    invariants.invariant_failed_operation_changes_nothing,
    built_under=StoreConventions(refusal_adapts_policy=True),
)


class DemotedCopyArrivesNewest(KVStore):
    """A legal choice kvspec does not model: a copy moved down a tier arrives there as its most recently used
    (LMCache's disk backend ranks a chunk written to it on eviction from DRAM as a new put).  The spec counts
    moving between tiers as no use, so only the order the lower tiers give up their copies differs (a
    convention finding); no copy is lost, moved or read wrong, so no safety rule fails."""

    def _move(self, node: Node, key: Hashable, tier: int) -> None:
        node.blocks[key].last_use = self._tick()  # the copy leaves its tier under its old rank, enters under this
        super()._move(node, key, tier)


demoted_copy_arrives_newest = store(
    "a legal choice: a demoted copy arrives as its tier's newest",
    DemotedCopyArrivesNewest,
    placement_spec.invariant_tier_eviction_order,
)


# Declares background eviction, but makes room the moment a put needs it.
evicts_on_the_put_path = declare(
    "declared background eviction, evicts on the put path",
    KVStore,
    invariants.invariant_verdict_matches_spec,
    conventions=Conventions(store=BACKGROUND),
)

# A legal choice, undeclared: a put refused for want of room still adapts an ARC tier to its key's ghost, as vLLM's
# CPU offloading does (``refusal_adapts_policy``, not declared here).  Only the policy's target moves, so the
# refinement finds it (a convention finding) and no safety rule does.
adapts_on_a_refused_put = declare(
    "a legal choice, undeclared: a refused put adapts ARC's target",
    functools.partial(KVStore, conventions=attrs.evolve(ONE_ARC_TIER, refusal_adapts_policy=True)),
    store_spec.invariant_store_refines_spec,
    conventions=Conventions(store=ONE_ARC_TIER),
)
