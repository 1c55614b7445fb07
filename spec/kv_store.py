"""Layer 7 -- the tiered KV store: blocks by key across GPU, DRAM and SSD of several nodes.

Rules (lecture §9.2-9.3; Mooncake §3-4, the store its Conductor places blocks in):

* A cluster has ``nodes`` nodes, each with the same **tiers**, fastest first:
  ``gpu`` (HBM), ``cpu`` (DRAM), ``ssd``.  Tier ``t`` of every node holds at
  most ``capacities[t]`` blocks and orders them by its own **policy**
  (``policies[t]``: ``lru`` evicts the least recently used first; ``lfu`` the
  fewest used, ties in LRU order).  A *use* is a ``put`` or a ``get``; moving
  between tiers is not a use, so a demoted block keeps its place in recency.
* A block is a key (the caller's chained hash: opaque, compared for equality)
  and its **contents**, the token ids the caller computed it from.  A node
  holds at most one copy of a key, in one tier; copies on different nodes are
  **replicas**.
* ``put(node, key, tokens)`` writes a freshly computed block into the node's
  GPU tier (promoting the node's copy if it has one) and gives every replica
  the new contents, so that no node keeps stale KV under a key.  A replica
  that is pinned keeps its contents: re-putting it with other tokens is an
  ``InvalidOperation``.
* **Making room** in tier ``t`` takes its *victim*, the first unpinned block
  in policy order, and moves it to tier ``t + 1`` (making room there the same
  way); the last tier drops its victim -- the only way a copy is lost besides
  ``evict`` and a node fault.  With no victim anywhere down the cascade the
  operation raises ``OutOfBlocks`` and changes nothing.
* ``get(node, key)`` answers the node's contents of ``key`` (``None``: a miss,
  nothing changes), counts a use and promotes the copy to the GPU tier; a
  pinned copy, or one for which no room can be made, is read where it is.
* ``demote(node, tier)`` moves the tier's victim one tier down (from the last
  tier: ``InvalidOperation``; use ``evict``); ``evict(node, tier)`` drops the
  tier's victim.  Both answer the victim's key, ``None`` when there is none.
* ``replicate(key, source, target)`` copies the source's block into the
  target's GPU tier (a transfer, not a use: the copy starts with one use).
* ``pin(node, key)`` / ``unpin(node, key)`` bracket a transfer out of the copy:
  a pinned copy is never evicted, demoted or promoted.
* ``fail(node)`` is a **node fault**: the node's tiers vanish with their pins;
  lookups stop naming it at once; every operation naming a dead node is an
  ``InvalidOperation`` until ``restart(node)`` brings it back empty.
* ``lookup(key)`` names every (node, tier) of a live node holding the key.
* Ownership: the store copies the tokens it is given; what it answers is the caller's.
* Bad input (unknown node, tier or key, a dead node, unpin without pin, a
  replica onto a node that holds the key) raises ``InvalidOperation``; every
  failed operation changes nothing.

Theory of operation: ``Store`` is the model, transitions are pure functions
returning a new ``Store`` (and the transition's answer).  Each copy carries a
use count and the clock of its last use, so policy order is a sort.  An
implementation's ``snapshot()`` returns a ``StoreState``: per node and tier
the keys in eviction order, each copy's contents and pins, and the directory
its lookups answer from.  A caller whose prefix lived only on a failed node
recomputes it from its tokens and puts it again.

Invariants:

* ``invariant_directory_exact`` -- a block lives only where the store says
  it does: the directory names exactly the copies in the tiers, on live nodes,
  or a lookup sends a transfer to a block that is not there (or misses one that is).
* ``invariant_tier_capacity`` -- no tier of any node holds more than its
  capacity, since a tier is a physical memory, not a share of a node's.
* ``invariant_pinned_never_evicted`` -- a pinned copy stays in its tier with
  its contents, or an in-flight transfer reads freed memory.
* ``invariant_demotion_keeps_the_block`` -- an operation loses a copy only by
  choosing it for eviction (or by a fault), so demotion never loses data.
* ``invariant_replicas_agree`` -- every replica of a key holds the same
  contents, or two nodes serve different KV for one prefix.
* ``invariant_get_returns_put`` -- a hit reads the tokens last put under the
  key, the only thing that makes reuse correct.
* ``invariant_lookup_names_live_holders`` -- a lookup answers exactly the live
  copies, never a dead node, or a request waits on a transfer that never comes.
* ``invariant_fault_loses_only_the_node`` -- a node fault takes that node's
  copies and nothing else: other nodes' blocks stay where they were.
* ``invariant_request_reads_its_tokens`` -- a request served from the store,
  from a replica or by recomputation after a fault, reads exactly its tokens.
* ``invariant_store_refines_spec`` -- the implementation's state is the model's.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec.block_pool import POLICIES, Policy
from kvspec.spec.components import component_kind
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.invariants import diff_states, invariant

TIERS: tuple[str, ...] = ("gpu", "cpu", "ssd")
Key = Hashable
Tokens = tuple[int, ...]
Location = tuple[int, int]  # (node, tier)


@attrs.frozen
class StoreState:
    """The abstract state of a store: what ``snapshot()`` returns."""

    capacities: tuple[int, ...]
    alive: tuple[bool, ...]
    tiers: tuple[tuple[tuple[Key, ...], ...], ...]  # [node][tier]: keys in eviction order, head first
    contents: Mapping[tuple[int, Key], Tokens]  # (node, key) -> tokens
    pins: Mapping[tuple[int, Key], int]  # (node, key) -> pins, only positive counts
    directory: Mapping[Key, tuple[Location, ...]]  # what lookups answer, locations sorted

    def location(self, node: int, key: Key) -> Location | None:
        for tier, keys in enumerate(self.tiers[node]):
            if key in keys:
                return node, tier
        return None


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


# -- the model -------------------------------------------------------------------


KV_STORE = component_kind(
    "kv_store",
    builds="kv_store(nodes, capacities, policies)",
    methods=("put", "get", "demote", "evict", "pin", "unpin", "lookup", "snapshot"),
    optional={"replicate": ("replicate",), "node_faults": ("fail", "restart")},
)


@attrs.frozen
class Copy:
    """One node's copy of a block."""

    tier: int
    tokens: Tokens
    uses: int
    last_use: int
    pins: int = 0


