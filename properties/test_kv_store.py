"""Layer 7 conformance: the tiered KV store against ``kvspec.spec.kv_store``'s model.

The machine drives put / get / demote / evict / replicate / pin / unpin /
lookup, valid and invalid, on tiny clusters (1-3 nodes, 1-3 blocks per tier)
where every tier overflows, in the shape the store declares (its tiers, at
most how many nodes).  A **node fault** is an operation like any other
(S3 ShardStore style); after one the machine checks that only that node's
copies went, and asks the store for every block the node held.  ``serve``
plays a request for a document: it looks each block up, reads it locally,
pulls a replica, or -- when the prefix was lost -- recomputes it from the
document's tokens and puts it back, and must read exactly the document.
What a store offers beyond that is driven too: pending stores completed or
failed, model time advanced past read leases, copies removed (in use: out of
contract), replicated puts (often followed by factor - 1 faults of their
holders and a read of what is left), and -- where eviction runs in the
background -- ``settle`` after every operation, before anything is compared.
Every run starts with a node's copies sunk to its last tier and the first to
arrive read there in place, so that the last tier holds copies out of arrival
order (``spec.kv_store_placement``); puts onto a first tier full of copies
being read are refused for want of room, and a store that carries one out all
the same is judged on that call by the rules of its own states.
The safety rules read only the store's own snapshots and answers and the
caller's ledger: what it wrote under each key (as the store took it), and
which copies each call asked to go (a remove, a failed store, an evict's or
the background evictor's answered victims).  The model chooses calls and,
after every call, judges the declared conventions (the refinement).
The search revisits: a put, get or replication refused (no unpinned room, a
dead node) is retried after an unpin, a restart or a settle, and documents
are served again, often after eviction or a fault took some of their blocks
-- both also drawn inside the common rules, so that swarm testing never turns
them off.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.impl.kv_store import with_conventions
from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_settings, conformance_test, run_machine
from kvspec.spec import invariants
from kvspec.spec import kv_store as model
from kvspec.spec import kv_store_model as transitions
from kvspec.spec import kv_store_placement as placement
from kvspec.spec.components import Offer, every_operation
from kvspec.spec.conventions import Conventions, StoreConventions
from kvspec.spec.errors import KVSpecError, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.kv_store import Key, Place, StoreState, Tokens

KEYS = st.sampled_from([f"h{i}" for i in range(4)])
CONTENTS = st.sampled_from([(1, 2), (3, 4), (5,), (6, 7)])
BLOCK_TOKENS = 2
DOCUMENTS = ((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 7, 8), (9, 9, 9, 9))  # the first two share two blocks


def document_blocks(document: Tokens) -> list[tuple[Key, Tokens]]:
    """Each full block under its ideal chained key: the whole prefix up to its end."""
    ends = range(BLOCK_TOKENS, len(document) + 1, BLOCK_TOKENS)
    return [(("doc", document[:end]), document[end - BLOCK_TOKENS : end]) for end in ends]


class KVStoreMachine(LockstepMachine):
    uses = frozenset({"kv_store"})
    judges = ("kv_store", "kv_store_placement", "invariants")
    node_counts = (2, 1, 3, 2, 3)  # replicas and faults need company (the ends are drawn most often)
    capacities = st.integers(1, 3)
    last_capacities = st.sampled_from([2, 1, 3])  # mostly room for two: only then can copies sit out of order

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        declared = self.conventions.store
        counts = [n for n in self.node_counts if declared.max_nodes is None or n <= declared.max_nodes]
        nodes = data.draw(st.sampled_from(counts), label="nodes")
        capacities = tuple(
            data.draw(self.capacities if tier != declared.tiers[-1] else self.last_capacities, label=f"{tier} capacity")
            for tier in declared.tiers
        )
        policies = tuple(
            data.draw(st.sampled_from(declared.policies), label=f"{tier} policy") for tier in declared.tiers
        )
        self.record(f"store = kv_store(nodes={nodes}, capacities={capacities}, policies={policies})")
        store = self.implementation.component("kv_store")(nodes, capacities, policies)
        spec = (model, transitions, placement)
        expected = model.new_store(nodes, capacities, policies, declared)
        self.store = self.subject("store", spec, expected, store, refusal_view=model.kept_by_a_refusal)
        self.written: dict[Key, Tokens] = {}
        self.lost_in_fault: set[Key] = set()
        self.refused: tuple[Callable[..., Any], tuple[Any, ...]] | None = None  # the put, get or replication
        self.served: set[Tokens] = set()
        self.evicted: set[tuple[Place, Tokens]] = set()  # copies that left their node, and what they held
        self.background = declared.eviction == "background" and self.offers("kv_store", model.SETTLE)
        self.arrivals: dict[Place, int] = {}  # copies in their node's last tier -> when they arrived there
        self.arrival_clock = itertools.count()
        # Most runs start with a hot block on two nodes: replicas are rare otherwise, and stale ones hide there.
        if (
            nodes > 1
            and self.offers("kv_store", model.REPLICATE)
            and data.draw(st.integers(0, 7), label="start with a replicated block (unless 0)")
        ):
            key, tokens = data.draw(KEYS, label="key"), data.draw(CONTENTS, label="tokens")
            if self._put(0, key, tokens) and self._complete_if_pending(0, key):
                self._replicate(key, 0, 1)
        if self.replicable_puts():  # and one placed by a replicated put, as Mooncake places a hot block
            key, tokens = data.draw(KEYS, label="key"), data.draw(CONTENTS, label="tokens")
            self.replicated_put(data, 0, key, tokens, st.integers(2, nodes), faults=False)
        # Every run starts with a node's blocks sunk to its last tier, one read there in place: out of arrival
        # order, where a tier kept as a queue gives up the wrong victim -- a state rarely reached otherwise.
        for key in ("h0", "h1"):
            if self._put(0, key, data.draw(CONTENTS, label="tokens")):
                self._complete_if_pending(0, key)
        self.sink(0)

    # -- one lockstep path for every operation ------------------------------------

    def _op(
        self,
        operation: str,
        *args: Any,
        judge: Callable[[StoreState, StoreState, Any], None] = lambda before, after, answer: None,
    ) -> tuple[bool, Any]:
        """Run an operation on both sides and check its transition rules; ``judge`` sees the store before and
        after it and its answer, before that is compared with the spec's.  Where eviction runs in the
        background, ``settle`` follows, checked as a transition of its own.  (ok, the answer)."""
        before = self.store.snapshot()
        modelled = self.modelled()
        targets = {at: ghosts.target for at, ghosts in self.store.model.ghosts.items()}
        answer = self.store(operation, *args, judged_by=None)
        if answer is None:
            self._refused(operation, args)
            self._refines(self.store.snapshot())
            return False, None
        if any(ghosts.target != targets.get(at, 0.0) for at, ghosts in self.store.model.ghosts.items()):
            event("an ARC tier adapted its target to a ghost hit")
        after = self.store.snapshot()
        self._refines(after)
        judge(before, after, answer.actual)
        self.check(invariants.invariant_result_matches_spec, answer.expected, answer.actual, against_model=True)
        named = named_to_go(operation, args)
        self.check(model.invariant_pinned_never_evicted, before, after, named)
        asked = [*named, *taken(operation, args, answer.actual)]
        self.check(model.invariant_demotion_keeps_the_block, before, after, asked)
        self._note_departures(modelled)
        if self.background:
            self._settle()
        self._note_arrivals()
        return True, answer.actual

    def _refines(self, state: StoreState) -> None:
        """The store against the model of its declared conventions, after every call: a choice it did not declare
        shows at the call that made it, before a later answer (a victim, a read) parts the two."""
        expected = model.abstract(self.store.model)
        self.check(placement.invariant_tier_eviction_order, state, expected)
        self.check(model.invariant_store_refines_spec, state, expected)

    def _refused(self, operation: str, args: tuple[Any, ...]) -> None:
        """The store refused the call.  Where the conventions let a put refused for want of room adapt the policy,
        the model takes the spec's refused put (the caller's ledger is untouched: nothing was written)."""
        if operation not in ("put", "put_replicated") or not self.conventions.store.refusal_adapts_policy:
            return
        try:
            self.store.transition(operation)(self.store.model, *args)
        except OutOfBlocks:
            adapted = transitions.refused_put(self.store.model, args[0], args[1])
            if adapted.ghosts != self.store.model.ghosts:
                event("a refused put adapted an ARC tier to its ghost")
            self.store.model = adapted
        except KVSpecError:
            pass

    def modelled(self) -> dict[Place, Tokens]:
        """The copies the model holds, and their contents: what the machine steers by, never what it judges."""
        return {place: copy.tokens for place, copy in self.store.model.copies.items()}

    def _note_departures(self, held: dict[Place, Tokens]) -> None:
        """The copies of ``held`` that left their live node since, as the model has it: a request may store them
        there again (steered by the model, so that an engine's timing never changes what the machine draws)."""
        alive, now = self.store.model.alive, self.modelled()
        self.evicted.update((place, tokens) for place, tokens in held.items() if place not in now and alive[place[0]])

    def _note_arrivals(self) -> None:
        """Record when copies reached their node's last tier, and whether its policy's order is not that
        arrival order: the states where a tier kept as a queue gives up the wrong victim."""
        store = self.store.model
        last = len(store.capacities) - 1
        there = {place for place, copy in store.copies.items() if copy.tier == last}
        self.arrivals = {place: at for place, at in self.arrivals.items() if place in there}
        for place in sorted(there - set(self.arrivals), key=lambda p: store.copies[p].last_use):
            self.arrivals[place] = next(self.arrival_clock)
        if any(self.out_of_arrival_order(node) for node in {node for node, _ in there}):
            event("the last tier's policy order is not its arrival order")

    def out_of_arrival_order(self, node: int) -> bool:
        """Whether the node's last tier would give up its copies in another order than they arrived in."""
        if self.conventions.store.victims == "engine":  # no order to state
            return False
        order = model.eviction_order(self.store.model, node, len(self.store.model.capacities) - 1)
        return list(order) != sorted(order, key=lambda key: self.arrivals[(node, key)])

    def _settle(self) -> None:
        """The background evictor's work, done: it may drop the victims it answers, nothing in use, and no copy
        from an upper tier that it does not move down."""
        before = self.store.snapshot()
        modelled = self.modelled()
        answer = self.store("settle", judged_by=None)
        if answer is None:
            return
        engine_picks = self.conventions.store.victims == "engine"
        if engine_picks:
            self.store.model = transitions.evicted_by_engine(self.store.model, answer.actual)
        after = self.store.snapshot()
        self._refines(after)
        if not engine_picks:
            self.check(invariants.invariant_result_matches_spec, answer.expected, answer.actual, against_model=True)
        self.check(model.invariant_pinned_never_evicted, before, after)
        self.check(model.invariant_demotion_keeps_the_block, before, after, taken("settle", (), answer.actual))
        self._note_departures(modelled)
        if answer.actual:
            event("the background evictor dropped copies")

    def node(self, data: st.DataObject) -> int:
        """Mostly a live node; sometimes a dead one or one that does not exist."""
        alive = [n for n, up in enumerate(self.store.model.alive) if up]
        others = [n for n in range(-1, len(self.store.model.alive) + 1) if n not in alive]
        return data.draw(st.sampled_from(alive * 4 + others), label="node")

    def held(self) -> list[Place]:
        return sorted(self.store.model.copies, key=repr)

    def pending(self) -> list[Place]:
        return [place for place in self.held() if not self.store.model.copies[place].ready]

    # -- rules ------------------------------------------------------------------------

    @rule(data=st.data(), key=KEYS, tokens=CONTENTS)
    def put(self, data: st.DataObject, key: str, tokens: Tokens) -> None:
        """A put; where the store offers them and has company, as often as not a replicated one."""
        self.revisit(data)
        node = self.node(data)
        if self.replicable_puts() and data.draw(st.booleans(), label="with replicas"):
            self.replicated_put(data, node, key, tokens)
        elif self._put(node, key, tokens):
            self.transfer_ends(data, node, key)

    def transfer_ends(self, data: st.DataObject, node: int, key: Key) -> None:
        """Drawn inside the put rules, so that swarm testing never turns it off: where the store is pending, as
        often as not a read races the transfer, which then often ends at once, as often failed as arrived."""
        copy = self.store.model.copies.get((node, key))
        if copy is not None and not copy.ready:
            if data.draw(st.booleans(), label="a read races the store"):
                self._get(node, key)
            outcome = data.draw(st.sampled_from(["pending", "arrived", "failed"]), label="the store's transfer")
            if outcome != "pending":
                self._complete(node, key, outcome == "arrived")

    def revisit(self, data: st.DataObject) -> None:
        """Drawn inside the common rules, so that swarm testing never turns it off: as often as not, the call
        refused last again; as often, a document served before is served again, on the node it was or another."""
        if self.refused is not None and data.draw(st.booleans(), label="retry the refused call first"):
            self.retry_refused()
        if bool(self.served) and data.draw(st.booleans(), label="serve an earlier document"):
            document = data.draw(st.sampled_from(sorted(self.served)), label="earlier document")
            self._serve(data.draw(st.integers(0, len(self.store.model.alive) - 1), label="node"), document)

    def sink(self, node: int) -> None:
        """Every copy of a node's upper tiers goes down, each tier giving them up in its policy's order (an LFU
        tier its least used first, an ARC tier its recent list first), to the last tier; there the copy that
        arrived first is read in place, pinned for the read.  The last tier then holds its copies out of arrival
        order: a tier kept as a queue gives up the wrong victim."""
        last = len(self.store.model.capacities) - 1
        for tier in range(last):
            held = sum(1 for (n, _), c in self.store.model.copies.items() if n == node and c.tier == tier)
            for _ in range(held):
                if self.demote(node, tier) is None:
                    break
        there = [k for (n, k), c in self.store.model.copies.items() if n == node and c.tier == last and c.ready]
        if len(there) > 1:
            key = min(there, key=lambda k: self.arrivals[(node, k)])
            pinned = self._op("pin", node, key)[0]
            for _ in range(3):  # an LFU tier: until it has been used more often than one that came after it
                self._get(node, key)
                if self.out_of_arrival_order(node):
                    break
            if pinned:
                self._op("unpin", node, key)

    def _put(self, node: int, key: Key, tokens: Tokens) -> bool:
        def written(before: StoreState, after: StoreState, _: object) -> None:
            if took_the_put(before, after, key):
                self.written[key] = tokens

        replicated = len(transitions.lookup(self.store.model, key)) > 1
        ok, _ = self._op("put", node, key, tokens, judge=written)
        self.refused = self.refused if ok else (self._put, (node, key, tokens))
        if ok and replicated and self.conventions.store.reput == "refresh":
            event("re-put of a replicated block")
        return ok

    def full_first_tiers(self) -> list[int]:
        store = self.store.model
        held = [
            sum(1 for (n, _), c in store.copies.items() if n == node and c.tier == 0)
            for node in range(len(store.alive))
        ]
        return [node for node, count in enumerate(held) if store.alive[node] and count == store.capacities[0]]

    @precondition(lambda self: bool(self.full_first_tiers()))
    @rule(data=st.data(), key=KEYS, tokens=CONTENTS)
    def put_past_copies_in_use(self, data: st.DataObject, key: str, tokens: Tokens) -> None:
        """A put onto a node whose first tier is full of copies being read (each pinned for it): there is no
        victim to take, so the spec refuses it for want of room -- and a store that carries it out all the same
        is judged on that call by the rules of its own state.  The readers then let go."""
        node = data.draw(st.sampled_from(self.full_first_tiers()), label="node")
        readers = [p for p, c in self.store.model.copies.items() if p[0] == node and c.tier == 0 and c.ready]
        pinned = [place for place in sorted(readers, key=repr) if self._op("pin", *place)[0]]
        self._put(node, key, tokens)
        for place in pinned:
            self._op("unpin", *place)

    @precondition(lambda self: self.evicted)
    @rule(data=st.data())
    def reput_evicted(self, data: st.DataObject) -> None:
        """A block that left a node is stored there again, as a request that needs it again recomputes it:
        the key an adaptive policy remembers (a ghost), often while the store is full of copies in use."""
        (node, key), tokens = data.draw(st.sampled_from(sorted(self.evicted, key=repr)), label="evicted copy")
        if self.store.model.alive[node] and self._put(node, key, tokens):
            event("revisit: stored a block again after its eviction")
            self.transfer_ends(data, node, key)

    def _complete_if_pending(self, node: int, key: Key) -> bool:
        """A pending store completed (the transfer arrived); whether the copy is now readable."""
        copy = self.store.model.copies.get((node, key))
        if copy is not None and not copy.ready:
            self._op("complete", node, key, True)
        copy = self.store.model.copies.get((node, key))
        return copy is not None and copy.ready

    @precondition(lambda self: self.store.model.copies)
    @rule(data=st.data(), tokens=CONTENTS)
    def reput_held(self, data: st.DataObject, tokens: Tokens) -> None:
        """Write a block again, often with new contents, where some node already holds it; then, as often as
        not, demote its tier until the copy goes down, and read it back: it must come up with the new contents."""
        node, key = data.draw(st.sampled_from(self.held()), label="copy")
        if not isinstance(key, str) or not self._put(node, key, tokens):  # a document's blocks keep their tokens
            return
        if data.draw(st.booleans(), label="send it down a tier and read it back") and (node, key) in self.held():
            tier = self.store.model.copies[(node, key)].tier
            while tier < len(self.store.model.capacities) - 1 and self.demote(node, tier) not in (None, key):
                pass
            self._get(node, key)

    def replicated(self) -> list[Place]:
        return [
            (n, k) for n, k in self.held() if isinstance(k, str) and len(transitions.lookup(self.store.model, k)) > 1
        ]

    @precondition(lambda self: self.replicated())
    @rule(data=st.data(), tokens=CONTENTS)
    def reput_replicated(self, data: st.DataObject, tokens: Tokens) -> None:
        """Write a replicated block again: every replica must take the new contents (or, immutable, none)."""
        self._put(*data.draw(st.sampled_from(self.replicated()), label="copy"), tokens)

    def replicable_puts(self) -> bool:
        return self.offers("kv_store", placement.REPLICATED_PUTS) and sum(self.store.model.alive) > 1

    @precondition(replicable_puts)
    @rule(data=st.data(), key=KEYS, tokens=CONTENTS)
    def put_replicated(self, data: st.DataObject, key: str, tokens: Tokens) -> None:
        self.revisit(data)
        self.replicated_put(data, self.node(data), key, tokens)

    def replicated_put(
        self,
        data: st.DataObject,
        node: int,
        key: Key,
        tokens: Tokens,
        factors: st.SearchStrategy[int] | None = None,
        faults: bool = True,
    ) -> None:
        """A put with a replication factor: mostly 2 up to the live nodes (else 1, or one no store can place);
        then, as often as not, factor - 1 of the nodes holding the block fail, and it is read where it is left."""
        live = sum(self.store.model.alive)
        factors = factors if factors is not None else st.sampled_from([*range(2, live + 1)] * 3 + [1, 0, live + 1])
        factor = data.draw(factors, label="replicas")
        holders = self._put_replicated(node, key, tokens, factor)
        if factor < 2 or not holders or not faults or not self.offers("kv_store", model.NODE_FAULTS):
            return
        if data.draw(st.booleans(), label="fail factor - 1 of the holders"):
            for fault in data.draw(st.permutations(holders), label="holders, first to fail")[: factor - 1]:
                self._fail(fault)
            survivors = [n for n, _ in transitions.lookup(self.store.model, key)]
            if survivors and self._complete_if_pending(survivors[0], key):
                self._get(survivors[0], key)
                event("a replicated block was read after factor - 1 of its holders failed")

    def _put_replicated(self, node: int, key: Key, tokens: Tokens, factor: int) -> list[int]:
        """The nodes holding the block when the put wrote it (none when it was refused or left as it was)."""
        wrote: list[bool] = []

        def durable(before: StoreState, after: StoreState, _: object) -> None:
            if took_the_put(before, after, key):
                self.written[key] = tokens
                self.check(placement.invariant_replicas_on_distinct_nodes, after, key, tokens, factor)
                wrote.append(True)

        ok, _ = self._op("put_replicated", node, key, tokens, factor, judge=durable)
        self.refused = self.refused if ok else (self._put_replicated, (node, key, tokens, factor))
        if ok and wrote and factor > 1:
            event("a replicated put placed its copies")
        return list(placement.holders(self.store.model, key)) if ok and wrote else []  # drawn from: the model's

    @rule(data=st.data(), key=KEYS)
    def get(self, data: st.DataObject, key: str) -> None:
        self.revisit(data)
        self._get(self.node(data), key)

    @precondition(lambda self: self.store.model.copies)
    @rule(data=st.data())
    def get_held(self, data: st.DataObject) -> None:
        """Read a copy some node holds: a hit, or -- still being stored, as often as not where there is one, a
        read racing the store -- a miss that must not read it."""
        pending = self.pending()
        racing = bool(pending) and data.draw(st.booleans(), label="a copy still being stored")
        self._get(*data.draw(st.sampled_from(pending if racing else self.held()), label="copy"))

    def _get(self, node: int, key: Key) -> Tokens | None:
        def read_rules(before: StoreState, after: StoreState, read: Tokens | None) -> None:
            self.check(model.invariant_get_returns_put, key, self.written.get(key), read)
            self.check(model.invariant_pending_never_read, key, (node, key) in before.pending, read)

        ok, read = self._op("get", node, key, judge=read_rules)
        self.refused = self.refused if ok else (self._get, (node, key))
        if ok and read is not None and self.conventions.store.read_lease:
            event("a hit leased its copy")
        return read if ok else None

    def retry_refused(self) -> None:
        """The put, get or replication refused last, as it was, now that an unpin, restart or settle changed
        things."""
        if self.refused is not None:
            (operation, args), self.refused = self.refused, None
            event("revisit: retried a rejected call")
            operation(*args)

    @rule(data=st.data(), tier=st.integers(-1, 3))
    def demote_any(self, data: st.DataObject, tier: int) -> None:
        self.revisit(data)
        self.demote(self.node(data), tier)

    def demote(self, node: int, tier: int) -> Key | None:
        ok, victim = self._op("demote", node, tier)
        if ok and victim is not None:
            event(f"demoted out of the {self.conventions.store.tiers[tier]} tier")
        return victim if ok else None

    @precondition(
        lambda self: any(c.tier < len(self.store.model.capacities) - 1 for c in self.store.model.copies.values())
    )
    @rule(data=st.data())
    def demote_held(self, data: st.DataObject) -> None:
        """Demote out of a tier that holds a block; then, as often as not, read the victim back: it comes up
        again with the contents last put, wherever the store kept them."""
        last = len(self.store.model.capacities) - 1
        places = sorted({(n, c.tier) for (n, _), c in self.store.model.copies.items() if c.tier < last})
        node, tier = data.draw(st.sampled_from(places), label="tier")
        victim = self.demote(node, tier)
        if victim is not None and data.draw(st.booleans(), label="read the demoted block back"):
            self._get(node, victim)

    @precondition(lambda self: self.store.model.copies)
    @rule(data=st.data())
    def evict_held(self, data: st.DataObject) -> None:
        """Evict from a tier that holds a block, pinned or not."""
        tiers = sorted({(n, c.tier) for (n, _), c in self.store.model.copies.items()})
        self.evict(*data.draw(st.sampled_from(tiers), label="tier"))

    @rule(data=st.data(), tier=st.integers(-1, 3))
    def evict_any(self, data: st.DataObject, tier: int) -> None:
        self.revisit(data)
        self.evict(self.node(data), tier)

    def evict(self, node: int, tier: int) -> None:
        self._op("evict", node, tier)

    @precondition(lambda self: self.offers("kv_store", model.REPLICATE))
    @rule(data=st.data(), key=KEYS)
    def replicate(self, data: st.DataObject, key: Key) -> None:
        """Mostly a block some node holds (hot-spot replication), else any key."""
        held = sorted({k for _, k in self.store.model.copies if isinstance(k, str)})
        key = data.draw(st.sampled_from([*held, key]), label="key")
        holders = [node for node, _ in transitions.lookup(self.store.model, key)]
        source = data.draw(st.sampled_from(holders), label="source") if holders else self.node(data)
        targets = [n for n, up in enumerate(self.store.model.alive) if up and n not in holders]
        target = data.draw(st.sampled_from(targets), label="target") if targets else self.node(data)
        self._replicate(key, source, target)

    def replicable(self) -> list[tuple[Key, int, int]]:
        """(key, source, target) for every readable block and every live node without it."""
        live = [n for n, up in enumerate(self.store.model.alive) if up]
        copies = self.store.model.copies
        return [(k, n, t) for n, k in self.held() if copies[(n, k)].ready for t in live if (t, k) not in copies]

    @precondition(lambda self: self.offers("kv_store", model.REPLICATE) and self.replicable())
    @rule(data=st.data(), tokens=CONTENTS, rewrite=st.booleans())
    def replicate_held(self, data: st.DataObject, tokens: Tokens, rewrite: bool) -> None:
        """Hot-spot replication of a held block, then often a re-put on one replica: replicas are rare
        otherwise (replicate above draws arbitrary keys and nodes), and stale replicas hide behind them."""
        key, source, target = data.draw(st.sampled_from(self.replicable()), label="replication")
        if self._replicate(key, source, target) and rewrite and isinstance(key, str):  # documents keep their tokens
            self._put(data.draw(st.sampled_from([source, target]), label="re-put on"), key, tokens)

    def _replicate(self, key: Key, source: int, target: int) -> bool:
        ok, _ = self._op("replicate", key, source, target)
        self.refused = self.refused if ok else (self._replicate, (key, source, target))
        if ok:
            event("replicated a block")
        return ok

    @precondition(lambda self: self.store.model.copies)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        node, key = data.draw(st.sampled_from(self.held()), label="copy")
        self._op("pin", node, key)

    @rule(data=st.data(), key=KEYS)
    def unpin(self, data: st.DataObject, key: str) -> None:
        pinned = [place for place in self.held() if self.store.model.copies[place].pins]
        node, copy_key = data.draw(st.sampled_from(pinned), label="copy") if pinned else (self.node(data), key)
        if self._op("unpin", node, copy_key)[0]:
            self.retry_refused()

    @precondition(lambda self: self.offers("kv_store", model.PENDING_STORES) and self.store.model.copies)
    @rule(data=st.data(), ok=st.booleans())
    def complete(self, data: st.DataObject, ok: bool) -> None:
        """A pending store's transfer arrives (ok) or fails; sometimes a late completion of one that is not
        pending (it changes nothing)."""
        self._complete(*data.draw(st.sampled_from(self.pending() or self.held()), label="copy"), ok)

    def _complete(self, node: int, key: Key, ok: bool) -> None:
        def failed_leaves_miss(before: StoreState, after: StoreState, _: object) -> None:
            if (node, key) in before.pending and not ok:
                self.check(model.invariant_failed_store_leaves_miss, after, node, key)
                event("a pending store failed")

        if self._op("complete", node, key, ok, judge=failed_leaves_miss)[0]:
            self.retry_refused()

    @precondition(lambda self: self.offers("kv_store", model.PENDING_STORES))
    @rule(data=st.data(), key=KEYS)
    def find(self, data: st.DataObject, key: Key) -> None:
        """Whether a node can serve a key: hit, pending or miss."""
        held = [k for n, k in self.held()]
        ok, answer = self._op("find", self.node(data), data.draw(st.sampled_from([*held, key]), label="key"))
        if ok:
            event(f"find answered {answer}")

    @precondition(lambda self: self.offers("kv_store", model.LEASES))
    @rule(fraction=st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]))
    def advance(self, fraction: float) -> None:
        """Model time moves on, by a share of a read lease (past one, into one, or -- invalid -- back)."""
        lease = self.conventions.store.read_lease or 1.0
        leased = len(model.abstract(self.store.model).leases)
        if self._op("advance", fraction * lease)[0] and leased > len(model.abstract(self.store.model).leases):
            event("a read lease ran out")
            self.retry_refused()

    @precondition(lambda self: self.offers("kv_store", model.REMOVE) and self.store.model.copies)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        """Drop a copy on request; one in use (pinned, leased, pending) is out of contract: the caller must
        wait for the transfer that holds it.  As often as not a reader pins the copy first."""
        node, key = data.draw(st.sampled_from(self.held()), label="copy")
        if data.draw(st.booleans(), label="a reader pins it first"):
            self._op("pin", node, key)
        if self._op("remove", node, key)[0]:
            self.retry_refused()

    @precondition(lambda self: self.offers("kv_store", model.SETTLE))
    @rule()
    def settle(self) -> None:
        """Background work done now, whatever the store's eviction: nothing changes unless it runs some."""
        if self.background:
            self._settle()
        else:
            self._op("settle")

    def survivable(self) -> bool:
        """Whether a node fault would leave a live node: a store of one node only ever stops."""
        return self.offers("kv_store", model.NODE_FAULTS) and sum(self.store.model.alive) > 1

    @precondition(survivable)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        """A node fault: the node's tiers vanish; nothing else may change."""
        self._fail(data.draw(st.integers(0, len(self.store.model.alive) - 1), label="node"))

    @precondition(lambda self: self.survivable() and self.store.model.copies)
    @rule()
    def fail_busiest(self) -> None:
        """A fault where it hurts: the node holding the most blocks."""
        held = [sum(1 for n, _ in self.store.model.copies if n == node) for node in range(len(self.store.model.alive))]
        self._fail(held.index(max(held)))

    def _fail(self, node: int) -> None:
        def only_the_node(before: StoreState, after: StoreState, _: object) -> None:
            self.check(model.invariant_fault_loses_only_the_node, before, after, node)
            lost.update(key for (n, key) in before.contents if n == node)

        lost: set[Key] = set()
        if not self._op("fail", node, judge=only_the_node)[0]:
            return
        for key in sorted(lost, key=repr):
            self._lookup(key)
        only_there = {key for key in lost if not transitions.lookup(self.store.model, key)}
        self.lost_in_fault |= only_there
        event("node fault")
        if only_there:
            event("node fault lost the last copy of a block")

    @precondition(lambda self: self.offers("kv_store", model.NODE_FAULTS))
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """Mostly a failed node (so that faults do not leave no one to replicate to), else any."""
        dead = [n for n, up in enumerate(self.store.model.alive) if not up]
        restart_dead = bool(dead) and data.draw(st.booleans(), label="a failed node")
        node = data.draw(st.sampled_from(dead), label="node") if restart_dead else self.node(data)
        if self._op("restart", node)[0]:
            self.retry_refused()

    @rule(key=KEYS, data=st.data())
    def lookup(self, key: str, data: st.DataObject) -> None:
        self.revisit(data)
        self._lookup(key)

    def _lookup(self, key: Key) -> None:
        self._op(
            "lookup",
            key,
            judge=lambda _, after, answer: self.check(model.invariant_lookup_names_live_holders, after, key, answer),
        )

    @rule(data=st.data(), document=st.sampled_from(DOCUMENTS), turns=st.integers(1, 2))
    def serve(self, data: st.DataObject, document: Tokens, turns: int) -> None:
        """A request for ``document`` on a node: local hit, pulled replica, or recomputation; a second
        turn of the conversation reads the same prefix again, now partly demoted by the first."""
        node = data.draw(st.integers(0, len(self.store.model.alive) - 1), label="node")
        for _ in range(turns):
            self._serve(node, document)

    def _serve(self, node: int, document: Tokens) -> None:
        if not self.store.model.alive[node]:
            return
        blocks = document_blocks(document)
        if document in self.served:
            event("revisit: re-admitted an earlier prompt")
            if any((node, key) not in self.store.model.copies for key, _ in blocks):
                event("revisit: replayed a prompt after eviction")
        self.served.add(document)
        served: list[Tokens] = []
        for key, tokens in blocks:
            read = self._serve_block(node, key, tokens)
            if read is None:
                event("request stopped: no room for its blocks")
                break
            served.append(read)
        self.check(model.invariant_request_reads_its_tokens, [t for _, t in blocks[: len(served)]], served)

    def _serve_block(self, node: int, key: Key, tokens: Tokens) -> Tokens | None:
        """A local hit, a pulled replica, or the block recomputed from the request's own tokens and put."""
        holders = [n for n, _ in transitions.lookup(self.store.model, key) if n != node]
        ready = [n for n in holders if self.store.model.copies[(n, key)].ready]
        mine = self.store.model.copies.get((node, key))
        if mine is not None and mine.ready:
            return self._get(node, key)
        if ready and self.offers("kv_store", model.REPLICATE) and self._replicate(key, ready[0], node):
            return self._get(node, key)
        if mine is None and not self._put(node, key, tokens):
            return None
        self._complete_if_pending(node, key)
        if key in self.lost_in_fault:
            event("a prefix lost in a node fault was recomputed")
            self.lost_in_fault.discard(key)
        return tokens

    @invariant()
    def store_matches_spec(self) -> None:
        if not hasattr(self, "store"):
            return
        state = self.store.snapshot()
        self.check(model.invariant_directory_exact, state)
        self.check(model.invariant_tier_capacity, state)
        self.check(model.invariant_replicas_agree, state)
        self._refines(state)


