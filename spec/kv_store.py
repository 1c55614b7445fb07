"""Layer 7 -- the tiered KV store: blocks by key across GPU, DRAM and SSD of several nodes.

Rules (lecture §9.2-9.3; Mooncake §3-4, the store its Conductor places blocks in):

* A cluster has ``nodes`` nodes, each with the same **tiers**, fastest first:
  ``gpu`` (HBM), ``cpu`` (DRAM), ``ssd``.  Tier ``t`` of every node holds at
  most ``capacities[t]`` blocks and orders them by its own **policy**
  (``policies[t]``: ``lru``, ``lfu`` or ``arc``, ``spec.kv_store_policies``).
  A *use* is a put or a ``get``; moving between tiers is not a use, so a
  demoted block keeps its place in recency.
* A block is a key (the caller's chained hash: opaque, compared for equality)
  and its **contents**, the token ids the caller computed it from.  A node
  holds at most one copy of a key, in one tier; copies on different nodes are
  **replicas**.
* ``put(node, key, tokens)`` writes a freshly computed block into the node's
  first tier (promoting the node's copy if it has one) and gives every replica
  the new contents, so that no node keeps stale KV under a key.  A replica
  in use (below) keeps its contents: re-putting it with other tokens is an
  ``InvalidOperation``.
* **Making room** in tier ``t`` takes its *victim*, the first evictable copy
  in policy order, and moves it to tier ``t + 1`` (making room there the same
  way); the last tier drops its victim -- the only way a copy is lost besides
  ``evict``, ``remove`` and a node fault.  With no victim anywhere down the
  cascade the operation raises ``OutOfBlocks`` and changes nothing.
* ``get(node, key)`` answers the node's contents of ``key`` (``None``: a miss,
  nothing changes), counts a use and promotes the copy to the first tier; a
  copy in use, or one for which no room can be made, is read where it is.
* ``demote(node, tier)`` moves the tier's victim one tier down (from the last
  tier: ``InvalidOperation``; use ``evict``); ``evict(node, tier)`` drops the
  tier's victim.  Both answer the victim's key, ``None`` when there is none.
* ``replicate(key, source, target)`` copies the source's block into the
  target's first tier (a transfer, not a use: the copy starts with one use).
* ``pin(node, key)`` / ``unpin(node, key)`` bracket a transfer out of the copy.
  A copy that is pinned, leased or pending is **in use**: never evicted,
  demoted, promoted or removed.
* ``fail(node)`` is a **node fault**: the node's tiers vanish with their pins;
  lookups stop naming it at once; every operation naming a dead node is an
  ``InvalidOperation`` until ``restart(node)`` brings it back empty.
* ``lookup(key)`` names every (node, tier) of a live node holding the key.
* Ownership: the store copies the tokens it is given; what it answers is the caller's.
* Bad input (unknown node, tier or key, a dead node, unpin without pin, a
  replica onto a node that holds the key) raises ``InvalidOperation``; every
  failed operation changes nothing.

Conventions (``spec.conventions.StoreConventions``; the reference's in brackets):

* **Shape** -- ``tiers``, a node's tiers (a subsequence of gpu, cpu, ssd
  [all three]; capacities and policies give one entry per tier), and
  ``max_nodes`` [any]: vLLM's CPU offloading is a store of one node and one
  tier, a profile of this model, not a second store.
* ``reput`` -- a put of a key the store holds: ``refresh`` [the rule above],
  or -- contents are immutable, the key is a hash of them -- ``touch`` (a use
  of the node's ready copy, nothing written) or ``skip`` (nothing at all).
* ``stores`` -- ``immediate`` [readable at once] or ``pending``: a put leaves
  the copy *pending* (it occupies its slot, is in use, and is not readable:
  ``get`` misses it, ``find`` answers "pending") until ``complete(node, key,
  ok)``; a failed store (``ok=False``) leaves a miss.  A completion of a copy
  that is not pending changes nothing: transfer workers report late.
* ``read_lease`` -- seconds [0: none] a hit leases the copy for: a leased copy
  is in use until model time passes the lease's end.  Model time moves only
  by ``advance(seconds)``, never with the wall clock.  ``leases_new_copies``
  [off]: a stored copy (put or replica) is leased from the start too.
* ``eviction`` -- ``on_demand`` [a put evicts when it needs room] or
  ``background``: a put into a full tier is refused (``OutOfBlocks``), and
  ``settle()`` -- the background evictor's work, done -- makes room in every
  tier holding at least ``watermark`` of its capacity, victims as above,
  until it holds less; it answers the copies it dropped.  The machine calls
  ``settle`` after every operation, before comparing, so that a background
  evictor is checked exactly, not "eventually".  With ``victims="engine"`` the
  engine picks its own victims: the model takes the ones ``settle`` answers,
  the safety rules judge them, and a tier's keys are listed by repr (there is
  no order to state).
* ``promotion`` [on] -- a hit moves the copy to the first tier; off, it is
  read where it is.
* ``remove(node, key)`` drops the node's copy; a forced remove of a copy in
  use is out of contract (``InvalidOperation``): the caller holds the pin.
* ``refusal_adapts_policy`` [off] -- a marked replacement of the refused put
  (``spec.kv_store_model.refused_put``).  Off, a put refused for want of room
  changes nothing.  On, the writer's first tier has seen the key as a store
  miss before it found no room, as a put that goes ahead does: an ARC tier
  adapts its target to a ghost hit, and the ghost moves to the young end of
  its list (vLLM's ``prepare_store`` records the miss "once before any
  allocation-related early return").  Whatever is declared, what a refused
  call must leave as it was (``kept_by_a_refusal``) is everything but each
  ARC tier's adaptive state -- its target and its ghosts' order -- which
  orders future victims and nothing else: a refusal that moves it undeclared
  is a convention finding (the refinement), never a safety one.

Theory of operation, in five modules: this one (the protocol and the rules
over snapshots); ``spec.kv_store_state`` (``StoreState``, what a snapshot
shows, and the model's value); ``spec.kv_store_model`` (every operation as a
pure transition); ``spec.kv_store_policies`` (LRU, LFU and ARC orders);
``spec.kv_store_placement`` (replicated puts, each tier's order).  An
implementation's ``snapshot()`` returns a ``StoreState``: per node and tier
the keys in eviction order, each copy's contents, pins, pending stores and
leases, each ARC tier's lists, and the directory its lookups answer from.  A
caller whose prefix lived only on a failed node recomputes it from its tokens
and puts it again.

Invariants:

* ``invariant_directory_exact`` -- a block lives only where the store says
  it does: the directory names exactly the copies in the tiers, on live nodes,
  or a lookup sends a transfer to a block that is not there (or misses one that is).
* ``invariant_tier_capacity`` -- no tier of any node holds more than its
  capacity, since a tier is a physical memory, not a share of a node's.
* ``invariant_pinned_never_evicted`` -- a copy in use (pinned, leased, pending)
  stays in its tier with its contents, or an in-flight transfer reads (or
  writes) freed memory.
* ``invariant_demotion_keeps_the_block`` -- a copy leaves its live node only
  when the caller asked for it (removed it, evicted a tier, a failed store,
  the background evictor's answered victims) or as a victim the node's last
  tier gave up for room, which leaves that tier full; a copy leaving an upper
  tier lands in a lower one.  Judged on the store's states before and after
  and the caller's ledger; which copies go is the policy's, a convention.
* ``invariant_replicas_agree`` -- every replica of a key holds the same
  contents, or two nodes serve different KV for one prefix.
* ``invariant_get_returns_put`` -- a hit reads the tokens the store accepted
  under the key, the only thing that makes reuse correct.
* ``invariant_pending_never_read`` -- a hit never reads a block still being
  stored: its memory holds part of the transfer.
* ``invariant_failed_store_leaves_miss`` -- a store whose transfer failed
  leaves no copy behind, or a later hit reads what never arrived.
* ``invariant_lookup_names_live_holders`` -- a lookup answers exactly the live
  copies, never a dead node, or a request waits on a transfer that never comes.
* ``invariant_fault_loses_only_the_node`` -- a node fault takes that node's
  copies and nothing else: other nodes' blocks stay where they were.
* ``invariant_request_reads_its_tokens`` -- a request served from the store,
  from a replica or by recomputation after a fault, reads exactly its tokens.
* ``invariant_store_refines_spec`` -- the implementation's state is the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec.components import component_kind, optional_operation
from kvspec.spec.invariants import diff_states, invariant
from kvspec.spec.kv_store_state import (  # the layer's records, read from here
    REFERENCE_STORE,
    TIERS,
    Copy,
    Key,
    Location,
    Place,
    Store,
    StoreState,
    Tokens,
    abstract,
    eviction_order,
    in_use,
    new_store,
)

__all__ = [  # the layer read from one place: its records, its protocol and rules (its transitions: kv_store_model)
    "Copy",
    "KVStore",
    "KV_STORE",
    "Key",
    "Location",
    "Place",
    "REFERENCE_STORE",
    "Store",
    "StoreState",
    "TIERS",
    "Tokens",
    "abstract",
    "copies_in_use",
    "eviction_order",
    "in_use",
    "invariant_demotion_keeps_the_block",
    "invariant_directory_exact",
    "invariant_failed_store_leaves_miss",
    "invariant_fault_loses_only_the_node",
    "invariant_get_returns_put",
    "invariant_lookup_names_live_holders",
    "invariant_pending_never_read",
    "invariant_pinned_never_evicted",
    "invariant_replicas_agree",
    "invariant_request_reads_its_tokens",
    "invariant_store_refines_spec",
    "invariant_tier_capacity",
    "kept_by_a_refusal",
    "new_store",
]


@runtime_checkable
class KVStore(Protocol):
    """What a tiered KV store offers; ``kv_store(nodes, capacities, policies)`` builds one."""

    def put(self, node: int, key: Key, tokens: Sequence[int]) -> None: ...
    def get(self, node: int, key: Key) -> Tokens | None: ...
    def demote(self, node: int, tier: int) -> Key | None: ...
    def evict(self, node: int, tier: int) -> Key | None: ...
    def replicate(self, key: Key, source: int, target: int) -> None: ...
    def pin(self, node: int, key: Key) -> None: ...
    def unpin(self, node: int, key: Key) -> None: ...
    def fail(self, node: int) -> None: ...
    def restart(self, node: int) -> None: ...
    def lookup(self, key: Key) -> tuple[Location, ...]: ...
    def snapshot(self) -> StoreState: ...


@runtime_checkable
class EngineChoicesStore(KVStore, Protocol):
    """The optional operations of the engines' choices (``PENDING_STORES``, ``LEASES``, ``SETTLE``, ``REMOVE``)."""

    def complete(self, node: int, key: Key, ok: bool) -> None: ...  # pending_stores: a store lands (or fails)
    def find(self, node: int, key: Key) -> str: ...  # pending_stores: "hit", "pending" or "miss"
    def advance(self, seconds: float) -> None: ...  # leases: model time passes
    def settle(self) -> tuple[tuple[int, Key], ...]: ...  # settle: background eviction done, its victims
    def remove(self, node: int, key: Key) -> None: ...  # remove: drop a copy on request


