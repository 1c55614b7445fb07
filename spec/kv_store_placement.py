"""Layer 7, where copies go: replicated puts on distinct nodes, and each tier's own eviction order.

Rules (Mooncake §4: a put names a replica count, the master places the
replicas on distinct segments; vLLM's and LMCache's offloading keep each tier
in their policy's order):

* ``put_replicated(node, key, tokens, factor)`` -- the optional operation
  ``replicated_puts`` -- is a ``put`` on ``node`` (every rule of ``put``
  holds for it), then the block is copied, as ``replicate`` copies it, onto
  the next live nodes in ring order (``node + 1``, ``node + 2``, ... mod the
  node count) until ``factor`` distinct live nodes hold it: a node already
  holding the key counts, since the put gave it the new contents.  The copies
  are fresh stores (pending where stores are pending: each replica is a
  transfer of its own).  It answers the nodes that hold the key, sorted.  All
  or nothing: with no room on one of them it raises ``OutOfBlocks`` and
  changes nothing.  A factor outside ``1..`` the live nodes is an
  ``InvalidOperation``: ``factor`` distinct nodes cannot be found.  Where
  contents are immutable (``reput`` ``touch`` or ``skip``) and the store
  holds the key already, it is that ``put`` and places nothing.
* **Durability** -- once a replicated put has written, ``factor`` distinct
  live nodes hold the key with its tokens, so any ``factor - 1`` node faults
  leave it readable.  Two replicas on one node count once: a fault takes both.
* **Each tier's order** -- every tier of every node lists its keys in its own
  policy's eviction order (``spec.kv_store_policies``), whichever tier a copy
  came from.  The states that tell a policy from an arrival queue are the
  ones where copies reach a tier out of recency order: demoted by an LFU tier
  above (the least used first, not the least recent), held up by a pin while
  younger copies went down, or read in place on the last tier (no promotion,
  or a copy in use) -- a FIFO in that tier gives up the wrong victim.
* **A call the spec refuses** -- when a store carries out a call the model
  refuses for want of room (a put into a full tier that the store accepts),
  the caller holds what it wrote, and the safety rules judge that call as
  every other, on the store's own states and the caller's ledger: nothing in
  use moves, and a copy leaves its node only from a last tier that needed
  the room.

Invariants:

* ``invariant_replicas_on_distinct_nodes`` -- a replicated put that wrote
  leaves ``factor`` distinct live nodes holding the key with its tokens, or a
  fault the caller was told it could survive loses the block.
* ``invariant_tier_eviction_order`` -- each tier of each node lists exactly the
  model's copies in its policy's order, or the next victim taken there is not
  the one the declared policy gives up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvspec.spec.components import optional_operation
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import invariant
from kvspec.spec.kv_store import KVStore
from kvspec.spec.kv_store_model import check_tokens, copy_in, live_node, put
from kvspec.spec.kv_store_state import Key, Store, StoreState, Tokens

__all__ = [
    "holders",
    "invariant_replicas_on_distinct_nodes",
    "invariant_tier_eviction_order",
    "put_replicated",
    "ring",
]


@runtime_checkable
class ReplicatingStore(KVStore, Protocol):
    """A store that places a put's copies itself (``kv_store``'s optional ``replicated_puts``)."""

    def put_replicated(self, node: int, key: Key, tokens: Sequence[int], factor: int) -> tuple[int, ...]:
        """A put on ``node``, then fresh copies on the next live nodes in ring order: the nodes that hold one."""
        ...


REPLICATED_PUTS = optional_operation("replicated_puts", ReplicatingStore, "put_replicated", kinds=("kv_store",))


def ring(alive: Sequence[bool], node: int) -> list[int]:
    """The live nodes in ring order from ``node`` (first)."""
    count = len(alive)
    return [(node + step) % count for step in range(count) if alive[(node + step) % count]]


def holders(store: Store, key: Key) -> tuple[int, ...]:
    return tuple(sorted(n for n, k in store.copies if k == key))


def put_replicated(
    store: Store, node: int, key: Key, tokens: Sequence[int], factor: int
) -> tuple[Store, tuple[int, ...]]:
    """A put on ``node``, then copies onto the next live nodes in ring order until ``factor`` hold the key."""
    live_node(store, node)
    live = ring(store.alive, node)
    if not isinstance(factor, int) or isinstance(factor, bool) or not 1 <= factor <= len(live):
        raise InvalidOperation(f"a put cannot place {factor!r} replicas on distinct nodes: {len(live)} are live")
    held_before = any(k == key for _, k in store.copies)
    store = put(store, node, key, tokens)
    if held_before and store.conventions.reput != "refresh":  # immutable: the key already names its block
        return store, holders(store, key)
    ready = store.conventions.stores == "immediate"
    for target in live[1:factor]:
        if (target, key) not in store.copies:
            store = copy_in(store, target, key, check_tokens(tokens), ready)
    return store, holders(store, key)


@invariant(
    "a replicated put promises that any factor - 1 node faults leave the block readable: two replicas on one node, "
    "or one too few, lose it to a fault the caller was told it survives",
    "safety",
    needs=(REPLICATED_PUTS,),
)
def invariant_replicas_on_distinct_nodes(after: StoreState, key: Key, tokens: Tokens, factor: int) -> str | None:
    nodes = sorted(n for (n, k), held in after.contents.items() if k == key and held == tokens and after.alive[n])
    if len(nodes) < factor:
        faults = f"a fault of node(s) {nodes[: factor - 1]}" if nodes else "nothing at all"
        return (
            f"a put of {key!r} with {factor} replicas left it on {len(nodes)} live node(s) {nodes}: {faults} loses it"
        )
    return None


@invariant(
    "the declared policy says which copy a tier gives up next: a tier that lists (and so evicts) its copies in "
    "another order -- their arrival, say -- drops blocks the policy keeps",
    "convention",
)
def invariant_tier_eviction_order(actual: StoreState, expected: StoreState) -> str | None:
    for node, (listed, modelled) in enumerate(zip(actual.tiers, expected.tiers, strict=False)):
        for tier, (keys, order) in enumerate(zip(listed, modelled, strict=False)):
            if keys != order:
                return (
                    f"node {node}'s {actual.names[tier]} tier lists {list(keys)}; its policy's order is {list(order)}"
                )
    return None
