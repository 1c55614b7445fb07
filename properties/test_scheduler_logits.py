"""Layer 5 through layer 4: paged = contiguous logits for the KV a scheduler lays out.

``SwapSchedulerMachine`` (``kvspec.properties.test_scheduler``) runs as it is
-- lockstep with the spec's scheduler, every scheduler invariant -- with one
change: each device's block manager is reached through a paged KV cache of
the implementation (``KVBackedManager``), so every call the scheduler makes
(add, append with its copy-on-write copies, fork, free, the swap moves
between the GPU and the CPU) moves K and V as it moves blocks.  After each
step the tiny model computes the positions the step wrote on the GPU -- a
decode's token, every position of an admission (a first prefill, a
recomputed group's prompt and samples) and none of a swap-in -- through the
paged cache, and the logits must equal a contiguous twin's for the same
positions (``invariant_paged_equals_contiguous``).  The twin computes each
position of each sequence once and keeps its logits, so a recomputation is
compared with the first computation, and a swapped group's next token reads
KV that went to the CPU and back.  One addition: after the swap machine's
opening, each example opens with a group of two samples that comes back from
the CPU with each block's KV in another's block (``open_with_samples_exchanged``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import event
from hypothesis import strategies as st

from kvspec.properties.running import conformance_test
from kvspec.properties.test_scheduler import SwapSchedulerMachine
from kvspec.spec import block_manager, paged_attention, preemption, swap
from kvspec.spec import scheduler as model
from kvspec.spec.block_manager import SeqId
from kvspec.spec.paged_attention import PagedKVCache
from kvspec.spec.scheduler import Request

SIZES = {"vocab": 16, "d_model": 8, "heads": 2, "kv_heads": 1, "layers": 2, "mlp": 8, "seed": 3}


class KVBackedManager:
    """A device's block manager as the scheduler sees it, every write going through a paged KV cache.

    Reads (``pool``, ``block_table``, ``snapshot``, ...) go to the cache's manager; ``add_sequence``
    answers what the paged cache answers (the tokens a prefix hit supplied), not the manager's plan.
    """

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.copies = 0  # copy-on-write copies so far

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv.manager, name)

    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> int:
        return self.kv.add_sequence(seq, prompt)

    def append(self, seq: SeqId, tokens: Sequence[int]) -> Any:
        plan = self.kv.append(seq, tokens)
        self.copies += len(plan.copies) if plan is not None else 0
        return plan

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self.kv.fork(parent, child)

    def free(self, seq: SeqId) -> None:
        self.kv.free(seq)

    def move_sequences(self, dst: KVBackedManager, seqs: Sequence[SeqId]) -> tuple[tuple[int, int], ...]:
        return self.kv.move_sequences(dst.kv, seqs)


class PagedLogitsSchedulerMachine(SwapSchedulerMachine):
    """The swap scheduler over paged KV caches; every step's GPU writes computed and compared with a twin."""

    uses = frozenset(
        {"block_pool", "block_manager", "scheduler", "tiny_model", "paged_kv_cache", "contiguous_kv_cache"}
    )
    requires = {
        "scheduler": frozenset({preemption.SWAP_PREEMPTION}),
        "block_manager": frozenset({swap.SWAP}),
        "paged_kv_cache": frozenset({paged_attention.SWAP}),
    }
    judges = ("paged_attention", *SwapSchedulerMachine.judges)

    def device(self, capacity: int, block_size: int) -> KVBackedManager:
        impl = self.implementation
        if not hasattr(self, "tiny"):
            self.tiny = impl.tiny_model(**SIZES)
            self.twin = impl.contiguous_kv_cache(self.tiny.config.kv_shape)
            self.history: dict[SeqId, list[np.ndarray]] = {}  # the twin's logits of each position
            self.came_back: set[SeqId] = set()  # swapped in, not decoded since
        manager = impl.block_manager(impl.block_pool(capacity, "lru"), block_size)
        return KVBackedManager(impl.paged_kv_cache(manager, self.tiny.config.kv_shape))

    def open_with_group_finishing_apart(self, data: st.DataObject) -> None:
        """The swap machine's opening, then this machine's own (``open_with_samples_exchanged``)."""
        super().open_with_group_finishing_apart(data)
        self.open_with_samples_exchanged(data)

    def open_with_samples_exchanged(self, data: st.DataObject) -> None:
        """A group of two samples comes back from the CPU with each block's KV in another's block, and decodes.

        The swap machine's opening brings a lone sample back into its own blocks, in their order (the request
        that pushed it out took them and gives them back last taken first), and permuting whole blocks of one
        sequence changes no attention: a swap that puts K and V in the wrong blocks shows in neither.  Here, on
        the GPU the swap machine's opening left idle: a request C, its prompt one token short of gpu_blocks - 3
        blocks, and a group D of two samples of a one-block prompt.  C's first token and D's first (each sample's
        in a block of its own) fill the GPU, C's second needs a block, and D gives way: swapped, its manager
        frees the first sample's block, then the second's and the prompt's (the reference's order); C takes the
        first, finishes, and frees its blocks last taken first.  D comes back the next step with the prompt's
        KV in the block that held the second sample's, the first sample's in the prompt's, the second's in the
        first's, and decodes twice: whatever a swap misplaces, across samples, D's logits show.  A CPU too small
        for D's three blocks recomputes D instead; a GPU of six one-token blocks cannot hold D alone."""
        gpu_blocks, _, size = self.sizes
        # D decodes once before it gives way and twice after: a sample's last token is never compared (its
        # sequence is gone when the step's forward runs)
        fits = model.group_blocks(size, 3, 2, size) <= gpu_blocks
        if not fits or not self.offers("block_manager", block_manager.FORK) or self.scheduler.model.groups:
            return
        for length, max_new_tokens, n in (((gpu_blocks - 3) * size - 1, 2, 1), (size, 3, 2)):
            prompt = tuple(data.draw(st.lists(st.integers(0, 9), min_size=length, max_size=length), label="prompt"))
            self.next_id += 1
            self.arrive(Request(self.next_id, prompt, max_new_tokens, n))
        for _ in range(8):  # a bounded count: a step the implementation fails leaves the model as it was
            if not self.scheduler.model.groups:
                break
            self.step(1)

    def step(self, count: int) -> None:
        for _ in range(count):
            gpu = self.scheduler.impl.gpu
            before = {seq: len(gpu.read(seq)) for seq in gpu.sequences()}
            swapped, copies = set(self.scheduler.impl.cpu.sequences()), gpu.copies
            super().step(1)
            self.came_back |= swapped & set(gpu.sequences())
            if gpu.copies > copies:
                event("copy-on-write in a step")
            self.forward(before, swapped)

    def forward(self, before: dict[SeqId, int], swapped: set[SeqId]) -> None:
        """The positions the last step wrote on the GPU, through the paged cache and through the twin."""
        gpu = self.scheduler.impl.gpu
        batch = []
        for seq in gpu.sequences():
            tokens = [token % SIZES["vocab"] for token in gpu.read(seq)]
            start = before.get(seq, len(tokens) if seq in swapped else 0)
            if start < len(tokens):
                batch.append((seq, tokens, start))
        if not batch:
            return
        recomputed = {seq for seq, _, start in batch if start == 0 and seq in self.history}
        self.extend_twin(batch)
        self.record(f"gpu forward({[(seq, tokens[start:]) for seq, tokens, start in batch]})")
        paged = self.tiny.forward(gpu.kv, [(seq, tokens[start:]) for seq, tokens, start in batch])
        expected = [np.stack(self.history[seq][start : len(tokens)]) for seq, tokens, start in batch]
        seqs = [seq for seq, _, _ in batch]
        self.check(paged_attention.invariant_paged_equals_contiguous, seqs, paged, expected)
        for seq, _, start in batch:
            event(f"logits compared: {'a decode' if start else 'a prefill'}")
            if seq in recomputed:
                event("logits compared: a recompute, with the first computation")
            if start and seq in self.came_back:
                event("logits compared: a decode after a swap round trip")
        self.came_back -= set(seqs)

    def extend_twin(self, batch: list[tuple[SeqId, list[int], int]]) -> None:
        """The twin computes the positions it has not computed yet, each sequence once from its start."""
        alive = {seq for group in self.scheduler.impl.snapshot().groups for seq in group.seqs}
        for seq in [seq for seq in self.history if seq not in alive]:
            self.twin.free(seq)
            del self.history[seq]
        work = []
        for seq, tokens, _ in batch:
            known = len(self.history.get(seq, ()))
            if seq not in self.history:
                self.twin.add_sequence(seq, tokens)
                self.history[seq] = []
            elif known < len(tokens):
                self.twin.append(seq, tokens[known:])
            if known < len(tokens):
                work.append((seq, tokens[known:]))
        if work:
            for (seq, _), logits in zip(work, self.tiny.forward(self.twin, work), strict=True):
                self.history[seq].extend(logits)


TestPagedLogitsScheduler = conformance_test(
    PagedLogitsSchedulerMachine, "scheduler: paged = contiguous logits", examples=0.5
)