KV_STORE = component_kind("kv_store", KVStore, builds="kv_store(nodes, capacities, policies)")
STORES = (KV_STORE.name,)
REPLICATE = optional_operation("replicate", KVStore, "replicate", kinds=STORES)
NODE_FAULTS = optional_operation("node_faults", KVStore, "fail", "restart", kinds=STORES)
PENDING_STORES = optional_operation("pending_stores", EngineChoicesStore, "complete", "find", kinds=STORES)
LEASES = optional_operation("leases", EngineChoicesStore, "advance", kinds=STORES)
SETTLE = optional_operation("settle", EngineChoicesStore, "settle", kinds=STORES)
REMOVE = optional_operation("remove", EngineChoicesStore, "remove", kinds=STORES)


# -- invariants over snapshots ---------------------------------------------------


def _held_copies(state: StoreState) -> dict[tuple[int, Key], int]:
    """(node, key) -> tier, as the tiers list them."""
    return {
        (node, key): tier for node, tiers in enumerate(state.tiers) for tier, keys in enumerate(tiers) for key in keys
    }


@invariant(
    "a lookup sends a transfer to the copies the directory names: a wrong entry reads nothing or misses a hit", "safety"
)
def invariant_directory_exact(state: StoreState) -> str | None:
    held = _held_copies(state)
    for node, tiers in enumerate(state.tiers):
        listed = [key for keys in tiers for key in keys]
        if len(listed) != len(set(listed)):
            return f"node {node} lists a key in two places: {tiers}"
        if listed and not state.alive[node]:
            return f"dead node {node} still lists blocks {listed}"
    if set(held) != set(state.contents):
        return f"tiers list {sorted(map(repr, held))} but contents are kept for {sorted(map(repr, state.contents))}"
    named = {(node, key): tier for key, places in state.directory.items() for node, tier in places}
    if named != held:
        wrong = sorted(repr(p) for p in set(named.items()) ^ set(held.items()))
        return f"the directory and the tiers disagree on {wrong}"
    return None


