"""Layers 2 and 7 together: partial swap-in from a tier of larger blocks (``kvspec.spec.tiered_swap``).

One device block manager (2-8 blocks of 1-3 tokens) and one node of layer 7's tiered store (1-3 blocks per
tier) whose blocks hold ``k * B`` tokens, k = 1-3.  Sequences live in a few slots; the machine admits and
extends them, forks them, and swaps them out at any block, mid tier block included: it ``put``s the tier
blocks from the one that holds the first block to leave, then ``truncate``s the sequence to its resident
prefix.  A swap-in loads the suffix back after that prefix; the load must land after it, take each block
from the right slice of the right tier block, and read back what the sequence held.  The store demotes and
evicts under its own pressure, so a tier block may be lost: the swap-in is then refused and the sequence
recomputed from its tokens.  Both sides run in lockstep with their models, and every manager, pool and
store invariant holds after every step.

The search revisits, drawn inside admission (so every example has the chance): the write or swap-in
refused last is retried, an earlier prompt is admitted again in its slot or another, and a sequence whose
tier blocks were evicted is replayed (recomputed).  A free retries the refused call too.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.spec import block_manager as model
from kvspec.spec import block_pool, kv_store, kv_store_model, tiered_swap
from kvspec.spec.conventions import StorePolicy
from kvspec.spec.invariants import invariant_result_matches_spec
from kvspec.spec.kv_store import TIERS, Key

SLOTS = st.integers(0, 3)
TOKENS = st.integers(0, 9)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=7)
NODE = 0  # the store node the device swaps to


class TieredSwapMachine(LockstepMachine):
    uses = frozenset({"block_pool", "block_manager", "kv_store"})
    requires = {"block_manager": frozenset({tiered_swap.TIERED_SWAP_IN})}
    judges = ("tiered_swap", "block_manager", "kv_store", "block_pool", "invariants")

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        blocks = data.draw(st.integers(3, 8), label="device blocks")
        block_size = data.draw(st.integers(1, 3), label="block size")
        factor = data.draw(st.sampled_from([2, 3, 2, 3, 1]), label="device blocks per tier block")
        declared = self.conventions.store  # the store's shape and policies, as it declares them
        capacities = tuple(data.draw(st.integers(1, 3), label=f"{tier} capacity") for tier in declared.tiers)
        policy = data.draw(st.sampled_from(self.conventions.pool.policies), label="policy")
        self.record(
            f"device = manager(blocks={blocks}, block_size={block_size}, policy={policy!r}); "
            f"store = kv_store(nodes=1, capacities={capacities}); tier blocks of {factor * block_size} tokens"
        )
        impl = self.implementation
        pool = block_pool.new_pool(blocks, policy, self.conventions.pool)
        manager = impl.component("block_manager")(impl.component("block_pool")(blocks, policy), block_size)
        self.device = self.subject(
            "device", (model, tiered_swap), model.new_manager(pool, block_size, self.conventions.manager), manager
        )
        stored: StorePolicy = "lru" if "lru" in declared.policies else declared.policies[0]
        policies = (stored,) * len(declared.tiers)
        store = impl.component("kv_store")(1, capacities, policies)
        expected = kv_store.new_store(1, capacities, policies, declared)
        self.store = self.subject(
            "store", (kv_store, kv_store_model), expected, store, refusal_view=kv_store.kept_by_a_refusal
        )
        self.block_size, self.factor = block_size, factor
        # a prompt of 2 to factor + 1 device blocks, one a swap-out can cut inside a tier block; its tokens
        # distinct, so that a block loaded from the wrong slice holds other tokens than the right one
        spanning = st.lists(
            st.integers(0, 99), min_size=block_size + 1, max_size=(factor + 1) * block_size, unique=True
        )
        self.new_prompts = PROMPTS | spanning
        self.swapped: dict[int, tuple[tuple[int, ...], list[Key]]] = {}  # slot -> what it read then, its tier keys
        self.prompts: list[tuple[int, list[int]]] = []  # (slot, prompt) of every admission
        self.refused: tuple[str, int, list[int]] | None = None  # the write or swap-in refused last
        # a first sequence, preempted to the store: swarm testing turns ``admit`` and ``swap_out`` off in many
        # examples, and a partial swap-in needs both
        first = data.draw(spanning, label="first prompt")
        if self.write("add_sequence", 0, first):
            self.prompts.append((0, first))
            self.swap_out_seq(0, data)

    @property
    def tier_block_size(self) -> int:
        return self.factor * self.block_size

    def running(self) -> list[int]:
        """Slots whose sequence is whole on the device."""
        return sorted(seq for seq in self.device.model.tables if seq not in self.swapped)

    @staticmethod
    def nearest(candidates: list[int], slot: int) -> int | None:
        return min(candidates, key=lambda seq: (seq - slot) % 4, default=None)

    # -- writes ----------------------------------------------------------------------

    def write(self, operation: str, seq: int, tokens: list[int]) -> bool:
        if self.device(operation, seq, tokens) is None:
            self.refused = (operation, seq, tokens)
            return False
        return True

    @rule(slot=SLOTS, data=st.data())
    def admit(self, slot: int, data: st.DataObject) -> None:
        """A new prompt in ``slot``, or an earlier one again, in its slot or this one (freed first, as an engine
        reuses a finished request's slot).  First, as often as not, the call refused last is retried, and a
        swapped-out sequence resumes."""
        if self.refused is not None and data.draw(st.booleans(), label="retry the refused call first"):
            self.retry_refused()
        if bool(self.swapped) and data.draw(st.booleans(), label="resume a swapped-out sequence first"):
            self.swap_in(slot)
        prompt = data.draw(self.new_prompts, label="prompt")
        if bool(self.prompts) and data.draw(st.booleans(), label="an earlier prompt"):
            earlier, prompt = data.draw(st.sampled_from(self.prompts), label="earlier admission")
            slot = earlier if data.draw(st.booleans(), label="in its slot") else slot
            event(f"revisit: re-admitted an earlier prompt in {'the same' if slot == earlier else 'another'} slot")
        if slot in self.device.model.tables:
            self.free_slot(slot)
        self.admit_prompt(slot, prompt, data)

    def admit_prompt(self, slot: int, prompt: list[int], data: st.DataObject) -> None:
        """Add ``prompt`` in ``slot``; then, as often as not, preempt it to the store (swarm testing may turn
        ``swap_out`` off)."""
        if self.write("add_sequence", slot, prompt):
            self.prompts.append((slot, prompt))
            if data.draw(st.booleans(), label="preempt it to the store"):
                self.swap_out_seq(slot, data)

    @rule(slot=SLOTS, tokens=st.lists(TOKENS, max_size=4))
    def append(self, slot: int, tokens: list[int]) -> None:
        """To the nearest running sequence; with none, to ``slot`` (refused) unless it is swapped out."""
        seq = self.nearest(self.running(), slot)
        if seq is not None or slot not in self.swapped:
            self.write("append", slot if seq is None else seq, tokens)

    @rule(parent=SLOTS, child=SLOTS)
    def fork(self, parent: int, child: int) -> None:
        """A fork shares the parent's blocks: a swap-out of either releases only its own references."""
        source = self.nearest(self.running(), parent)
        if source is not None:
            self.device("fork", source, child)

    @rule(slot=SLOTS)
    def free(self, slot: int) -> None:
        """Finish a sequence, running or swapped out; then retry the call refused last, as a scheduler does."""
        if self.free_slot(slot) and self.refused is not None:
            self.retry_refused()

    def free_slot(self, seq: int) -> bool:
        self.swapped.pop(seq, None)
        return self.device("free", seq) is not None

    def retry_refused(self) -> None:
        assert self.refused is not None
        (operation, seq, tokens), self.refused = self.refused, None
        event("revisit: retried a rejected call")
        if operation == "swap_in":
            if seq in self.swapped:
                self.swap_in_seq(seq)
        elif seq in self.running() if operation == "append" else seq not in self.device.model.tables:
            self.write(operation, seq, tokens)

    # -- swapping ----------------------------------------------------------------------

    @precondition(lambda self: self.running())
    @rule(slot=SLOTS, data=st.data())
    def swap_out(self, slot: int, data: st.DataObject) -> None:
        """Put the tier blocks from the one holding the first block to leave; keep the prefix before it resident.
        First, as often as not, a swapped-out sequence comes back, as a scheduler resumes before it preempts;
        after, as often, the sequence comes straight back: a round trip with nothing in between."""
        if bool(self.swapped) and data.draw(st.booleans(), label="swap one in first"):
            self.swap_in(slot)
        seq = self.nearest(self.running(), slot)
        if seq is not None:
            self.swap_out_seq(seq, data)

    def swap_out_seq(self, seq: int, data: st.DataObject) -> None:
        """The device's own contents of the sequence go to the store, as an engine swaps out the KV it holds: what
        the sequence reads back after its swap-in is judged against what it read here."""
        table = self.device.model.tables[seq]
        if not table:
            return
        tokens = tuple(self.device.impl.read(seq))
        # mostly a cut inside a tier block, where a partial swap-in must skip the resident part of its first one
        inside = [cut for cut in range(1, len(table)) if cut % self.factor]
        cuts = st.integers(min(1, len(table) - 1), len(table) - 1) | st.just(0)
        inside_mostly = st.sampled_from(inside) | st.sampled_from(inside) | cuts if inside else cuts
        keep = data.draw(inside_mostly, label="blocks kept resident")
        tiers = tiered_swap.tier_blocks(tokens, self.tier_block_size, keep // self.factor)
        if not all(self.store_block(key, contents) for key, contents in tiers):
            return
        if self.device("truncate", seq, keep) is not None:
            self.swapped[seq] = (tokens, [key for key, _ in tiers])
            event("swapped out mid tier block" if keep % self.factor else "swapped out at a tier block's edge")
            if data.draw(st.booleans(), label="swap it straight back in"):
                self.swap_in_seq(seq)

    def store_block(self, key: Key, contents: tuple[int, ...]) -> bool:
        """Put one tier block; where stores are pending, its transfer completes; where eviction runs in the
        background, the evictor runs after it.  Whether the store holds it."""
        if self.store("put", NODE, key, list(contents)) is None:
            self.store.model = kv_store_model.refused_put(
                self.store.model, NODE, key
            )  # where a refusal adapts the policy
            return False
        copy = self.store.model.copies.get((NODE, key))
        if copy is not None and not copy.ready:
            self.store("complete", NODE, key, True)
        if self.conventions.store.eviction == "background" and self.offers("kv_store", kv_store.SETTLE):
            answer = self.store("settle", judged_by=None)
            if answer is not None and self.conventions.store.victims == "engine":
                self.store.model = kv_store_model.evicted_by_engine(self.store.model, answer.actual)
        return (NODE, key) in self.store.model.copies

    @precondition(lambda self: self.swapped)
    @rule(slot=SLOTS)
    def swap_in(self, slot: int) -> None:
        seq = self.nearest(sorted(self.swapped), slot)
        assert seq is not None
        self.swap_in_seq(seq)

    def swap_in_seq(self, seq: int) -> None:
        """Load the suffix back; if the store lost a tier block, recompute the sequence from its tokens."""
        tokens, keys = self.swapped[seq]
        before, resident = self.device.snapshot(), len(self.device.impl.block_table(seq))
        answer = self.device("swap_in", self.store, NODE, self.tier_block_size, seq, keys, judged_by=None)
        if answer is None:
            if all((NODE, key) in self.store.model.copies for key in keys):
                self.refused = ("swap_in", seq, [])
                return
            event("revisit: replayed a prompt after eviction")
            if self.free_slot(seq):
                self.write("add_sequence", seq, list(tokens))
            return
        del self.swapped[seq]
        after = self.device.snapshot()
        self.check(tiered_swap.invariant_load_lands_after_resident_prefix, before, after, seq)
        self.check(
            tiered_swap.invariant_tier_blocks_cover_loaded_blocks,
            answer.actual,
            resident,
            self.device.impl.block_table(seq),
            keys,
            self.factor,
            self.block_size,
        )
        self.check(tiered_swap.invariant_swap_round_trip_exact, seq, tokens, self.device.impl.read(seq))
        self.check(invariant_result_matches_spec, answer.expected, answer.actual)
        edge = " mid tier block" if resident % self.factor else " at a tier block's edge"
        event(f"partial swap-in{edge}" if resident else "swap-in of the whole sequence")

    @rule(slot=SLOTS, how=st.sampled_from(["node", "tier block size", "keys", "lost key", "running"]))
    def invalid_swap_in(self, slot: int, how: str) -> None:
        """A swap-in with an unknown node, a tier block size that is no multiple of B, no keys, a key the store
        does not hold, or onto a running sequence (refused unless the tier blocks happen to continue it)."""
        seq = self.nearest(sorted(self.swapped), slot)
        keys = self.swapped[seq][1] if seq is not None else [("tier", (0,))]
        arguments = {
            "node": (1, self.tier_block_size, keys),
            "tier block size": (NODE, self.tier_block_size + 1 if self.block_size > 1 else 0, keys),
            "keys": (NODE, self.tier_block_size, []),
            "lost key": (NODE, self.tier_block_size, [("tier", (-1,))]),
            "running": (NODE, self.tier_block_size, keys),
        }
        node, size, names = arguments[how]
        target = self.nearest(self.running(), slot) if how == "running" or seq is None else seq
        target = slot if target is None else target
        if self.device("swap_in", self.store, node, size, target, names, note=how) is not None:
            self.swapped.pop(target, None)  # loaded all the same: the sequence is whole on the device

    @rule(tier=st.integers(0, len(TIERS) - 1), evict=st.booleans())
    def store_pressure(self, tier: int, evict: bool) -> None:
        """The store makes room for other traffic: a tier block goes down a tier, or out of the store."""
        tier = min(tier, len(self.store.model.capacities) - 1)
        if evict or tier == len(self.store.model.capacities) - 1:
            answer = self.store("evict", NODE, tier)
            if answer is not None and answer.actual is not None:
                event("evicted a tier block")
        else:
            answer = self.store("demote", NODE, tier)
            if answer is not None and answer.actual is not None:
                event("demoted a tier block")

    # -- after every step ------------------------------------------------------------

    @invariant()
    def matches_spec(self) -> None:
        state = self.device.snapshot()
        self.check_group(model.STATE, state)
        self.check(model.invariant_manager_refines_spec, state, model.abstract(self.device.model))
        stored = self.store.snapshot()
        self.check(kv_store.invariant_directory_exact, stored)
        self.check(kv_store.invariant_tier_capacity, stored)
        self.check(kv_store.invariant_store_refines_spec, stored, kv_store.abstract(self.store.model))


TestTieredSwap = conformance_test(TieredSwapMachine, "tiered swap (partial swap-in)")
