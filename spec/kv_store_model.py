"""Layer 7's transitions: every operation of the store as a pure function of the model (``spec.kv_store``).

A transition returns the new ``Store`` (and the operation's answer) or raises
``InvalidOperation`` (out of contract) or ``OutOfBlocks`` (no room), changing
nothing -- but for a put, whose refusal may adapt the policy where the
conventions say so (``refused_put``: the machines apply it after a refusal).  Room is made by cascading victims down the tiers (``free_slot``);
a tier whose eviction runs in the background refuses instead, until ``settle``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.kv_store_policies import Ghosts, arc_admit, arc_enter, arc_leave
from kvspec.spec.kv_store_policies import victim as policy_victim
from kvspec.spec.kv_store_state import (
    Copy,
    Key,
    Location,
    Place,
    Store,
    Tokens,
    entries,
    ghosts,
    in_use,
    last_tier,
)

# -- checks ---------------------------------------------------------------------------


def live_node(store: Store, node: object) -> int:
    if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(store.alive):
        raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(store.alive) - 1})")
    if not store.alive[node]:
        raise InvalidOperation(f"node {node} has failed; restart it first")
    return node


def check_tier(store: Store, tier: object) -> int:
    names = store.conventions.tiers
    if not isinstance(tier, int) or isinstance(tier, bool) or not 0 <= tier < len(names):
        raise InvalidOperation(f"tier {tier!r} is not a tier (0..{len(names) - 1}: {', '.join(names)})")
    return tier


def held(store: Store, node: int, key: Key) -> Copy:
    copy = store.copies.get((node, key))
    if copy is None:
        raise InvalidOperation(f"node {node} holds no block {key!r}")
    return copy


def check_tokens(tokens: Sequence[int]) -> Tokens:
    contents = tuple(tokens)
    if not contents or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in contents):
        raise InvalidOperation(f"a block's contents are one or more token ids, got {contents!r}")
    return contents


# -- moving copies ----------------------------------------------------------------------


def with_copy(store: Store, node: int, key: Key, copy: Copy) -> Store:
    return attrs.evolve(store, copies={**store.copies, (node, key): copy})


def without(store: Store, node: int, key: Key) -> Store:
    copies = dict(store.copies)
    del copies[(node, key)]
    return attrs.evolve(store, copies=copies)


def with_ghosts(store: Store, node: int, tier: int, kept: Ghosts) -> Store:
    if store.policies[tier] != "arc":
        return store
    return attrs.evolve(store, ghosts={**store.ghosts, (node, tier): kept})


def victim(store: Store, node: int, tier: int) -> Key | None:
    """The copy the tier's policy gives up next, among those not in use."""
    return policy_victim(
        store.policies[tier],
        entries(store, node, tier),
        ghosts(store, node, tier),
        lambda key: not in_use(store, store.copies[(node, key)]),
    )


def leave_as_victim(store: Store, node: int, key: Key) -> Store:
    """``key``'s copy was chosen to leave its tier: an ARC tier remembers it."""
    copy = store.copies[(node, key)]
    tier = copy.tier
    return with_ghosts(
        store, node, tier, arc_leave(ghosts(store, node, tier), key, copy.frequent, store.capacities[tier])
    )


def enter(store: Store, node: int, tier: int, key: Key) -> Store:
    """A copy is about to enter ``tier`` under ``key``: an ARC tier adapts to a ghost hit."""
    return with_ghosts(store, node, tier, arc_enter(ghosts(store, node, tier), key, store.capacities[tier]))


def settle_in(store: Store, node: int, key: Key, copy: Copy) -> Store:
    """Put ``copy`` into its tier and let an ARC tier forget the ghost of its key."""
    store = with_copy(store, node, key, copy)
    return with_ghosts(store, node, copy.tier, arc_admit(ghosts(store, node, copy.tier), key))