@invariant(
    "a tier is a physical memory: filling one tier past its size because another has room corrupts memory", "safety"
)
def invariant_tier_capacity(state: StoreState) -> str | None:
    for node, tiers in enumerate(state.tiers):
        for tier, keys in enumerate(tiers):
            if len(keys) > state.capacities[tier]:
                return f"node {node}'s {state.names[tier]} tier holds {len(keys)} blocks, capacity {state.capacities[tier]}"
    return None


def copies_in_use(state: StoreState) -> dict[Place, str]:
    """The copies a snapshot shows in use, and why."""
    used = {place: "pending" for place in state.pending}
    used.update((place, "leased") for place in state.leases)
    used.update((place, f"{pins} pin(s)") for place, pins in state.pins.items())
    return used


@invariant(
    "a copy in use is being transferred (pinned, leased, or still being stored): evicting or moving it makes the "
    "transfer read or write freed memory",
    "safety",
)
def invariant_pinned_never_evicted(before: StoreState, after: StoreState, released: Sequence[Place] = ()) -> str | None:
    """Reads the store's own snapshots around a call and the caller's ledger: ``released``, the copies the call
    itself named to go (a removed copy, a store reported failed) -- the caller's own request, never damage, even
    where the caller still held a pin on it (that call is a caller-contract finding)."""
    for (node, key), why in copies_in_use(before).items():
        if not after.alive[node] or (node, key) in released:
            continue
        where = before.location(node, key)
        if after.location(node, key) != where or after.contents.get((node, key)) != before.contents[(node, key)]:
            tier = before.names[where[1]] if where else "?"
            return f"block {key!r} ({why}) left node {node}'s {tier} tier or changed"
    return None


