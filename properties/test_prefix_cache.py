"""Layer 3 conformance: the prefix-caching manager against ``spec.prefix_cache``'s model.

The machine drives add (with extra keys) / append / fork / free / lookup /
evict, valid and invalid, and probes the hash chain with one-token changes.
Prompts are drawn mostly as a cut of an earlier prompt plus new tokens from a
three-letter alphabet, so hits, partial hits and duplicate blocks are common.
It learns the relation between the implementation's hashes and the spec's
ideal keys as it sees them, requires it to stay a bijection, and compares
states through it.  Every pool and manager invariant is checked as well.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from experiments.prefix_cache import few_shot
from properties.harness import LockstepMachine, implementation_under_test, scaled
from spec import block_manager, block_pool
from spec import prefix_cache as model
from spec.block_pool import POLICIES

TOKENS = st.integers(0, 2)
EXTRA_KEYS = st.sampled_from([None, None, "lora-a", ("tenant", 7)])
NOT_EXTRA_KEYS = st.sampled_from([1.5, ["list"], frozenset({1})])
NOT_TOKENS = st.sampled_from([-1, 1.5, True, "7", None])


class PrefixCacheMachine(LockstepMachine):
    capacities = st.integers(2, 6)
    block_sizes = st.integers(1, 3)

    @initialize(data=st.data(), policy=st.sampled_from(POLICIES))
    def start(self, data: st.DataObject, policy: str) -> None:
        capacity = data.draw(self.capacities, label="capacity")
        block_size = data.draw(self.block_sizes, label="block size")
        self.record(
            f"manager = prefix_caching_manager(capacity={capacity}, block_size={block_size}, policy={policy!r})"
        )
        self.model = model.new_caching_manager(block_size, block_pool.new_pool(capacity, policy))
        pool = self.implementation.block_pool(capacity, policy)
        self.manager = self.implementation.prefix_caching_manager(pool, block_size)
        self.block_size = block_size
        self.prompts: list[tuple[int, ...]] = []
        self.pairs: set[tuple[object, model.IdealKey]] = set()
        self.next_id = 0

    # -- drawing -------------------------------------------------------------------

    def seq_id(self, data: st.DataObject, *, fresh: bool) -> int:
        """Mostly a new id (fresh) or a live sequence; sometimes one that makes the operation invalid."""
        live = sorted(self.model.manager.tables)
        usual = data.draw(st.integers(0, 4), label="usual id") > 0
        if fresh and usual:
            choice = self.next_id
        elif not fresh and usual and live:
            choice = data.draw(st.sampled_from(live), label="live seq")
        else:
            choice = data.draw(st.integers(0, self.next_id), label="any seq")
        self.next_id = max(self.next_id, choice + 1)
        return choice

    def prompt(self, data: st.DataObject) -> list[int]:
        size = self.block_size
        fresh = data.draw(st.lists(TOKENS, max_size=2 * size + 1), label="new tokens")
        if not self.prompts or data.draw(st.booleans(), label="from scratch"):
            return fresh or [0]
        base = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        return list(base[:cut]) + fresh or [0]

    # -- learning the hash <-> ideal key relation ------------------------------------

    def learn(self, tokens: tuple[int, ...], extra_key: model.ExtraKey) -> tuple[object, ...]:
        hashes = self.manager.block_hashes(tokens, extra_key)
        keys = model.ideal_keys(tokens, self.block_size, extra_key)
        self.check("invariant_result_matches_spec", len(keys), len(hashes))
        new = set(zip(hashes, keys, strict=True)) - self.pairs
        if new:
            self.pairs |= new
            self.check("invariant_hash_iff_prefix", self.pairs)
        return hashes

    def learn_sequence(self, seq: int) -> None:
        if seq in self.model.manager.tokens:
            self.learn(self.model.manager.tokens[seq], self.model.extra_keys[seq])

    # -- operations ----------------------------------------------------------------

    def write(self, label: str, seq: int, spec_call, impl_call, hits_possible: bool) -> None:
        before = self.manager.snapshot()
        result = self.lockstep(label, spec_call, impl_call, self.manager.snapshot)
        if result is None:
            return
        (self.model, expected), actual = result
        after = self.manager.snapshot()
        size = self.block_size
        self.learn_sequence(seq)
        self.check("invariant_hits_stop_at_first_miss", expected.cached_tokens // size, actual.cached_tokens, size)
        hits = after.tables[seq][: actual.cached_tokens // size] if hits_possible else ()
        prompt = self.model.manager.tokens[seq]
        self.check("invariant_hit_is_exact_prefix", before.pool, after.contents, hits, prompt, size)
        self.check("invariant_copy_on_write_exact", expected.copies, actual.copies)
        allocated = [
            b for b, r in enumerate(before.pool.refcounts) if r == 0 < after.pool.refcounts[b] and b not in hits
        ]
        allocated += [copy for _, copy in actual.copies]
        self.check("invariant_evicts_only_what_is_needed", before.pool, after.pool, allocated)
        event("prefix hit" if actual.cached_tokens else "no hit")

    @rule(data=st.data())
    def add_sequence(self, data: st.DataObject) -> None:
        seq, prompt = self.seq_id(data, fresh=True), self.prompt(data)
        extra_key = data.draw(EXTRA_KEYS, label="extra key")
        self.prompts.append(tuple(prompt))
        self.query_cached_prefix(prompt, extra_key)
        self.write(
            f"manager.add_sequence({seq}, {prompt}, extra_key={extra_key!r})",
            seq,
            lambda: model.add_sequence(self.model, seq, prompt, extra_key),
            lambda: self.manager.add_sequence(seq, prompt, extra_key),
            hits_possible=True,
        )

    @rule(data=st.data())
    def add_malformed_sequence(self, data: st.DataObject) -> None:
        seq = self.seq_id(data, fresh=True)
        prompt = data.draw(st.lists(st.one_of(TOKENS, NOT_TOKENS), max_size=3), label="prompt")
        extra_key = data.draw(st.one_of(EXTRA_KEYS, NOT_EXTRA_KEYS), label="extra key")
        self.write(
            f"manager.add_sequence({seq}, {prompt!r}, extra_key={extra_key!r})",
            seq,
            lambda: model.add_sequence(self.model, seq, prompt, extra_key),
            lambda: self.manager.add_sequence(seq, prompt, extra_key),
            hits_possible=True,
        )

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        seq = self.seq_id(data, fresh=False)
        tokens = data.draw(
            st.lists(st.one_of(TOKENS, TOKENS, NOT_TOKENS), max_size=self.block_size + 2), label="tokens"
        )
        self.write(
            f"manager.append({seq}, {tokens!r})",
            seq,
            lambda: model.append(self.model, seq, tokens),
            lambda: self.manager.append(seq, tokens),
            hits_possible=False,
        )

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent, child = self.seq_id(data, fresh=False), self.seq_id(data, fresh=True)
        result = self.lockstep(
            f"manager.fork({parent}, {child})",
            lambda: model.fork(self.model, parent, child),
            lambda: self.manager.fork(parent, child),
            self.manager.snapshot,
        )
        if result is not None:
            self.model = result[0]

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self.seq_id(data, fresh=False)
        if seq in self.model.manager.tokens:
            self.prompts.append(self.model.manager.tokens[seq])  # its full blocks stay cached: worth looking up
        result = self.lockstep(
            f"manager.free({seq})",
            lambda: model.free(self.model, seq),
            lambda: self.manager.free(seq),
            self.manager.snapshot,
        )
        if result is not None:
            self.model = result[0]

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        if self.prompts and data.draw(st.booleans(), label="an earlier prompt as is"):
            tokens = list(data.draw(st.sampled_from(self.prompts), label="earlier prompt"))
        else:
            tokens = self.prompt(data)
        self.query_cached_prefix(tokens, data.draw(EXTRA_KEYS, label="extra key"))

    def query_cached_prefix(self, tokens: list[int], extra_key: model.ExtraKey) -> None:
        """What a scheduler asks before admitting (vLLM's get_computed_blocks): it must change nothing."""
        before = self.manager.snapshot()
        result = self.lockstep(
            f"manager.cached_prefix({tokens}, extra_key={extra_key!r})",
            lambda: model.cached_prefix(self.model, tokens, extra_key),
            lambda: self.manager.cached_prefix(tokens, extra_key),
            self.manager.snapshot,
        )
        if result is None:
            return
        expected, actual = result
        size = self.block_size
        self.learn(tuple(tokens), extra_key)
        self.check("invariant_hits_stop_at_first_miss", len(expected), len(actual) * size, size)
        self.check("invariant_hit_is_exact_prefix", before.pool, before.contents, actual, tokens, size)

    @rule(n=st.integers(-1, 3))
    def evict(self, n: int) -> None:
        before = self.manager.snapshot()
        result = self.lockstep(
            f"manager.evict({n})",
            lambda: model.evict(self.model, n),
            lambda: self.manager.evict(n),
            self.manager.snapshot,
        )
        if result is None:
            return
        (self.model, expected), actual = result
        self.check("invariant_in_use_never_reclaimed", before.pool, self.manager.snapshot().pool, actual)
        self.check("invariant_eviction_order", expected, actual)

    @rule(data=st.data())
    def change_one_token(self, data: st.DataObject) -> None:
        """Lecture exercise 10: one changed token re-hashes its block and every later one."""
        size = self.block_size
        tokens = data.draw(st.lists(TOKENS, min_size=size, max_size=4 * size), label="tokens")
        extra_key = data.draw(EXTRA_KEYS, label="extra key")
        position = data.draw(st.integers(0, len(tokens) - 1), label="position")
        changed = list(tokens)
        changed[position] = tokens[position] + 1
        self.record(f"manager.block_hashes({tokens}) vs token {position} -> {changed[position]}")
        original = self.learn(tuple(tokens), extra_key)
        altered = self.learn(tuple(changed), extra_key)
        self.check("invariant_hash_change_propagates", original, altered, position // size)

    # -- after every step ----------------------------------------------------------

    @invariant()
    def matches_spec(self) -> None:
        if not hasattr(self, "model"):
            return
        state = self.manager.snapshot()
        expected = model.abstract(self.model)
        holders = block_manager.holders(state.tables)
        self.check("invariant_capacity_conserved", state.pool)
        self.check("invariant_free_queue_exact", state.pool)
        self.check("invariant_no_leak", state.pool, holders)
        self.check("invariant_refcount_matches_holders", state.pool, holders)
        self.check("invariant_hash_map_consistent", state.pool)
        self.check("invariant_eviction_order", expected.pool.free_queue, state.pool.free_queue)
        for seq, tokens in self.model.manager.tokens.items():
            self.check("invariant_reuse_preserves_read_back", seq, self.manager.read(seq), tokens)
        self.check("invariant_read_back_exact", state)
        self.check("invariant_waste_bounded", state)
        self.check("invariant_table_length_exact", state)
        rename = {block_hash: key for block_hash, key in self.pairs}
        self.check("invariant_manager_refines_spec", model.rename_hashes(state, rename), expected)

    def teardown(self) -> None:
        if hasattr(self, "model"):
            cached = sum(1 for h in self.model.manager.pool.block_hashes if h is not None)
            event(f"cached blocks at the end: {min(cached, 4)}{'+' if cached >= 4 else ''}")
        super().teardown()


class RealisticPrefixCacheMachine(PrefixCacheMachine):
    """The same rules with blocks of 16 tokens in a pool of 128, where scale bugs live."""

    capacities = st.just(128)
    block_sizes = st.just(16)


TestPrefixCache = PrefixCacheMachine.bind(implementation_under_test()).TestCase
TestRealisticPrefixCache = RealisticPrefixCacheMachine.bind(implementation_under_test()).TestCase
TestRealisticPrefixCache.settings = scaled(0.2)


def test_shared_system_prompt_hits_whole_blocks() -> None:
    """Two requests sharing 9 tokens with B = 4: the second reuses 2 full blocks and computes the rest."""
    implementation = implementation_under_test()
    manager = implementation.prefix_caching_manager(implementation.block_pool(8, "lru"), 4)
    first, second = list(range(9)) + [20, 21, 22], list(range(9)) + [30, 31, 32]
    manager.add_sequence(0, first)
    plan = manager.add_sequence(1, second)
    shared = set(manager.block_table(0)) & set(manager.block_table(1))
    assert (plan.cached_tokens, len(shared)) == (8, 2)
    assert manager.block_table(1)[:2] == manager.block_table(0)[:2]
    assert manager.read(1) == tuple(second)


def test_extra_key_separates_equal_prompts() -> None:
    implementation = implementation_under_test()
    manager = implementation.prefix_caching_manager(implementation.block_pool(8, "lru"), 4)
    manager.add_sequence(0, list(range(9)), extra_key="adapter-a")
    assert manager.add_sequence(1, list(range(9)), extra_key="adapter-b").cached_tokens == 0
    assert manager.add_sequence(2, list(range(9)), extra_key="adapter-a").cached_tokens == 8


def test_lecture_exercise_7_few_shot_savings() -> None:
    """Lecture §14 exercise 7 (exact): 8 requests, 5-shot prefix of 341 tokens, 20-token questions, B = 16:
    536 of 2,888 prefill tokens computed (81 % saved).  A partial tail block is never a hit."""
    implementation = implementation_under_test()

    def manager(capacity: int, block_size: int):
        return implementation.prefix_caching_manager(implementation.block_pool(capacity, "lru"), block_size)

    result = few_shot("exercise 7", 341, [20] * 8, 16, manager)
    assert (result.computed, result.without_cache) == (536, 2888)
    assert round(100 * result.saved) == 81
