"""Layer 7's state: what a snapshot shows (``StoreState``) and the model's value (``Store``, ``Copy``).

Each copy carries its tier, contents, use count and clock of last use (policy
order is a sort: ``spec.kv_store_policies``), its pins, whether it is still
pending, when its read lease ends and, for ARC, whether it was used again
since it was stored.  The store carries the declared ``StoreConventions``,
model time (``now``, moved only by ``advance``) and each ARC tier's ghosts.
``abstract`` is the model's abstraction function; ``spec.kv_store_model``
holds the transitions, ``spec.kv_store`` the rules.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import attrs

from kvspec.spec.conventions import StoreConventions, StorePolicy
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.kv_store_policies import STORE_POLICIES, ArcLists, Ghosts, arc_lists
from kvspec.spec.kv_store_policies import eviction_order as policy_order

REFERENCE_STORE = StoreConventions()  # what the reference declares
TIERS: tuple[str, ...] = REFERENCE_STORE.tiers  # every node of the reference has all three
Key = Hashable
Tokens = tuple[int, ...]
Location = tuple[int, int]  # (node, tier)
Place = tuple[int, Key]  # (node, key): one node's copy


@attrs.frozen
class StoreState:
    """The abstract state of a store: what ``snapshot()`` returns."""

    capacities: tuple[int, ...]
    alive: tuple[bool, ...]
    tiers: tuple[tuple[tuple[Key, ...], ...], ...]  # [node][tier]: keys in eviction order, head first
    contents: Mapping[Place, Tokens]  # (node, key) -> tokens
    pins: Mapping[Place, int]  # (node, key) -> pins, only positive counts
    directory: Mapping[Key, tuple[Location, ...]]  # what lookups answer, locations sorted
    names: tuple[str, ...] = TIERS  # the tiers' names, fastest first
    pending: frozenset[Place] = frozenset()  # copies stored but not yet completed: not readable
    leases: Mapping[Place, float] = attrs.field(factory=dict)  # copy -> model time its read lease ends
    arc: Mapping[Location, ArcLists] = attrs.field(factory=dict)  # each ARC tier's lists

    def location(self, node: int, key: Key) -> Location | None:
        for tier, keys in enumerate(self.tiers[node]):
            if key in keys:
                return node, tier
        return None


@attrs.frozen
class Copy:
    """One node's copy of a block."""

    tier: int
    tokens: Tokens
    uses: int
    last_use: int
    pins: int = 0
    ready: bool = True  # False: a pending store
    lease_until: float = 0.0  # leased while the store's time is before this
    frequent: bool = False  # used again since it was stored (ARC's T2)


@attrs.frozen
class Store:
    capacities: tuple[int, ...]
    policies: tuple[StorePolicy, ...]
    alive: tuple[bool, ...]
    copies: Mapping[Place, Copy]
    clock: int = 0
    conventions: StoreConventions = REFERENCE_STORE
    now: float = 0.0  # model time, in seconds
    ghosts: Mapping[Location, Ghosts] = attrs.field(factory=dict)  # ARC tiers only


def new_store(
    nodes: int,
    capacities: Sequence[int],
    policies: Sequence[StorePolicy],
    conventions: StoreConventions = REFERENCE_STORE,
) -> Store:
    """An empty store of ``nodes`` live nodes; one capacity and one policy per declared tier."""
    tiers = conventions.tiers
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise InvalidOperation(f"a store needs a positive number of nodes, got {nodes!r}")
    if conventions.max_nodes is not None and nodes > conventions.max_nodes:
        raise InvalidOperation(f"this store has at most {conventions.max_nodes} node(s), not {nodes}")
    if len(capacities) != len(tiers) or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in capacities):
        raise InvalidOperation(f"need a positive capacity for each tier {tiers}, got {tuple(capacities)!r}")
    supported = [p for p in conventions.policies if p in STORE_POLICIES]
    if len(policies) != len(tiers) or any(p not in supported for p in policies):
        raise InvalidOperation(f"need a policy from {tuple(supported)} for each tier {tiers}, got {tuple(policies)!r}")
    return Store(
        capacities=tuple(capacities),
        policies=tuple(policies),
        alive=(True,) * nodes,
        copies={},
        conventions=conventions,
    )


# -- reading the model ---------------------------------------------------------------


def last_tier(store: Store) -> int:
    return len(store.capacities) - 1


def entries(store: Store, node: int, tier: int) -> list[tuple[Key, Copy]]:
    return [(key, copy) for (n, key), copy in store.copies.items() if n == node and copy.tier == tier]


def ghosts(store: Store, node: int, tier: int) -> Ghosts:
    return store.ghosts.get((node, tier), Ghosts())


def eviction_order(store: Store, node: int, tier: int) -> tuple[Key, ...]:
    """The keys of one tier of one node, the first victim at the head; where the engine picks its own victims
    there is no order to state, and the keys are listed by repr."""
    if store.conventions.victims == "engine":
        return tuple(sorted((key for key, _ in entries(store, node, tier)), key=repr))
    return policy_order(store.policies[tier], entries(store, node, tier), ghosts(store, node, tier))


def leased(store: Store, copy: Copy) -> bool:
    return copy.lease_until > store.now


def in_use(store: Store, copy: Copy) -> bool:
    """Pinned, leased or pending: never evicted, demoted, promoted or removed."""
    return bool(copy.pins) or not copy.ready or leased(store, copy)


def abstract(store: Store) -> StoreState:
    """The abstraction of the model, comparable with an implementation's snapshot."""
    directory: dict[Key, list[Location]] = {}
    for (node, key), copy in store.copies.items():
        directory.setdefault(key, []).append((node, copy.tier))
    nodes, tiers = range(len(store.alive)), range(len(store.capacities))
    return StoreState(
        capacities=store.capacities,
        alive=store.alive,
        tiers=tuple(tuple(eviction_order(store, node, tier) for tier in tiers) for node in nodes),
        contents={place: copy.tokens for place, copy in store.copies.items()},
        pins={place: copy.pins for place, copy in store.copies.items() if copy.pins},
        directory={key: tuple(sorted(places)) for key, places in directory.items()},
        names=store.conventions.tiers,
        pending=frozenset(place for place, copy in store.copies.items() if not copy.ready),
        leases={place: copy.lease_until for place, copy in store.copies.items() if leased(store, copy)},
        arc={
            (node, tier): arc_lists(entries(store, node, tier), ghosts(store, node, tier))
            for node in nodes
            for tier in tiers
            if store.policies[tier] == "arc" and store.alive[node]
        },
    )
