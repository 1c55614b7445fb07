"""Layer 5 conformance across a sequence's life: paged = contiguous through prefix hits, swaps and recompute.

``invariant_paged_equals_contiguous`` must hold for any interleaving of
prefill, decode, fork, prefix hits, swap round trips and recompute.  This
machine drives the paged KV cache over a *prefix-caching* manager, on a pool
small enough that cached blocks are evicted, and adds the three things a
sequence's KV lives through besides decoding:

* **prefix hit** -- a new prompt starts with a cut of one of three fixed
  documents (two share their first block), so its leading full blocks are
  often cached: they are shared, and its forward computes only the suffix;
* **swap** -- a group moves with ``move_sequences`` to a CPU-side paged cache
  over a prefix-caching manager of its own, waits there while other sequences
  reuse the GPU blocks it left, and comes back (then decodes at once);
* **recompute** -- a sequence is freed and its prompt plus generated tokens
  admitted again as one prefill (often a hit on its own blocks, still cached
  in the free queue), then decodes.

The contiguous twin does none of this: each of its sequences computes every
position exactly once, and the machine keeps the twin's logits of every
position (``history``).  Every paged forward -- a suffix after a hit, a
decode after a swap, the prefill of a recompute -- is compared with the
twin's logits for the same positions.  The GPU and CPU managers run in
lockstep with ``kvspec.spec.prefix_cache``'s model, so verdicts (no room to admit,
a full CPU, a full GPU on swap-in) and hit lengths are the spec's.  Sequence
ids live in a few fixed slots, as in ``kvspec.properties.test_paged_attention``,
and every step revisits as that machine's does -- an earlier prompt admitted
after eviction took its cached blocks is a replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.properties.subjects import Subject
from kvspec.spec import block_manager, block_pool, paged_attention, swap
from kvspec.spec import prefix_cache as model
from kvspec.spec.components import Operation
from kvspec.spec.paged_attention import PagedKVCache

SIZES = {"vocab": 16, "d_model": 8, "heads": 2, "kv_heads": 1, "layers": 2, "mlp": 16, "seed": 7}
VOCAB = SIZES["vocab"]
TOKENS = st.integers(0, VOCAB - 1)
BLOCK_SIZES = st.one_of(st.sampled_from([1, 2, 3, 4, 16]), st.integers(1, 8))
TOKEN_BUDGET = 48  # GPU pool capacity in tokens, roughly: a few sequences, so admissions evict cached blocks
SLOTS = 6
SEQS = st.integers(0, SLOTS - 1)


def documents(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Three texts prompts start from: the first two share their first block and a token, the third nothing."""
    first = tuple((3 * i + 1) % VOCAB for i in range(2 * block_size + 2))
    second = first[: block_size + 1] + tuple((t + 5) % VOCAB for t in first[block_size + 1 :])
    third = tuple(VOCAB - 1 - t for t in first)
    return first, second, third


def forgotten(before: block_pool.PoolState, after: block_pool.PoolState) -> int:
    """Cached blocks whose hash an operation dropped: evictions."""
    return sum(1 for old, new in zip(before.block_hashes, after.block_hashes, strict=True) if old not in (None, new))