def free_slot(store: Store, node: int, tier: int) -> Store:
    """Free one slot of ``tier`` by cascading its victim down (the last tier drops it); ``OutOfBlocks`` if
    nothing can move."""
    chosen = victim(store, node, tier)
    if chosen is None:
        raise OutOfBlocks(1, 0, what=f"unpinned slots in node {node}'s {store.conventions.tiers[tier]} tier")
    store = leave_as_victim(store, node, chosen)
    if tier == last_tier(store):
        return without(store, node, chosen)
    return move_down(store, node, chosen)


def move_down(store: Store, node: int, key: Key) -> Store:
    """Move ``key``'s copy one tier down, making room there as a put would."""
    below = store.copies[(node, key)].tier + 1
    store = make_room(enter(store, node, below, key), node, below)
    return settle_in(store, node, key, attrs.evolve(store.copies[(node, key)], tier=below))


def make_room(store: Store, node: int, tier: int) -> Store:
    """Room for one more copy in ``tier``: a full tier evicts now, or -- when eviction runs in the
    background -- refuses with ``OutOfBlocks`` until ``settle``."""
    if len(entries(store, node, tier)) < store.capacities[tier]:
        return store
    if store.conventions.eviction == "background":
        raise OutOfBlocks(1, 0, what=f"free slots in node {node}'s {store.conventions.tiers[tier]} tier (evicting)")
    return free_slot(store, node, tier)


def place(store: Store, node: int, key: Key, copy: Copy) -> Store:
    """Put ``copy`` (not in the store) into the first tier of ``node``, making room."""
    store = make_room(enter(store, node, 0, key), node, 0)
    return settle_in(store, node, key, attrs.evolve(copy, tier=0))


def use(store: Store, node: int, key: Key) -> Store:
    """Count a use of the node's copy: its count, its recency and, for ARC, the frequent list."""
    copy = store.copies[(node, key)]
    clock = store.clock + 1
    used = attrs.evolve(copy, uses=copy.uses + 1, last_use=clock, frequent=True)
    return with_copy(attrs.evolve(store, clock=clock), node, key, used)


def promote(store: Store, node: int, key: Key) -> Store:
    """Move the node's copy to the first tier; as it was when there is no room there (or it must stay)."""
    copy = store.copies[(node, key)]
    if copy.tier == 0 or not store.conventions.promotion or in_use(store, copy):
        return store
    try:
        return place(without(store, node, key), node, key, copy)
    except OutOfBlocks:
        return store


def over_watermark(store: Store, node: int, tier: int) -> bool:
    mark = max(1, math.ceil(store.conventions.watermark * store.capacities[tier]))
    return len(entries(store, node, tier)) >= mark


# -- the operations ----------------------------------------------------------------------


def put(store: Store, node: int, key: Key, tokens: Sequence[int]) -> Store:
    """Write a computed block into ``node``'s first tier, as the conventions say a re-put does."""
    live_node(store, node)
    if key is None:
        raise InvalidOperation("None is not a block key")
    contents = check_tokens(tokens)
    replicas = {n: copy for (n, k), copy in store.copies.items() if k == key}
    reput = store.conventions.reput
    if replicas and reput != "refresh":  # immutable contents: the key names one block for good
        mine = replicas.get(node)
        return use(store, node, key) if reput == "touch" and mine is not None and mine.ready else store
    stale = sorted(n for n, copy in replicas.items() if in_use(store, copy) and copy.tokens != contents)
    if stale:
        raise InvalidOperation(f"block {key!r} is in flight on node(s) {stale}: re-put it after the transfer")
    copies = {place: attrs.evolve(c, tokens=contents) if place[1] == key else c for place, c in store.copies.items()}
    store = attrs.evolve(store, copies=copies)
    if node not in replicas:
        return copy_in(store, node, key, contents, ready=store.conventions.stores == "immediate")
    moving = replicas[node].tier != 0 and store.conventions.promotion and not in_use(store, replicas[node])
    store = use(store, node, key)
    return place(without(store, node, key), node, key, store.copies[(node, key)]) if moving else store