@attrs.frozen
class Store:
    capacities: tuple[int, ...]
    policies: tuple[Policy, ...]
    alive: tuple[bool, ...]
    copies: Mapping[tuple[int, Key], Copy]
    clock: int = 0


def new_store(nodes: int, capacities: Sequence[int], policies: Sequence[Policy]) -> Store:
    """An empty store of ``nodes`` live nodes; one capacity and one policy per tier."""
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise InvalidOperation(f"a store needs a positive number of nodes, got {nodes!r}")
    if len(capacities) != len(TIERS) or any(not isinstance(c, int) or c < 1 for c in capacities):
        raise InvalidOperation(f"need a positive capacity for each tier {TIERS}, got {tuple(capacities)!r}")
    if len(policies) != len(TIERS) or any(p not in POLICIES for p in policies):
        raise InvalidOperation(f"need a policy from {POLICIES} for each tier {TIERS}, got {tuple(policies)!r}")
    return Store(capacities=tuple(capacities), policies=tuple(policies), alive=(True,) * nodes, copies={})


def eviction_order(store: Store, node: int, tier: int) -> tuple[Key, ...]:
    """The keys of one tier of one node, the first victim at the head."""
    here = [(key, copy) for (n, key), copy in store.copies.items() if n == node and copy.tier == tier]
    if store.policies[tier] == "lru":
        here.sort(key=lambda item: item[1].last_use)
    else:
        here.sort(key=lambda item: (item[1].uses, item[1].last_use))
    return tuple(key for key, _ in here)


def abstract(store: Store) -> StoreState:
    """The abstraction of the model, comparable with an implementation's snapshot."""
    directory: dict[Key, list[Location]] = {}
    for (node, key), copy in store.copies.items():
        directory.setdefault(key, []).append((node, copy.tier))
    return StoreState(
        capacities=store.capacities,
        alive=store.alive,
        tiers=tuple(
            tuple(eviction_order(store, node, tier) for tier in range(len(TIERS))) for node in range(len(store.alive))
        ),
        contents={place: copy.tokens for place, copy in store.copies.items()},
        pins={place: copy.pins for place, copy in store.copies.items() if copy.pins},
        directory={key: tuple(sorted(places)) for key, places in directory.items()},
    )


def _live_node(store: Store, node: object) -> int:
    if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(store.alive):
        raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(store.alive) - 1})")
    if not store.alive[node]:
        raise InvalidOperation(f"node {node} has failed; restart it first")
    return node


def _tier(tier: object) -> int:
    if not isinstance(tier, int) or isinstance(tier, bool) or not 0 <= tier < len(TIERS):
        raise InvalidOperation(f"tier {tier!r} is not a tier (0..{len(TIERS) - 1}: {', '.join(TIERS)})")
    return tier


