"""Layer 5 conformance: logits through the paged cache equal logits through a contiguous twin.

The machine drives the implementation's paged KV cache (on its block pool and
manager) and a contiguous twin with the same tiny model: ragged steps that mix
new prompts, prefill chunks and decode tokens; forks whose next write copies
on write; parallel sampling, where the parent and its new forks each write a
token; beam-search steps that fork children of the surviving beams and drop
the parents; frees; and invalid operations.  Sequences live in a few fixed
slots, so every drawn operation means the same thing whatever ran before it
(a freed slot is reused by the next sequence put there), and a failure
shrinks to a few steps.  Every step revisits, as often as not: the admission
or extension refused last comes back, and an earlier prompt is admitted again
in its slot or another.  Every operation on the paged side runs in lockstep
with ``kvspec.spec.block_manager``'s model, and every forward is checked with
``invariant_paged_equals_contiguous``.

The yardstick -- the tiny model and the contiguous twin -- comes through the
implementation record like the cache under test (``tiny_model``,
``contiguous_kv_cache``; the reference's unless replaced), and so does the
benchmark's fast decode kernel (``decode_attention``), checked below against
formula (4) written out in numpy.  Rules for prefix hits and swap round trips
slot in as further ``@rule`` methods that change ``self.paged`` and
``self.twin`` together, and the caller's ledger of the sequences it holds
(``held``), which follows what the paged side carried out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import event, given, target
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.spec import block_manager as model
from kvspec.spec import block_pool
from kvspec.spec import paged_attention as spec
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import require

SIZES = {"vocab": 16, "d_model": 8, "heads": 2, "kv_heads": 1, "layers": 2, "mlp": 16, "seed": 7}
TOKENS = st.integers(0, SIZES["vocab"] - 1)
BLOCK_SIZES = st.one_of(st.sampled_from([1, 2, 3, 4, 16, 64]), st.integers(1, 80))
TOKEN_BUDGET = 96  # pool capacity in tokens, roughly: small enough that OutOfBlocks happens
MAX_BEAM = 4
SLOTS = 2 * MAX_BEAM  # sequence ids: room for a beam and its children
SEQS = st.integers(0, SLOTS - 1)


class PagedAttentionMachine(LockstepMachine):
    uses = frozenset({"tiny_model", "block_pool", "block_manager", "paged_kv_cache", "contiguous_kv_cache"})
    judges = ("paged_attention", "block_manager", "block_pool", "invariants")

    def forks(self) -> bool:
        return self.offers("paged_kv_cache", spec.FORK) and self.offers("block_manager", model.FORK)

    @initialize(block_size=BLOCK_SIZES, slack=st.integers(-1, 2))
    def start(self, block_size: int, slack: int) -> None:
        capacity = max(1, TOKEN_BUDGET // block_size + slack)
        self.record(f"paged, twin = caches(block_size={block_size}, capacity={capacity} blocks)")
        implementation = self.implementation
        self.network = implementation.tiny_model(**SIZES)  # the language model both caches serve
        policy = self.conventions.pool.policies[0]
        manager = implementation.block_manager(implementation.block_pool(capacity, policy), block_size)
        cache = implementation.paged_kv_cache(manager, self.network.config.kv_shape)
        pool = block_pool.new_pool(capacity, policy, self.conventions.pool)
        spec_manager = model.new_manager(pool, block_size, self.conventions.manager)
        self.paged = self.subject("paged", model, spec_manager, cache, snapshot=lambda: manager.snapshot())
        self.twin = implementation.contiguous_kv_cache(self.network.config.kv_shape)
        self.held: set[int] = set()  # the caller's ledger: the sequences the paged cache holds for it
        self.chunk = st.lists(TOKENS, min_size=1, max_size=min(2 * block_size + 1, 20))
        self.decode_or_chunk = st.one_of(st.lists(TOKENS, min_size=1, max_size=1), self.chunk)
        self.copies = 0
        self.deepest_fork = 0
        self.generation: dict[int, int] = {}
        self.prompts: list[tuple[int, list[int]]] = []  # (slot, prompt) of every admission
        self.refused: tuple[int, list[int]] | None = None  # the admission or extension refused last

    def live(self) -> list[int]:
        return sorted(self.held)

    def free_slots(self) -> list[int]:
        return [seq for seq in range(SLOTS) if seq not in self.held]

    def nearest_live(self, slot: int) -> int:
        """The drawn slot if it is live, else the next live one (cyclically): stable as other slots change."""
        return min(self.live(), key=lambda seq: (seq - slot) % SLOTS)

    def admit(self, seq: int, tokens: Sequence[int]) -> Sequence[int] | None:
        """Add or extend ``seq`` on both sides; the positions to compute, or None if rejected."""
        extending = seq in self.held
        operation = "append" if extending else "add_sequence"
        answer = self.paged(operation, seq, list(tokens), judged_by=None)
        if answer is None:
            self.refused = (seq, list(tokens))
            return None
        getattr(self.twin, operation)(seq, tokens)
        if extending:
            self.copies += len(answer.actual.copies)
            return tokens
        self.held.add(seq)
        self.generation[seq] = 0
        self.prompts.append((seq, list(tokens)))
        return tokens[answer.actual :]  # add_sequence answers how many leading tokens were cached

    def admit_and_forward(self, batch: Sequence[tuple[int, Sequence[int]]]) -> None:
        admitted = [(seq, self.admit(seq, tokens)) for seq, tokens in batch]
        batch = [(seq, tokens) for seq, tokens in admitted if tokens]
        if not batch:
            return
        self.record(f"forward({batch})")
        paged = self.network.forward(self.paged.impl, batch)
        contiguous = self.network.forward(self.twin, batch)
        self.check(spec.invariant_paged_equals_contiguous, [seq for seq, _ in batch], paged, contiguous)
        event(f"batch of {len(batch)}, {'mixed' if len({len(t) > 1 for _, t in batch}) > 1 else 'uniform'}")

    @rule(data=st.data(), seqs=st.lists(SEQS, min_size=1, max_size=3, unique=True))
    def step(self, data: st.DataObject, seqs: list[int]) -> None:
        """One ragged batch: new prompts (empty slots), prefill chunks and decode tokens (live ones) together,
        with what ``revisit`` brings back."""
        batch = dict(self.revisit(data))
        for seq in seqs:
            batch.setdefault(seq, data.draw(self.decode_or_chunk, label=f"tokens of {seq}"))
        self.admit_and_forward(list(batch.items()))

    def revisit(self, data: st.DataObject) -> list[tuple[int, list[int]]]:
        """Drawn inside every step, so that swarm testing never turns it off: as often as not, the admission or
        extension refused last again; as often, an earlier prompt again, in its slot if free or another."""
        entries = []
        if self.refused is not None and data.draw(st.booleans(), label="retry the refused call first"):
            entries.append(self.refused)
            self.refused = None
            event("revisit: retried a rejected call")
        free = [seq for seq in self.free_slots() if seq not in dict(entries)]
        if self.prompts and free and data.draw(st.booleans(), label="an earlier prompt"):
            slot, prompt = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
            seq = slot if slot in free else data.draw(st.sampled_from(free), label="free slot")
            event(f"revisit: re-admitted an earlier prompt in {'the same' if seq == slot else 'another'} slot")
            entries.append((seq, prompt))
        return entries

    @precondition(forks)
    @rule(parent=SEQS, child=SEQS)
    def fork(self, parent: int, child: int) -> None:
        self.fork_both(parent, child)

    def fork_both(self, parent: int, child: int) -> bool:
        if self.paged("fork", parent, child) is None:
            return False
        self.held.add(child)
        self.twin.fork(parent, child)
        self.generation[child] = self.generation[parent] + 1
        self.deepest_fork = max(self.deepest_fork, self.generation[child])
        return True

    @precondition(lambda self: self.held and self.forks())
    @rule(slot=SEQS, tokens=st.lists(TOKENS, min_size=2, max_size=4))
    def parallel_sampling(self, slot: int, tokens: list[int]) -> None:
        """The parent goes on as sample 0 beside its forks: the first writer copies on write."""
        parent = self.nearest_live(slot)
        samples = [parent] + [child for child in self.free_slots()[: len(tokens) - 1] if self.fork_both(parent, child)]
        self.admit_and_forward([(seq, [token]) for seq, token in zip(samples, tokens, strict=False)])

    @precondition(lambda self: self.held and self.forks())
    @rule(
        slots=st.lists(SEQS, min_size=1, max_size=MAX_BEAM),
        tokens=st.lists(TOKENS, min_size=MAX_BEAM, max_size=MAX_BEAM),
    )
    def beam_step(self, slots: list[int], tokens: list[int]) -> None:
        """Beam search: the next beams are children of a few survivors; every old beam is dropped."""
        beams = self.live()[-MAX_BEAM:]
        parents = [nearest_beam(beams, slot) for slot in slots]
        children = [
            child for parent, child in zip(parents, self.free_slots(), strict=False) if self.fork_both(parent, child)
        ]
        for beam in beams:
            self.free_both(beam)
        self.admit_and_forward([(child, [token]) for child, token in zip(children, tokens, strict=False)])
        event(f"beam step: {len(children)} children of {len(set(parents))} parents")

    def free_both(self, seq: int) -> None:
        if self.paged("free", seq) is not None:
            self.held.discard(seq)
            self.twin.free(seq)

    @rule(seq=SEQS)
    def free(self, seq: int) -> None:
        self.free_both(seq)

    @rule(seq=SEQS, tokens=st.lists(st.sampled_from([-1, 2.5, None, "3"]), min_size=1, max_size=2))
    def append_malformed(self, seq: int, tokens: list[object]) -> None:
        self.paged("append", seq, tokens)

    def teardown(self) -> None:
        if hasattr(self, "paged"):  # a run can end before its initialize rule
            target(float(self.deepest_fork), label="deepest fork chain")
            event("copy-on-write happened" if self.copies else "no copy-on-write")
        super().teardown()


def nearest_beam(beams: list[int], slot: int) -> int:
    """The beam at the drawn slot, else the next one (cyclically)."""
    return min(beams, key=lambda beam: (beam - slot) % SLOTS)


TestPagedAttention = conformance_test(PagedAttentionMachine, "paged attention logits")


def softmax_attention(query: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Formula (4), not blockwise: one query ``[heads, d]`` over keys and values ``[kv_heads, n, d]``."""
    kv_heads, _, dim = keys.shape
    grouped = query.reshape(kv_heads, -1, dim)
    scores = np.einsum("gqd,gnd->gqn", grouped, keys) / np.sqrt(dim)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("gqn,gnd->gqd", weights, values).reshape(query.shape)