@invariant(
    "demotion moves a block down a tier: a copy is lost only when the caller asks, or as the victim a full last tier "
    "gives up for room -- one dropped from an upper tier, or while the last tier has room, is KV lost for nothing",
    "safety",
)
def invariant_demotion_keeps_the_block(
    before: StoreState, after: StoreState, asked: Sequence[Place] = ()
) -> str | None:
    """Reads the store's own snapshots around a call and the caller's ledger: ``asked``, the copies the call named
    to go (a removed copy, a failed store) or answered as taken at the caller's request (``evict``'s victim, the
    background evictor's).  Any other copy gone from a live node must have left its last tier as a victim that
    made room there: that tier holds its capacity after the call.  Which victim goes is the policy's."""
    last = len(before.capacities) - 1
    for (node, key), tier in sorted(_held_copies(before).items(), key=repr):
        if not after.alive[node] or (node, key) in after.contents or (node, key) in asked:
            continue
        if tier != last:
            return f"block {key!r} left node {node}'s {before.names[tier]} tier and no lower tier holds it"
        room = before.capacities[last] - len(after.tiers[node][last])
        if room > 0:
            return (
                f"block {key!r} was evicted from node {node}'s {before.names[last]} tier, "
                f"which has room for {room} more after the call"
            )
    return None