def _held(store: Store, node: int, key: Key) -> Copy:
    copy = store.copies.get((node, key))
    if copy is None:
        raise InvalidOperation(f"node {node} holds no block {key!r}")
    return copy


def _victim(store: Store, node: int, tier: int) -> Key | None:
    unpinned = (key for key in eviction_order(store, node, tier) if store.copies[(node, key)].pins == 0)
    return next(unpinned, None)


def _make_room(store: Store, node: int, tier: int) -> Store:
    """Free one slot of ``tier`` by cascading its victim down; ``OutOfBlocks`` if nothing can move."""
    if len(eviction_order(store, node, tier)) < store.capacities[tier]:
        return store
    victim = _victim(store, node, tier)
    if victim is None:
        raise OutOfBlocks(1, 0, what=f"unpinned slots in node {node}'s {TIERS[tier]} tier")
    copies = dict(store.copies)
    if tier == len(TIERS) - 1:
        del copies[(node, victim)]
        return attrs.evolve(store, copies=copies)
    store = _make_room(store, node, tier + 1)
    copies = dict(store.copies)
    copies[(node, victim)] = attrs.evolve(copies[(node, victim)], tier=tier + 1)
    return attrs.evolve(store, copies=copies)


def _place(store: Store, node: int, key: Key, copy: Copy) -> Store:
    """Put ``copy`` (not yet in the store) into the GPU tier of ``node``, making room."""
    store = _make_room(store, node, 0)
    return attrs.evolve(store, copies={**store.copies, (node, key): attrs.evolve(copy, tier=0)})


def _without(store: Store, node: int, key: Key) -> Store:
    copies = dict(store.copies)
    del copies[(node, key)]
    return attrs.evolve(store, copies=copies)


def put(store: Store, node: int, key: Key, tokens: Sequence[int]) -> Store:
    """Write a computed block into ``node``'s GPU tier and update every replica's contents."""
    _live_node(store, node)
    if key is None:
        raise InvalidOperation("None is not a block key")
    tokens = tuple(tokens)
    if not tokens or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in tokens):
        raise InvalidOperation(f"a block's contents are one or more token ids, got {tokens!r}")
    replicas = {n: c for (n, k), c in store.copies.items() if k == key}
    stale_pinned = sorted(n for n, c in replicas.items() if c.pins and c.tokens != tokens)
    if stale_pinned:
        raise InvalidOperation(f"block {key!r} is in flight on node(s) {stale_pinned}: re-put it after the transfer")
    clock = store.clock + 1
    copies = {
        place: attrs.evolve(copy, tokens=tokens) if place[1] == key else copy for place, copy in store.copies.items()
    }
    store = attrs.evolve(store, copies=copies, clock=clock)
    mine = store.copies.get((node, key))
    if mine is None:
        return _place(store, node, key, Copy(tier=0, tokens=tokens, uses=1, last_use=clock))
    used = attrs.evolve(mine, uses=mine.uses + 1, last_use=clock)
    if mine.pins or mine.tier == 0:
        return attrs.evolve(store, copies={**store.copies, (node, key): used})
    return _place(_without(store, node, key), node, key, used)


def get(store: Store, node: int, key: Key) -> tuple[Store, Tokens | None]:
    """The node's contents of ``key`` (None: a miss); a hit is a use and promotes the copy."""
    _live_node(store, node)
    mine = store.copies.get((node, key))
    if mine is None:
        return store, None
    clock = store.clock + 1
    used = attrs.evolve(mine, uses=mine.uses + 1, last_use=clock)
    in_place = attrs.evolve(store, copies={**store.copies, (node, key): used}, clock=clock)
    if mine.pins or mine.tier == 0:
        return in_place, mine.tokens
    try:
        return _place(_without(in_place, node, key), node, key, used), mine.tokens
    except OutOfBlocks:  # every GPU block pinned: read it where it is
        return in_place, mine.tokens


def demote(store: Store, node: int, tier: int) -> tuple[Store, Key | None]:
    """Move the tier's victim one tier down, making room below; answers its key."""
    _live_node(store, node)
    _tier(tier)
    if tier == len(TIERS) - 1:
        raise InvalidOperation(f"{TIERS[tier]} is the last tier: evict from it instead")
    victim = _victim(store, node, tier)
    if victim is None:
        return store, None
    store = _make_room(store, node, tier + 1)
    moved = attrs.evolve(store.copies[(node, victim)], tier=tier + 1)
    return attrs.evolve(store, copies={**store.copies, (node, victim): moved}), victim