def refused_put(store: Store, node: int, key: Key) -> Store:
    """The model after a put of ``key`` onto ``node`` was refused for want of room (``OutOfBlocks``): as it was,
    unless the conventions let a refusal adapt the policy (``refusal_adapts_policy``, a marked replacement): then
    the node's first tier has seen the key as a store miss, as a put that goes ahead sees it before it makes room
    (``enter``: an ARC tier adapts its target to a ghost hit)."""
    if not store.conventions.refusal_adapts_policy or (node, key) in store.copies:
        return store
    return enter(store, node, 0, key)


def get(store: Store, node: int, key: Key) -> tuple[Store, Tokens | None]:
    """The node's contents of ``key`` (None: a miss, or still pending); a hit is a use, is promoted and leased."""
    live_node(store, node)
    mine = store.copies.get((node, key))
    if mine is None or not mine.ready:
        return store, None
    store = promote(use(store, node, key), node, key)
    lease = store.conventions.read_lease
    if lease:
        copy = store.copies[(node, key)]
        store = with_copy(store, node, key, attrs.evolve(copy, lease_until=max(copy.lease_until, store.now + lease)))
    return store, mine.tokens


def demote(store: Store, node: int, tier: int) -> tuple[Store, Key | None]:
    """Move the tier's victim one tier down, making room below; answers its key."""
    live_node(store, node)
    check_tier(store, tier)
    if tier == last_tier(store):
        raise InvalidOperation(f"{store.conventions.tiers[tier]} is the last tier: evict from it instead")
    chosen = victim(store, node, tier)
    if chosen is None:
        return store, None
    return move_down(leave_as_victim(store, node, chosen), node, chosen), chosen


def evict(store: Store, node: int, tier: int) -> tuple[Store, Key | None]:
    """Drop the tier's victim; answers its key."""
    live_node(store, node)
    check_tier(store, tier)
    chosen = victim(store, node, tier)
    if chosen is None:
        return store, None
    return without(leave_as_victim(store, node, chosen), node, chosen), chosen


def replicate(store: Store, key: Key, source: int, target: int) -> Store:
    """Copy ``source``'s block into ``target``'s first tier (a transfer, not a use: the copy starts with one)."""
    live_node(store, source)
    live_node(store, target)
    copy = held(store, source, key)
    if not copy.ready:
        raise InvalidOperation(f"block {key!r} on node {source} is still being stored")
    if (target, key) in store.copies:
        raise InvalidOperation(f"node {target} already holds block {key!r}")
    return copy_in(store, target, key, copy.tokens)


def copy_in(store: Store, node: int, key: Key, tokens: Tokens, ready: bool = True) -> Store:
    """A fresh copy of ``key`` (written or transferred, not yet used again: one use) in ``node``'s first tier."""
    clock = store.clock + 1
    fresh = Copy(tier=0, tokens=tokens, uses=1, last_use=clock, ready=ready)
    return place(attrs.evolve(store, clock=clock), node, key, leased_from_the_start(store, fresh))


def leased_from_the_start(store: Store, copy: Copy) -> Copy:
    """A new copy, leased at once where the conventions say stored copies are."""
    if not store.conventions.leases_new_copies:
        return copy
    return attrs.evolve(copy, lease_until=store.now + store.conventions.read_lease)


def pin(store: Store, node: int, key: Key) -> Store:
    live_node(store, node)
    copy = held(store, node, key)
    if not copy.ready:
        raise InvalidOperation(f"block {key!r} on node {node} is still being stored: nothing to transfer yet")
    return with_copy(store, node, key, attrs.evolve(copy, pins=copy.pins + 1))