class PagedLifecycleMachine(LockstepMachine):
    uses = frozenset({"tiny_model", "block_pool", "prefix_caching_manager", "paged_kv_cache", "contiguous_kv_cache"})
    judges = ("paged_attention", "prefix_cache", "block_manager", "block_pool", "invariants")

    def offers_both(self, cache_operation: Operation, manager_operation: Operation) -> bool:
        """Whether the paged cache and its manager both offer an operation (each kind declares its own)."""
        return self.offers("paged_kv_cache", cache_operation) and self.offers(
            "prefix_caching_manager", manager_operation
        )

    @initialize(
        block_size=BLOCK_SIZES, slack=st.integers(-1, 2), cpu_share=st.sampled_from([0.25, 0.5, 1.0]), data=st.data()
    )
    def start(self, block_size: int, slack: int, cpu_share: float, data: st.DataObject) -> None:
        policy = data.draw(st.sampled_from(self.conventions.pool.policies), label="policy")
        texts = documents(block_size)
        longest_prompt = len(texts[0]) + block_size
        capacity = max(block_manager.blocks_for(longest_prompt, block_size) + 1, TOKEN_BUDGET // block_size + slack)
        cpu_capacity = max(1, int(capacity * cpu_share))
        self.record(
            f"gpu, cpu, twin = caches(block_size={block_size}, gpu={capacity} blocks, cpu={cpu_capacity}, {policy})"
        )
        implementation = self.implementation
        self.network = implementation.tiny_model(**SIZES)  # the language model both caches serve
        shape = self.network.config.kv_shape

        def paged_cache(blocks: int) -> PagedKVCache:
            pool = implementation.block_pool(blocks, policy)
            return implementation.paged_kv_cache(implementation.prefix_caching_manager(pool, block_size), shape)

        def device(name: str, blocks: int) -> Subject:
            spec = model.new_caching_manager(block_size, block_pool.new_pool(blocks, policy, self.conventions.pool))
            cache = paged_cache(blocks)
            return self.subject(name, model, spec, cache, snapshot=lambda: cache.manager.snapshot())

        self.gpu, self.cpu = device("gpu", capacity), device("cpu", cpu_capacity)
        self.twin = implementation.contiguous_kv_cache(shape)
        self.block_size = block_size
        self.prompts = st.builds(
            lambda text, cut, new: list(text[:cut]) + new or [0],
            st.sampled_from(texts),
            st.integers(0, len(texts[0])),
            st.lists(TOKENS, max_size=block_size),
        )
        # the caller's ledger, kept from what the paged side carried out: the tokens of each live sequence (on the
        # GPU or the CPU) and the twin's logits of each of its positions
        self.tokens: dict[int, list[int]] = {}
        self.history: dict[int, list[np.ndarray]] = {}
        self.gpu_held: set[int] = set()  # the sequences the GPU cache holds (the others of history are on the CPU)
        self.swapped: list[tuple[int, ...]] = []  # groups on the CPU, in the order they left
        self.admitted: list[tuple[int, list[int], int]] = []  # (slot, prompt, evictions then) of every admission
        self.refused: tuple[int, list[int]] | None = None  # the admission or extension refused last
        self.evictions = 0  # cached blocks evicted so far on the GPU

    # -- where sequences are ---------------------------------------------------------

    def on_gpu(self) -> list[int]:
        return sorted(self.gpu_held)

    def empty_slots(self) -> list[int]:
        return [seq for seq in range(SLOTS) if seq not in self.history]

    @staticmethod
    def nearest(candidates: Sequence[int], slot: int, default: int) -> int:
        """The drawn slot if it is a candidate, else the next one (cyclically): stable as other slots change."""
        return min(candidates, key=lambda seq: (seq - slot) % SLOTS, default=default)

    # -- the paged side, in lockstep with the spec -------------------------------------

    def admit(self, seq: int, tokens: Sequence[int], why: str) -> Sequence[int] | None:
        """Add or extend ``seq`` on the GPU; the positions its forward computes, or None if rejected."""
        before = self.gpu.snapshot().pool
        if seq in self.gpu_held:
            if self.gpu("append", seq, list(tokens), judged_by=None) is None:
                return None
            computed = tokens
        else:
            answer = self.gpu("add_sequence", seq, list(tokens), judged_by=None)
            if answer is None:
                return None
            self.gpu_held.add(seq)
            size, cached = self.block_size, answer.actual
            hashes = self.gpu.impl.manager.block_hashes(list(tokens))
            self.check(model.invariant_hits_stop_at_first_miss, before, hashes, cached, size)
            hits = cached // size
            event(f"{why}: hit of {hits if hits < 4 else '4+'} blocks")
            computed = tokens[cached:]
        evicted = forgotten(before, self.gpu.snapshot().pool)
        if evicted:
            self.evictions += evicted
            event("a write evicted cached blocks")
        return computed

    def forward(self, batch: Sequence[tuple[int, Sequence[int]]]) -> None:
        """The paged forward of ``batch``; its logits must be the twin's for the same positions."""
        if not batch:
            return
        self.record(f"gpu forward({[(seq, list(tokens)) for seq, tokens in batch]})")
        paged = self.network.forward(self.gpu.impl, batch)
        twins = [np.stack(self.history[seq][len(self.history[seq]) - len(tokens) :]) for seq, tokens in batch]
        self.check(paged_attention.invariant_paged_equals_contiguous, [seq for seq, _ in batch], paged, twins)

    def run_batch(self, entries: Sequence[tuple[int, Sequence[int]]]) -> list[int]:
        """One iteration: admit or extend each entry on both sides, then one ragged forward each; who ran."""
        paged_batch, twin_batch = [], []
        for seq, tokens in entries:
            computed = self.admit(seq, tokens, "admission")
            if computed is None:
                self.refused = (seq, list(tokens))
                continue
            if seq in self.history:
                self.twin.append(seq, tokens)
                self.tokens[seq] += tokens
            else:
                self.twin.add_sequence(seq, tokens)
                self.tokens[seq], self.history[seq] = list(tokens), []
                self.admitted.append((seq, list(tokens), self.evictions))
            paged_batch.append((seq, computed))
            twin_batch.append((seq, tokens))
        if twin_batch:
            for (seq, _), logits in zip(twin_batch, self.network.forward(self.twin, twin_batch), strict=True):
                self.history[seq].extend(logits)
        self.forward(paged_batch)
        return [seq for seq, _ in paged_batch]

    def free_gpu(self, seq: int) -> bool:
        """Free ``seq`` on the GPU; whether it was."""
        if self.gpu("free", seq) is None:
            return False
        self.gpu_held.discard(seq)
        return True

    def forget(self, seq: int) -> None:
        self.twin.free(seq)
        del self.tokens[seq], self.history[seq]

    # -- rules -------------------------------------------------------------------------

    @rule(data=st.data(), slots=st.lists(SEQS, min_size=1, max_size=3, unique=True))
    def step(self, data: st.DataObject, slots: list[int]) -> None:
        """A ragged batch: new prompts (empty slots), which may hit the cache, beside decodes (sequences on the GPU)."""
        on_gpu, entries = self.on_gpu(), self.revisit(data)
        for seq in (slot for slot in slots if slot not in dict(entries)):
            if seq in on_gpu:
                entries.append((seq, [data.draw(TOKENS, label=f"token of {seq}")]))
            elif seq not in self.history:
                entries.append((seq, data.draw(self.prompts, label=f"prompt of {seq}")))
        if len(self.run_batch(entries)) > 1:
            event("ragged batch" if len({len(tokens) for _, tokens in entries}) > 1 else "uniform batch")

    def revisit(self, data: st.DataObject) -> list[tuple[int, list[int]]]:
        """Drawn inside every step, so that swarm testing never turns it off: as often as not, the admission or
        decode refused last again (if its sequence is still where it was); as often, an earlier prompt again, in
        its slot if empty or another -- after eviction took its cached blocks, a replay."""
        entries = []
        if self.refused is not None and data.draw(st.booleans(), label="retry the refused call first"):
            (seq, tokens), self.refused = self.refused, None
            if (seq in self.on_gpu()) == (seq in self.history):
                event("revisit: retried a rejected call")
                entries.append((seq, tokens))
        empty = [seq for seq in self.empty_slots() if seq not in dict(entries)]
        if self.admitted and empty and data.draw(st.booleans(), label="an earlier prompt"):
            slot, prompt, evictions = data.draw(st.sampled_from(self.admitted), label="earlier prompt")
            seq = slot if slot in empty else data.draw(st.sampled_from(empty), label="empty slot")
            event(f"revisit: re-admitted an earlier prompt in {'the same' if seq == slot else 'another'} slot")
            if evictions < self.evictions:
                event("revisit: replayed a prompt after eviction")
            entries.append((seq, prompt))
        return entries

    @precondition(lambda self: self.offers_both(paged_attention.FORK, block_manager.FORK))
    @rule(parent=SEQS, child=SEQS)
    def fork(self, parent: int, child: int) -> None:
        """A fork shares every block; the next write of either side into a partial one copies on write."""
        if not self.empty_slots():
            return  # every id is taken on the GPU or the CPU; a scheduler never reuses one that is swapped out
        parent = self.nearest(self.on_gpu(), parent, default=parent)  # none on the GPU: rejected
        child = self.nearest(self.empty_slots(), child, default=child)
        if self.gpu("fork", parent, child) is not None:
            self.gpu_held.add(child)
            self.twin.fork(parent, child)
            self.tokens[child], self.history[child] = list(self.tokens[parent]), list(self.history[parent])

    @rule(slot=SEQS)
    def free(self, slot: int) -> None:
        """The nearest sequence on the GPU; a swapped-out one (its blocks are on the CPU) must be rejected."""
        swapped = {seq for group in self.swapped for seq in group}
        seq = slot if slot in swapped else self.nearest(self.on_gpu(), slot, default=slot)
        if self.free_gpu(seq):
            self.forget(seq)

    @precondition(lambda self: self.offers_both(paged_attention.SWAP, swap.SWAP))
    @rule(slots=st.lists(SEQS, min_size=1, max_size=3))
    def swap_out(self, slots: list[int]) -> None:
        """A group leaves for the CPU, all or nothing; with nothing on the GPU the move must be rejected."""
        group = tuple(sorted({self.nearest(self.on_gpu(), slot, default=slot) for slot in slots}))
        if self.gpu("move_sequences", self.cpu, group, judged_by=None) is not None:
            self.gpu_held -= set(group)
            self.swapped.append(group)
            event(f"swap out: group of {len(group)}")

    @precondition(lambda self: self.offers_both(paged_attention.SWAP, swap.SWAP))
    @rule(index=st.integers(0, SLOTS - 1), token=TOKENS)
    def swap_in(self, index: int, token: int) -> None:
        """A group comes back to the GPU and decodes in the same iteration, as a scheduler resumes it."""
        group = self.swapped[index % len(self.swapped)] if self.swapped else (index,)  # none: rejected
        before = self.gpu.snapshot().pool
        if self.cpu("move_sequences", self.gpu, group, judged_by=None) is None:
            return
        self.gpu_held |= set(group)
        self.swapped.remove(group)
        if forgotten(before, self.gpu.snapshot().pool):
            event("a swap-in evicted cached blocks")
        if self.run_batch([(seq, [token]) for seq in group]):
            event("decode after a swap round trip")

    @rule(slot=SEQS, token=TOKENS)
    def recompute(self, slot: int, token: int) -> None:
        """Preemption by recompute: free, then prefill prompt + generated again; the twin keeps its KV."""
        if not self.on_gpu():
            return
        seq = self.nearest(self.on_gpu(), slot, default=slot)
        tokens = self.tokens[seq]
        if not self.free_gpu(seq):
            return
        computed = self.admit(seq, tokens, "recompute")
        if computed is None:
            event("recompute found no room: the sequence is dropped")
            self.forget(seq)
            return
        self.forward([(seq, computed)])
        if self.run_batch([(seq, [token])]):
            event("decode after a recompute")


TestPagedAttentionLifecycle = conformance_test(PagedLifecycleMachine, "paged attention: hits, swap, recompute")