def evict(store: Store, node: int, tier: int) -> tuple[Store, Key | None]:
    """Drop the tier's victim; answers its key."""
    _live_node(store, node)
    _tier(tier)
    victim = _victim(store, node, tier)
    if victim is None:
        return store, None
    return _without(store, node, victim), victim


def replicate(store: Store, key: Key, source: int, target: int) -> Store:
    """Copy ``source``'s block into ``target``'s GPU tier."""
    _live_node(store, source)
    _live_node(store, target)
    copy = _held(store, source, key)
    if (target, key) in store.copies:
        raise InvalidOperation(f"node {target} already holds block {key!r}")
    clock = store.clock + 1
    fresh = Copy(tier=0, tokens=copy.tokens, uses=1, last_use=clock)
    return _place(attrs.evolve(store, clock=clock), target, key, fresh)


def pin(store: Store, node: int, key: Key) -> Store:
    _live_node(store, node)
    copy = _held(store, node, key)
    return attrs.evolve(store, copies={**store.copies, (node, key): attrs.evolve(copy, pins=copy.pins + 1)})


def unpin(store: Store, node: int, key: Key) -> Store:
    _live_node(store, node)
    copy = _held(store, node, key)
    if copy.pins == 0:
        raise InvalidOperation(f"block {key!r} on node {node} is not pinned")
    return attrs.evolve(store, copies={**store.copies, (node, key): attrs.evolve(copy, pins=copy.pins - 1)})


def fail(store: Store, node: int) -> Store:
    """A node fault: its copies and pins vanish and it stops answering."""
    _live_node(store, node)
    alive = tuple(a and n != node for n, a in enumerate(store.alive))
    return attrs.evolve(store, alive=alive, copies={p: c for p, c in store.copies.items() if p[0] != node})


def restart(store: Store, node: int) -> Store:
    """Bring a failed node back, empty."""
    if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(store.alive):
        raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(store.alive) - 1})")
    if store.alive[node]:
        raise InvalidOperation(f"node {node} is alive: only a failed node restarts")
    return attrs.evolve(store, alive=tuple(a or n == node for n, a in enumerate(store.alive)))


def lookup(store: Store, key: Key) -> tuple[Location, ...]:
    return tuple(sorted((node, copy.tier) for (node, k), copy in store.copies.items() if k == key))


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
                return f"node {node}'s {TIERS[tier]} tier holds {len(keys)} blocks, capacity {state.capacities[tier]}"
    return None


@invariant("a pinned copy is being transferred: evicting or moving it makes the transfer read freed memory", "safety")
def invariant_pinned_never_evicted(before: StoreState, after: StoreState) -> str | None:
    for (node, key), pins in before.pins.items():
        if not after.alive[node]:
            continue
        if (
            after.location(node, key) != before.location(node, key)
            or after.contents.get((node, key)) != before.contents[(node, key)]
        ):
            return (
                f"pinned block {key!r} ({pins} pin(s)) left node {node}'s {TIERS[before.location(node, key)[1]]} tier"  # type: ignore[index]
            )
    return None


@invariant("demotion moves a block down a tier; a copy may be lost only by choosing it for eviction", "safety")
def invariant_demotion_keeps_the_block(
    before: StoreState, after: StoreState, chosen: Sequence[tuple[int, Key]]
) -> str | None:
    lost = [place for place in _held_copies(before) if place not in after.contents and place not in chosen]
    lost = [(node, key) for node, key in lost if after.alive[node]]
    if lost:
        return f"copies {lost} vanished without being chosen for eviction (chosen: {list(chosen)})"
    return None


@invariant("replicas of one key serve the same prefix: a stale one gives some requests KV of other tokens", "safety")
def invariant_replicas_agree(state: StoreState) -> str | None:
    seen: dict[Key, tuple[int, Tokens]] = {}
    for (node, key), tokens in state.contents.items():
        first = seen.setdefault(key, (node, tokens))
        if first[1] != tokens:
            return f"block {key!r} holds {first[1]} on node {first[0]} but {tokens} on node {node}"
    return None


@invariant("reuse is correct only if a hit reads the very tokens that were put under the key", "safety")
def invariant_get_returns_put(key: Key, written: Tokens, read: Tokens | None) -> str | None:
    if read is not None and read != written:
        return f"get({key!r}) read {read}, but {written} was put"
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
