"""Layer 3 conformance: the prefix-caching manager against ``kvspec.spec.prefix_cache``'s model.

The machine drives add (with extra keys) / append / fork / free / lookup /
evict, valid and invalid, serves whole requests the way an engine does
(look the prompt up, admit it, decode, finish), and probes the hash chain
with one-token and extra-key changes.  Prompts start with a cut of one of
three fixed documents (two share their first block and a token) and end with
new tokens from a three-letter alphabet, so hits, partial hits and duplicate
blocks are common; sequence ids come from a few fixed slots.  Every draw
means the same thing whatever ran before it, so failures shrink to a few
steps.  The machine learns the relation between the implementation's hashes
and the spec's ideal keys as it sees them, requires it to stay a bijection,
and compares states through it.  Every pool and manager invariant is checked
as well.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.properties.harness import LockstepMachine, conformance_test
from kvspec.spec import block_manager, block_pool
from kvspec.spec import prefix_cache as model
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import invariant_result_matches_spec

TOKENS = st.integers(0, 2)
EXTRA_KEYS = st.sampled_from([None, None, "lora-a", ("tenant", 7)])
NOT_EXTRA_KEYS = st.sampled_from([1.5, ["list"], frozenset({1})])
NOT_TOKENS = st.sampled_from([-1, 1.5, True, "7", None])
SEQS = st.integers(0, 3)  # the slots that sequences live in
REQUEST = 4  # the id a whole request is served under (serve_request frees it before returning)


def documents(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Three fixed texts prompts start from: the first two share one block and a token, the third nothing."""
    first = tuple(i % 3 for i in range(3 * block_size + 1))
    second = first[: block_size + 1] + tuple((t + 1) % 3 for t in first[block_size + 1 :])
    third = tuple(2 - t for t in first)
    return first, second, third