def unpin(store: Store, node: int, key: Key) -> Store:
    live_node(store, node)
    copy = held(store, node, key)
    if copy.pins == 0:
        raise InvalidOperation(f"block {key!r} on node {node} is not pinned")
    return with_copy(store, node, key, attrs.evolve(copy, pins=copy.pins - 1))


def fail(store: Store, node: int) -> Store:
    """A node fault: its copies, pins and ghosts vanish and it stops answering."""
    live_node(store, node)
    alive = tuple(a and n != node for n, a in enumerate(store.alive))
    copies = {place: copy for place, copy in store.copies.items() if place[0] != node}
    remembered = {at: kept for at, kept in store.ghosts.items() if at[0] != node}
    return attrs.evolve(store, alive=alive, copies=copies, ghosts=remembered)


def restart(store: Store, node: int) -> Store:
    """Bring a failed node back, empty."""
    if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(store.alive):
        raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(store.alive) - 1})")
    if store.alive[node]:
        raise InvalidOperation(f"node {node} is alive: only a failed node restarts")
    return attrs.evolve(store, alive=tuple(a or n == node for n, a in enumerate(store.alive)))


def lookup(store: Store, key: Key) -> tuple[Location, ...]:
    return tuple(sorted((node, copy.tier) for (node, k), copy in store.copies.items() if k == key))


def find(store: Store, node: int, key: Key) -> str:
    """Whether the node can serve ``key``: "hit", "pending" (stored, not yet completed) or "miss"."""
    live_node(store, node)
    copy = store.copies.get((node, key))
    return "miss" if copy is None else ("hit" if copy.ready else "pending")


def complete(store: Store, node: int, key: Key, ok: bool) -> Store:
    """A pending store finished: the copy becomes readable, or -- the transfer failed -- is gone.  Transfer
    workers report asynchronously: a completion for a copy that is not pending changes nothing."""
    live_node(store, node)
    if not isinstance(ok, bool):
        raise InvalidOperation(f"a store completes ok (True) or failed (False), not {ok!r}")
    copy = store.copies.get((node, key))
    if copy is None or copy.ready:
        return store
    return with_copy(store, node, key, attrs.evolve(copy, ready=True)) if ok else without(store, node, key)


def remove(store: Store, node: int, key: Key) -> Store:
    """Drop the node's copy on request; one in use (pinned, leased, pending) is out of contract."""
    live_node(store, node)
    if in_use(store, held(store, node, key)):
        raise InvalidOperation(f"block {key!r} on node {node} is in use (pinned, leased or being stored)")
    return without(store, node, key)


def advance(store: Store, seconds: float) -> Store:
    """Model time moves on: read leases that end by then are over."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not 0 <= seconds < math.inf:
        raise InvalidOperation(f"time advances by a finite, non-negative number of seconds, not {seconds!r}")
    return attrs.evolve(store, now=store.now + seconds)


def settle(store: Store) -> tuple[Store, tuple[Place, ...]]:
    """Background work done: every tier at its watermark, the last tier first, gives up victims -- down a
    tier with room, or out of the last -- until it is below the watermark or nothing can go.  Answers the
    copies dropped (by repr).  Engine-picked victims are the machine's to apply (``evicted_by_engine``);
    on-demand eviction leaves nothing to do."""
    conventions = store.conventions
    if conventions.eviction == "on_demand" or conventions.victims == "engine":
        return store, ()
    before = set(store.copies)
    for node in (n for n, up in enumerate(store.alive) if up):
        for tier in reversed(range(len(store.capacities))):
            while over_watermark(store, node, tier):
                try:
                    store = free_slot(store, node, tier)
                except OutOfBlocks:
                    break
    return store, tuple(sorted(before - set(store.copies), key=repr))


def evicted_by_engine(store: Store, places: Sequence[Place]) -> Store:
    """The model after an engine's own background evictor dropped ``places`` (``victims="engine"``)."""
    for node, key in places:
        if (node, key) in store.copies:
            store = without(leave_as_victim(store, node, key), node, key)
    return store