TestKVStore = conformance_test(KVStoreMachine, "tiered KV store (node faults)")


def took_the_put(before: StoreState, after: StoreState, key: Key) -> bool:
    """Whether a put of ``key`` the store carried out wrote it, as the store's own states say: it held no copy of
    the key, or its copies changed (new contents, a new replica).  A store that held the key and left every copy
    as it was kept its block -- immutable contents (``reput`` touch or skip) -- and a hit still reads what the
    caller put first; whichever the store declares, the ledger follows what it did."""

    def copies(state: StoreState) -> dict[Place, Tokens]:
        return {place: tokens for place, tokens in state.contents.items() if place[1] == key}

    return not copies(before) or copies(after) != copies(before)


def named_to_go(operation: str, args: tuple[Any, ...]) -> list[Place]:
    """The copies a call itself names to go, in the caller's ledger: a removed copy, a store reported failed."""
    if operation == "remove" or (operation == "complete" and args[2] is False):
        return [(args[0], args[1])]
    return []


def taken(operation: str, args: tuple[Any, ...], answer: Any) -> list[Place]:
    """The copies a call asked the store to choose and give up, as the store answered them: ``evict``'s victim,
    the background evictor's."""
    if operation == "settle":
        return list(answer)
    return [(args[0], answer)] if operation == "evict" and answer is not None else []