@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    block_size=BLOCK_SIZES,
    chunk_blocks=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_fast_decode_kernel_equals_contiguous(
    kv_implementation: Implementation, lengths: list[int], block_size: int, chunk_blocks: int, seed: int
):
    """The benchmark's chunked, head-major decode kernel computes formula (4) over the sequence's keys."""
    rng = np.random.default_rng(seed)
    kv_heads, heads, dim = 2, 4, 8
    per_sequence = [model.blocks_for(n, block_size) for n in lengths]
    order = rng.permutation(sum(per_sequence))
    tables = np.split(order, np.cumsum(per_sequence)[:-1])
    key_blocks = rng.standard_normal((kv_heads, len(order), block_size, dim))
    value_blocks = rng.standard_normal((kv_heads, len(order), block_size, dim))
    queries = rng.standard_normal((len(lengths), heads, dim))
    fast = kv_implementation.decode_attention(queries, key_blocks, value_blocks, tables, lengths, chunk_blocks)
    for s, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        keys = key_blocks[:, table].reshape(kv_heads, -1, dim)[:, :n]
        values = value_blocks[:, table].reshape(kv_heads, -1, dim)[:, :n]
        reference = softmax_attention(queries[s], keys, values)
        require(spec.invariant_paged_equals_contiguous, [s], [fast[s]], [reference])