def kept_by_a_refusal(state: StoreState) -> StoreState:
    """What of a snapshot a call refused for want of room must leave as it was: all of it but each ARC tier's
    adaptive state -- its target, and its ghosts' order -- which orders future victims and nothing else (a
    policy may learn from a refused call: ``refusal_adapts_policy``).  An ARC tier's keys are listed by repr,
    since its eviction order follows the target; its recent and frequent lists stay in the view as they are."""
    if not state.arc:
        return state
    tiers = tuple(
        tuple(tuple(sorted(keys, key=repr)) if (node, tier) in state.arc else keys for tier, keys in enumerate(held))
        for node, held in enumerate(state.tiers)
    )
    arc = {
        at: attrs.evolve(
            lists,
            recent_ghosts=tuple(sorted(lists.recent_ghosts, key=repr)),
            frequent_ghosts=tuple(sorted(lists.frequent_ghosts, key=repr)),
            target=0.0,
        )
        for at, lists in state.arc.items()
    }
    return attrs.evolve(state, tiers=tiers, arc=arc)


@invariant("replicas of one key serve the same prefix: a stale one gives some requests KV of other tokens", "safety")
def invariant_replicas_agree(state: StoreState) -> str | None:
    seen: dict[Key, tuple[int, Tokens]] = {}
    for (node, key), tokens in state.contents.items():
        first = seen.setdefault(key, (node, tokens))
        if first[1] != tokens:
            return f"block {key!r} holds {first[1]} on node {first[0]} but {tokens} on node {node}"
    return None


@invariant("reuse is correct only if a hit reads the very tokens the store accepted under the key", "safety")
def invariant_get_returns_put(key: Key, written: Tokens | None, read: Tokens | None) -> str | None:
    if read is not None and read != written:
        return f"get({key!r}) read {read}, but {written} was put"
    return None


@invariant(
    "a block still being stored holds part of a transfer: a hit that reads it serves KV that never finished arriving",
    "safety",
    needs=(PENDING_STORES,),
)
def invariant_pending_never_read(key: Key, was_pending: bool, read: Tokens | None) -> str | None:
    if was_pending and read is not None:
        return f"get({key!r}) read {read} from a copy still being stored"
    return None


@invariant(
    "a store whose transfer failed must leave a miss: a copy left behind serves whatever the failed transfer wrote",
    "safety",
    needs=(PENDING_STORES,),
)
def invariant_failed_store_leaves_miss(after: StoreState, node: int, key: Key) -> str | None:
    if (node, key) in after.contents or after.location(node, key) is not None:
        return f"the store of {key!r} on node {node} failed, but the node still holds a copy"
    return None


@invariant(
    "a lookup naming a dead node or a missing copy sends a request to wait for a transfer that never comes", "safety"
)
def invariant_lookup_names_live_holders(state: StoreState, key: Key, answer: Sequence[Location]) -> str | None:
    dead = [place for place in answer if not state.alive[place[0]]]
    if dead:
        return f"lookup({key!r}) names failed node(s) {sorted({n for n, _ in dead})}"
    held = sorted((node, tier) for (node, k), tier in _held_copies(state).items() if k == key)
    if sorted(answer) != held:
        return f"lookup({key!r}) answered {list(answer)}, the live copies are {held}"
    return None


@invariant(
    "a fault must cost only the failed node's blocks: losing others turns one failure into many recomputes", "safety"
)
def invariant_fault_loses_only_the_node(before: StoreState, after: StoreState, node: int) -> str | None:
    for (other, key), tokens in before.contents.items():
        if other != node and (
            after.contents.get((other, key)) != tokens or after.location(other, key) != before.location(other, key)
        ):
            return f"node {node} failed and node {other}'s block {key!r} changed or vanished"
    if any(n == node for n, _ in after.contents):
        return f"failed node {node} still holds blocks"
    return None


@invariant(
    "whatever served it -- a local hit, a replica or recomputation after a fault -- a request reads its own tokens",
    "safety",
)
def invariant_request_reads_its_tokens(expected: Sequence[Tokens], served: Sequence[Tokens]) -> str | None:
    if tuple(expected) != tuple(served):
        return f"the request's blocks are {tuple(expected)}, it was served {tuple(served)}"
    return None


@invariant("the implementation must be in exactly the state the specification model predicts", "convention")
def invariant_store_refines_spec(actual: StoreState, expected: StoreState) -> str | None:
    if actual != expected:
        return diff_states(actual, expected)
    return None
