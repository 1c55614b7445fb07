"""Layer 7 conformance: the tiered KV store against ``kvspec.spec.kv_store``'s model.

The machine drives put / get / demote / evict / replicate / pin / unpin /
lookup, valid and invalid, on tiny clusters (1-3 nodes, 1-3 blocks per tier)
where every tier overflows.  A **node fault** is an operation like any other
(S3 ShardStore style); after one the machine checks that only that node's
copies went, and asks the store for every block the node held.  ``serve``
plays a request for a document: it looks each block up, reads it locally,
pulls a replica, or -- when the prefix was lost -- recomputes it from the
document's tokens and puts it back, and must read exactly the document.
The search revisits: a put, get or replication refused (no unpinned room, a
dead node) is retried after an unpin or a restart, and documents are served
again, often after eviction or a fault took some of their blocks -- both also
drawn inside the common rules, so that swarm testing never turns them off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.properties.harness import LockstepMachine, conformance_test
from kvspec.spec import invariants
from kvspec.spec import kv_store as model
from kvspec.spec.block_pool import POLICIES
from kvspec.spec.kv_store import TIERS, Key, Tokens

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
    judges = ("kv_store", "invariants")
    node_counts = st.sampled_from([1, 2, 2, 3, 3])  # replicas and faults need company
    capacities = st.integers(1, 3)

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        nodes = data.draw(self.node_counts, label="nodes")
        capacities = tuple(data.draw(self.capacities, label=f"{tier} capacity") for tier in TIERS)
        policies = tuple(data.draw(st.sampled_from(POLICIES), label=f"{tier} policy") for tier in TIERS)
        self.record(f"store = kv_store(nodes={nodes}, capacities={capacities}, policies={policies})")
        store = self.implementation.component("kv_store")(nodes, capacities, policies)
        self.store = self.subject("store", model, model.new_store(nodes, capacities, policies), store)
        self.written: dict[Key, Tokens] = {}
        self.lost_in_fault: set[Key] = set()
        self.refused: tuple[Callable[..., Any], tuple[Any, ...]] | None = None  # the put, get or replication
        self.served: set[Tokens] = set()
        # Most runs start with a hot block on two nodes: replicas are rare otherwise, and stale ones hide there.
        if (
            nodes > 1
            and self.offers("kv_store", "replicate")
            and data.draw(st.integers(0, 7), label="start with a replicated block (unless 0)")
        ):
            key, tokens = data.draw(KEYS, label="key"), data.draw(CONTENTS, label="tokens")
            if self._put(0, key, tokens):
                self._replicate(key, 0, 1)

    # -- one lockstep path for every operation ------------------------------------

    def _op(self, operation: str, *args: Any, judge: Callable[[Any], None] = lambda answer: None) -> tuple[bool, Any]:
        """Run an operation on both sides; check the transition rules, then ``judge`` the answer by
        its own rule before comparing it with the spec's; (ok, the answer)."""
        before = self.store.snapshot()
        expected_before = model.abstract(self.store.model)
        answer = self.store(operation, *args, judged_by=None)
        if answer is None:
            return False, None
        after = self.store.snapshot()
        now = model.abstract(self.store.model).contents
        chosen = [place for place in expected_before.contents if place not in now]
        self.check(model.invariant_pinned_never_evicted, before, after)
        self.check(model.invariant_demotion_keeps_the_block, before, after, chosen)
        judge(answer.actual)
        self.check(invariants.invariant_result_matches_spec, answer.expected, answer.actual)
        return True, answer.actual

    def node(self, data: st.DataObject) -> int:
        """Mostly a live node; sometimes a dead one or one that does not exist."""
        alive = [n for n, up in enumerate(self.store.model.alive) if up]
        others = [n for n in range(-1, len(self.store.model.alive) + 1) if n not in alive]
        return data.draw(st.sampled_from(alive * 4 + others), label="node")

    def held(self) -> list[tuple[int, Key]]:
        return sorted(self.store.model.copies, key=repr)

    # -- rules ------------------------------------------------------------------------

    @rule(data=st.data(), key=KEYS, tokens=CONTENTS)
    def put(self, data: st.DataObject, key: str, tokens: Tokens) -> None:
        self.revisit(data)
        self._put(self.node(data), key, tokens)

    def revisit(self, data: st.DataObject) -> None:
        """Drawn inside the common rules, so that swarm testing never turns it off: as often as not, the call
        refused last again; as often, a document served before is served again, on the node it was or another."""
        if self.refused is not None and data.draw(st.booleans(), label="retry the refused call first"):
            self.retry_refused()
        if self.served and data.draw(st.booleans(), label="serve an earlier document"):
            document = data.draw(st.sampled_from(sorted(self.served)), label="earlier document")
            self._serve(data.draw(st.integers(0, len(self.store.model.alive) - 1), label="node"), document)

    def _put(self, node: int, key: Key, tokens: Tokens) -> bool:
        ok, _ = self._op("put", node, key, tokens)
        self.refused = self.refused if ok else (self._put, (node, key, tokens))
        if ok:
            if key in self.written and self.written[key] != tokens and len(model.lookup(self.store.model, key)) > 1:
                event("re-put with new contents of a replicated block")
            self.written[key] = tokens
        return ok

    @precondition(lambda self: self.store.model.copies)
    @rule(data=st.data(), tokens=CONTENTS)
    def reput_held(self, data: st.DataObject, tokens: Tokens) -> None:
        """Write a block again, often with new contents, where some node already holds it; then, as often as
        not, demote its tier until the copy goes down, and read it back: it must come up with the new contents."""
        node, key = data.draw(st.sampled_from(self.held()), label="copy")
        if not isinstance(key, str) or not self._put(node, key, tokens):  # a document's blocks keep their tokens
            return
        if data.draw(st.booleans(), label="send it down a tier and read it back"):
            tier = self.store.model.copies[(node, key)].tier
            while tier < len(TIERS) - 1 and self.demote(node, tier) not in (None, key):
                pass
            self._get(node, key)

    def replicated(self) -> list[tuple[int, Key]]:
        return [(n, k) for n, k in self.held() if isinstance(k, str) and len(model.lookup(self.store.model, k)) > 1]

    @precondition(lambda self: self.replicated())
    @rule(data=st.data(), tokens=CONTENTS)
    def reput_replicated(self, data: st.DataObject, tokens: Tokens) -> None:
        """Write a replicated block again: every replica must take the new contents."""
        self._put(*data.draw(st.sampled_from(self.replicated()), label="copy"), tokens)

    @rule(data=st.data(), key=KEYS)
    def get(self, data: st.DataObject, key: str) -> None:
        self.revisit(data)
        self._get(self.node(data), key)

    def _get(self, node: int, key: Key) -> Tokens | None:
        ok, read = self._op(
            "get",
            node,
            key,
            judge=lambda read: self.check(model.invariant_get_returns_put, key, self.written.get(key), read),
        )
        self.refused = self.refused if ok else (self._get, (node, key))
        return read if ok else None

    def retry_refused(self) -> None:
        """The put, get or replication refused last, as it was, now that an unpin or restart changed things."""
        if self.refused is not None:
            (operation, args), self.refused = self.refused, None
            event("revisit: retried a rejected call")
            operation(*args)

    @rule(data=st.data(), tier=st.integers(-1, len(TIERS)))
    def demote_any(self, data: st.DataObject, tier: int) -> None:
        self.revisit(data)
        self.demote(self.node(data), tier)

    def demote(self, node: int, tier: int) -> Key | None:
        ok, victim = self._op("demote", node, tier)
        if ok and victim is not None:
            event(f"demoted out of the {TIERS[tier]} tier")
        return victim if ok else None

    @precondition(lambda self: any(copy.tier < len(TIERS) - 1 for copy in self.store.model.copies.values()))
    @rule(data=st.data())
    def demote_held(self, data: st.DataObject) -> None:
        """Demote out of a tier that holds a block; then, as often as not, read the victim back: it comes up
        again with the contents last put, wherever the store kept them."""
        places = sorted({(n, c.tier) for (n, _), c in self.store.model.copies.items() if c.tier < len(TIERS) - 1})
        node, tier = data.draw(st.sampled_from(places), label="tier")
        victim = self.demote(node, tier)
        if victim is not None and data.draw(st.booleans(), label="read the demoted block back"):
            self._get(node, victim)

    @precondition(lambda self: self.store.model.copies)
    @rule(data=st.data())
    def evict_held(self, data: st.DataObject) -> None:
        """Evict from a tier that holds a block, pinned or not."""
        self.evict(
            *data.draw(
                st.sampled_from(sorted({(n, c.tier) for (n, _), c in self.store.model.copies.items()})), label="tier"
            )
        )

    @rule(data=st.data(), tier=st.integers(-1, len(TIERS)))
    def evict_any(self, data: st.DataObject, tier: int) -> None:
        self.revisit(data)
        self.evict(self.node(data), tier)

    def evict(self, node: int, tier: int) -> None:
        self._op("evict", node, tier)

    @precondition(lambda self: self.offers("kv_store", "replicate"))
    @rule(data=st.data(), key=KEYS)
    def replicate(self, data: st.DataObject, key: Key) -> None:
        """Mostly a block some node holds (hot-spot replication), else any key."""
        held = sorted({k for _, k in self.store.model.copies if isinstance(k, str)})
        key = data.draw(st.sampled_from([*held, key]), label="key")
        holders = [node for node, _ in model.lookup(self.store.model, key)]
        source = data.draw(st.sampled_from(holders), label="source") if holders else self.node(data)
        targets = [n for n, up in enumerate(self.store.model.alive) if up and n not in holders]
        target = data.draw(st.sampled_from(targets), label="target") if targets else self.node(data)
        self._replicate(key, source, target)

    def replicable(self) -> list[tuple[Key, int, int]]:
        """(key, source, target) for every held block and every live node without it."""
        live = [n for n, up in enumerate(self.store.model.alive) if up]
        return [(k, n, t) for n, k in self.held() for t in live if (t, k) not in self.store.model.copies]

    @precondition(lambda self: self.offers("kv_store", "replicate") and self.replicable())
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
        self._unpin(node, copy_key)

    def _unpin(self, node: int, key: Key) -> None:
        if self._op("unpin", node, key)[0]:
            self.retry_refused()

    @precondition(lambda self: self.offers("kv_store", "node_faults"))
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        """A node fault: the node's tiers vanish; nothing else may change."""
        self._fail(data.draw(st.integers(0, len(self.store.model.alive) - 1), label="node"))

    @precondition(lambda self: self.offers("kv_store", "node_faults") and self.store.model.copies)
    @rule()
    def fail_busiest(self) -> None:
        """A fault where it hurts: the node holding the most blocks."""
        held = [sum(1 for n, _ in self.store.model.copies if n == node) for node in range(len(self.store.model.alive))]
        self._fail(held.index(max(held)))

    def _fail(self, node: int) -> None:
        before = self.store.snapshot()
        ok, _ = self._op("fail", node)
        if not ok:
            return
        self.check(model.invariant_fault_loses_only_the_node, before, self.store.snapshot(), node)
        lost = {key for (n, key) in before.contents if n == node}
        for key in sorted(lost, key=repr):
            self._lookup(key)
        only_there = {key for key in lost if not model.lookup(self.store.model, key)}
        self.lost_in_fault |= only_there
        event("node fault")
        if only_there:
            event("node fault lost the last copy of a block")

    @precondition(lambda self: self.offers("kv_store", "node_faults"))
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
            judge=lambda answer: self.check(
                model.invariant_lookup_names_live_holders, self.store.snapshot(), key, answer
            ),
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
            holders = [n for n, _ in model.lookup(self.store.model, key) if n != node]
            if (node, key) in self.store.model.copies:
                read = self._get(node, key)
            elif holders and self._replicate(key, holders[0], node):
                read = self._get(node, key)
            elif self._put(node, key, tokens):  # recompute the block from the request's own tokens
                read = tokens
                if key in self.lost_in_fault:
                    event("a prefix lost in a node fault was recomputed")
                    self.lost_in_fault.discard(key)
            else:
                event("request stopped: no room for its blocks")
                break
            served.append(read)  # type: ignore[arg-type]
        self.check(model.invariant_request_reads_its_tokens, [t for _, t in blocks[: len(served)]], served)

    @invariant()
    def store_matches_spec(self) -> None:
        if not hasattr(self, "store"):
            return
        state = self.store.snapshot()
        self.check(model.invariant_directory_exact, state)
        self.check(model.invariant_tier_capacity, state)
        self.check(model.invariant_replicas_agree, state)
        self.check(model.invariant_store_refines_spec, state, model.abstract(self.store.model))


TestKVStore = conformance_test(KVStoreMachine)