class PrefixCacheMachine(LockstepMachine):
    capacities = st.integers(2, 6)
    block_sizes = st.integers(1, 3)

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        capacity = data.draw(self.capacities, label="capacity")
        block_size = data.draw(self.block_sizes, label="block size")
        policy = data.draw(st.sampled_from(self.conventions.pool.policies), label="policy")
        self.record(
            f"manager = prefix_caching_manager(capacity={capacity}, block_size={block_size}, policy={policy!r})"
        )
        spec = model.new_caching_manager(block_size, block_pool.new_pool(capacity, policy, self.conventions.pool))
        pool = self.implementation.block_pool(capacity, policy)
        self.manager = self.subject(
            "manager", model, spec, self.implementation.prefix_caching_manager(pool, block_size)
        )
        self.block_size = block_size
        self.pairs: set[tuple[object, model.IdealKey]] = set()
        texts = documents(block_size)
        self.prompts = st.builds(
            lambda text, cut, new: list(text[:cut]) + new or [0],
            st.sampled_from(texts),
            st.integers(0, len(texts[0])),
            st.lists(TOKENS, max_size=block_size + 1),
        )
        self.new_tokens = st.lists(TOKENS, max_size=block_size + 2)

    # -- learning the hash <-> ideal key relation ------------------------------------

    def learn(self, tokens: tuple[int, ...], extra_key: model.ExtraKey) -> tuple[object, ...]:
        hashes = self.manager.impl.block_hashes(tokens, extra_key)
        keys = model.ideal_keys(tokens, self.block_size, extra_key)
        self.check(invariant_result_matches_spec, len(keys), len(hashes))
        new = set(zip(hashes, keys, strict=True)) - self.pairs
        if new:
            self.pairs |= new
            self.check(model.invariant_hash_iff_prefix, self.pairs)
        return hashes

    def learn_sequence(self, seq: int) -> None:
        if seq in self.manager.model.manager.tokens:
            self.learn(self.manager.model.manager.tokens[seq], self.manager.model.extra_keys[seq])

    # -- operations ----------------------------------------------------------------

    def write(self, operation: str, seq: int, *args: object) -> None:
        before = self.manager.snapshot()
        answer = self.manager(operation, seq, *args, judged_by=None)  # plans are judged piece by piece below
        if answer is None:
            return
        expected, actual = answer.expected, answer.actual
        after = self.manager.snapshot()
        size = self.block_size
        self.learn_sequence(seq)
        self.check(model.invariant_hits_stop_at_first_miss, expected.cached_tokens // size, actual.cached_tokens, size)
        hits = after.tables[seq][: actual.cached_tokens // size] if operation == "add_sequence" else ()
        prompt = self.manager.model.manager.tokens[seq]
        self.check(model.invariant_hit_is_exact_prefix, before.pool, after.contents, hits, prompt, size)
        self.check(block_manager.invariant_copy_on_write_exact, expected.copies, actual.copies)
        allocated = [
            b for b, r in enumerate(before.pool.refcounts) if r == 0 < after.pool.refcounts[b] and b not in hits
        ]
        allocated += [copy for _, copy in actual.copies]
        self.check(model.invariant_evicts_only_what_is_needed, before.pool, after.pool, allocated)
        event("prefix hit" if actual.cached_tokens else "no hit")

    @rule(seq=SEQS, data=st.data(), extra_key=EXTRA_KEYS)
    def add_sequence(self, seq: int, data: st.DataObject, extra_key: model.ExtraKey) -> None:
        self.admit(seq, data.draw(self.prompts, label="prompt"), extra_key)

    def admit(self, seq: int, prompt: list[int], extra_key: model.ExtraKey) -> None:
        """What a scheduler does: ask what is cached (changing nothing), then add the sequence."""
        self.query_cached_prefix(prompt, extra_key)
        self.write("add_sequence", seq, prompt, extra_key)

    @rule(seq=SEQS, data=st.data())
    def append(self, seq: int, data: st.DataObject) -> None:
        self.write("append", seq, data.draw(self.new_tokens, label="tokens"))

    @rule(data=st.data(), extra_key=EXTRA_KEYS)
    def serve_request(self, data: st.DataObject, extra_key: model.ExtraKey) -> None:
        """A whole request: look up, admit, decode, finish -- its full blocks stay cached in the free queue."""
        self.admit(REQUEST, data.draw(self.prompts, label="prompt"), extra_key)
        self.write("append", REQUEST, data.draw(self.new_tokens, label="decoded"))
        self.manager("free", REQUEST)

    @rule(seq=SEQS, append=st.booleans(), data=st.data())
    def malformed(self, seq: int, append: bool, data: st.DataObject) -> None:
        """An add or append with tokens that are not token ids, or an extra key that is not hashable data."""
        tokens = data.draw(st.lists(st.one_of(TOKENS, NOT_TOKENS), max_size=3), label="tokens")
        if append:
            self.write("append", seq, tokens)
            return
        extra_key = data.draw(st.one_of(EXTRA_KEYS, NOT_EXTRA_KEYS), label="extra key")
        self.write("add_sequence", seq, tokens, extra_key)

    @rule(parent=SEQS, child=SEQS)
    def fork(self, parent: int, child: int) -> None:
        self.manager("fork", parent, child)

    @rule(seq=SEQS)
    def free(self, seq: int) -> None:
        self.manager("free", seq)

    @rule(data=st.data(), extra_key=EXTRA_KEYS)
    def lookup(self, data: st.DataObject, extra_key: model.ExtraKey) -> None:
        self.query_cached_prefix(data.draw(self.prompts, label="prompt"), extra_key)

    def query_cached_prefix(self, tokens: list[int], extra_key: model.ExtraKey) -> None:
        """What a scheduler asks before admitting (vLLM's get_computed_blocks): it must change nothing."""
        before = self.manager.snapshot()
        answer = self.manager("cached_prefix", tokens, extra_key, judged_by=None)
        if answer is None:
            return
        size = self.block_size
        self.learn(tuple(tokens), extra_key)
        self.check(model.invariant_hits_stop_at_first_miss, len(answer.expected), len(answer.actual) * size, size)
        self.check(model.invariant_hit_is_exact_prefix, before.pool, before.contents, answer.actual, tokens, size)
        free_queue = model.abstract(self.manager.model).pool.free_queue  # a lookup is not a use: no block moves
        self.check(block_pool.invariant_eviction_order, free_queue, self.manager.snapshot().pool.free_queue)

    @rule(n=st.integers(-1, 3))
    def evict(self, n: int) -> None:
        before = self.manager.snapshot()
        answer = self.manager("evict", n, judged_by=block_pool.invariant_eviction_order)
        if answer is not None:
            after = self.manager.snapshot().pool
            self.check(block_pool.invariant_in_use_never_reclaimed, before.pool, after, answer.actual)

    @rule(data=st.data(), extra_key=EXTRA_KEYS, other_key=EXTRA_KEYS)
    def probe_hash_chain(self, data: st.DataObject, extra_key: model.ExtraKey, other_key: model.ExtraKey) -> None:
        """Lecture exercise 10: one changed token re-hashes its block and every later one; so does another extra key."""
        size = self.block_size
        tokens = data.draw(st.lists(TOKENS, min_size=size, max_size=4 * size), label="tokens")
        position = data.draw(st.integers(0, len(tokens) - 1), label="position")
        changed = list(tokens)
        changed[position] = tokens[position] + 1
        self.record(f"manager.block_hashes({tokens}) vs token {position} -> {changed[position]}, vs {other_key!r}")
        original = self.learn(tuple(tokens), extra_key)
        altered = self.learn(tuple(changed), extra_key)
        self.check(model.invariant_hash_change_propagates, original, altered, position // size)
        self.learn(tuple(tokens), other_key)

    # -- after every step ----------------------------------------------------------

    @invariant()
    def matches_spec(self) -> None:
        if not hasattr(self, "manager"):
            return
        state = self.manager.snapshot()
        expected = model.abstract(self.manager.model)
        self.check_group(block_manager.STATE, state)
        self.check(block_pool.invariant_eviction_order, expected.pool.free_queue, state.pool.free_queue)
        for seq, tokens in self.manager.model.manager.tokens.items():
            self.check(model.invariant_reuse_preserves_read_back, seq, self.manager.impl.read(seq), tokens)
        rename = {block_hash: key for block_hash, key in self.pairs}
        self.check(block_manager.invariant_manager_refines_spec, model.rename_hashes(state, rename), expected)

    def teardown(self) -> None:
        if hasattr(self, "manager"):
            cached = sum(1 for h in self.manager.model.manager.pool.block_hashes if h is not None)
            event(f"cached blocks at the end: {min(cached, 4)}{'+' if cached >= 4 else ''}")
        super().teardown()


class RealisticPrefixCacheMachine(PrefixCacheMachine):
    """The same rules with blocks of 16 tokens in a pool of 128, where scale bugs live."""

    capacities = st.just(128)
    block_sizes = st.just(16)


TestPrefixCache = conformance_test(PrefixCacheMachine)
TestRealisticPrefixCache = conformance_test(RealisticPrefixCacheMachine, examples=0.2)


def test_shared_system_prompt_hits_whole_blocks(kv_implementation: Implementation) -> None:
    """Two requests sharing 9 tokens with B = 4: the second reuses 2 full blocks and computes the rest."""
    manager = kv_implementation.prefix_caching_manager(kv_implementation.block_pool(8, "lru"), 4)
    first, second = list(range(9)) + [20, 21, 22], list(range(9)) + [30, 31, 32]
    manager.add_sequence(0, first)
    plan = manager.add_sequence(1, second)
    shared = set(manager.block_table(0)) & set(manager.block_table(1))
    assert (plan.cached_tokens, len(shared)) == (8, 2)
    assert manager.block_table(1)[:2] == manager.block_table(0)[:2]
    assert manager.read(1) == tuple(second)


def test_extra_key_separates_equal_prompts(kv_implementation: Implementation) -> None:
    manager = kv_implementation.prefix_caching_manager(kv_implementation.block_pool(8, "lru"), 4)
    manager.add_sequence(0, list(range(9)), extra_key="adapter-a")
    assert manager.add_sequence(1, list(range(9)), extra_key="adapter-b").cached_tokens == 0
    assert manager.add_sequence(2, list(range(9)), extra_key="adapter-a").cached_tokens == 8