# -- the reference under every profile of conventions an engine declares ----------------------------------

PROFILES = {
    "one node, one tier, pending stores, ARC that learns from a refused store (vLLM's CPU offloading)": (
        StoreConventions(
            tiers=("cpu",),
            max_nodes=1,
            policies=("lru", "arc"),
            reput="touch",
            stores="pending",
            refusal_adapts_policy=True,
        )
    ),
    "ARC in every tier, learning from a refused put": StoreConventions(policies=("arc",), refusal_adapts_policy=True),
    "DRAM over SSD, immutable, read in place (LMCache)": StoreConventions(
        tiers=("cpu", "ssd"), max_nodes=1, policies=("lru", "lfu"), reput="skip", promotion=False
    ),
    "leases, background eviction by the engine (Mooncake)": StoreConventions(
        tiers=("cpu",),
        policies=("lru",),
        reput="skip",
        read_lease=600.0,
        leases_new_copies=True,
        eviction="background",
        victims="engine",
    ),
    "leases that run out, background eviction past a watermark": StoreConventions(
        read_lease=2.0, eviction="background", watermark=0.6
    ),
}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_the_reference_refines_the_model_under_every_profile(profile: str) -> None:
    conventions = Conventions(store=PROFILES[profile])
    store = Offer(with_conventions(PROFILES[profile]), every_operation("kv_store"))
    implementation = Implementation(name=f"reference ({profile})", kv_store=store, conventions=conventions)
    outcome = run_machine(KVStoreMachine, implementation, conformance_settings(examples=0.5))
    assert not outcome.findings, "\n".join(
        f"{f.invariant}: {f.detail}\n  " + "\n  ".join(f.steps) for f in outcome.findings
    )
