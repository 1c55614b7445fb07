"""Broken block managers: each breaks a rule of ``kvspec.spec.block_manager`` and declares what catches it."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvspec.impl.block_manager import BlockManager, CopyingForkBlockManager
from kvspec.impl.broken import members
from kvspec.spec import block_manager as spec
from kvspec.spec import block_pool, speculative, tiered_swap
from kvspec.spec.block_manager import SeqId, WritePlan
from kvspec.spec.conventions import Conventions, ManagerConventions
from kvspec.spec.invariants import (
    invariant_failed_operation_changes_nothing,
    invariant_out_of_contract_call_rejected,
    invariant_verdict_matches_spec,
)
from kvspec.spec.speculative import check_rollback

# A member: its block manager, and the rules that catch it in that machine.
manager = members("block_manager", "block manager")
tiered = members("block_manager", "tiered swap (partial swap-in)")


class NoCopyOnWrite(BlockManager):
    """Writes straight into a shared partial block: the siblings sharing it read the writer's token."""

    def _needs_copy(self, seq: SeqId) -> bool:
        return False


no_copy_on_write = manager(
    "copy-on-write missing",
    NoCopyOnWrite,
    spec.invariant_read_back_exact,
    invariant_verdict_matches_spec,
    spec.invariant_copy_on_write_exact,
)


class CopiesWrongBlock(BlockManager):
    """Copy-on-write copies the sequence's first block instead of its last."""

    def _copy_last_block(self, seq: SeqId) -> tuple[int, int]:
        source, copy = super()._copy_last_block(seq)
        first = self._tables[seq][0] if len(self._tables[seq]) > 1 else source
        self._contents[copy] = self._contents[first][: len(self._contents[copy])]
        return source, copy


copies_wrong_block = manager("copy-on-write copies the wrong block", CopiesWrongBlock, spec.invariant_read_back_exact)


class ForkWithoutShare(BlockManager):
    """Copies the parent's table without taking references on its blocks."""

    def fork(self, parent: SeqId, child: SeqId) -> None:
        table = self._table(parent)
        self._require_new(child)
        self._tables[child] = list(table)
        self._tokens[child] = list(self._tokens[parent])


fork_without_share = manager(
    "fork does not increment refcounts", ForkWithoutShare, block_pool.invariant_refcount_matches_holders
)


class CopiesOnFork(BlockManager):
    """A legal choice left undeclared: the child's partial last block is copied when it forks (HF transformers'
    fork), not when either first writes into it, while it declares the reference's ``fork_partial_block="share"``.
    Only when a block is allocated differs (a convention finding); every sequence reads back what it wrote."""

    def fork(self, parent: SeqId, child: SeqId) -> None:
        super().fork(parent, child)
        if len(self._tokens[child]) % self._block_size and self._pool.num_free():
            self._copy_last_block(child)


copies_on_fork = manager(
    "a legal choice, undeclared: copies the partial block at fork", CopiesOnFork, spec.invariant_fork_allocates_nothing
)
COPIES_AT_FORK = Conventions(manager=ManagerConventions(fork_partial_block="copy"))


class LeavesTheForkCopyEmpty(CopyingForkBlockManager):
    """Declares the fork's copy of the partial last block and allocates it, but never copies the slots into it
    (HF's ``perform_cache_copy`` left out): the child reads whatever the fresh block last held."""

    def _fork_table(self, parent: SeqId) -> list[int]:
        contents = list(self._contents)
        table = super()._fork_table(parent)
        for block in table:
            self._contents[block] = contents[block]
        return table


leaves_the_fork_copy_empty = manager(
    "the fork's copy of the partial block is never filled",
    LeavesTheForkCopyEmpty,
    spec.invariant_read_back_exact,
    conventions=COPIES_AT_FORK,
)


class CopiesFullBlocksAtFork(CopyingForkBlockManager):
    """Declares the fork's copy of the partial last block, then copies the full blocks too (HF's fork with block
    sharing off): the memory that sharing saves parallel sampling is spent at the fork."""

    def _fork_table(self, parent: SeqId) -> list[int]:
        table = super()._fork_table(parent)
        for index in range(min(len(self._tokens[parent]) // self._block_size, self._pool.num_free())):
            (copy,) = self._pool.allocate(1)
            self._contents[copy] = self._contents[table[index]]
            self._pool.release([table[index]])
            table[index] = copy
        return table


copies_full_blocks_at_fork = manager(
    "the fork copies full blocks too",
    CopiesFullBlocksAtFork,
    spec.invariant_fork_allocates_nothing,
    conventions=COPIES_AT_FORK,
)


class ReservesAheadBlock(BlockManager):
    """Reserves one spare block per new sequence "for the tokens to come"."""

    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> WritePlan:
        plan = super().add_sequence(seq, prompt)
        if self._pool.num_free():
            self._tables[seq].extend(self._pool.allocate(1))
        return plan


reserves_ahead_block = manager(
    "waste bound broken by reservation",
    ReservesAheadBlock,
    spec.invariant_waste_bounded,
    spec.invariant_table_length_exact,
)


class FreesFirstBlockFirst(BlockManager):
    """A legal choice kvspec does not model: a table is released front to back (LMDeploy's ``DefaultBlockManager``),
    not last block first, so a sequence's shared prefix is queued for eviction first.  Only the eviction order
    differs (a convention finding); every count and holder is right."""

    def free(self, seq: SeqId) -> None:
        self._pool.release(self._table(seq))
        del self._tables[seq], self._tokens[seq]


frees_first_block_first = manager(
    "a legal choice: frees a table front to back", FreesFirstBlockFirst, spec.invariant_manager_refines_spec
)


class KeepsPromptBuffer(BlockManager):
    """Keeps the caller's prompt list as the sequence's tokens instead of a copy, and appends to it."""

    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> WritePlan:
        plan = super().add_sequence(seq, prompt)
        if isinstance(prompt, list):
            self._tokens[seq] = prompt
        return plan


keeps_prompt_buffer = manager(
    "keeps an alias of the caller's prompt list", KeepsPromptBuffer, spec.invariant_read_back_exact
)


class AppendNotAtomic(BlockManager):
    """Writes as far as the free blocks go before running out."""

    def _ensure_room(self, needed: int) -> None:
        """No check: ``_write`` raises part-way instead."""


append_not_atomic = manager(
    "failed append not rolled back", AppendNotAtomic, invariant_failed_operation_changes_nothing
)


class SkipsInDeviceBlocks(BlockManager):
    """The partial swap-in's offset into a tier block counts device blocks where tokens were meant."""

    def _load_plan(
        self, resident: int, factor: int, tiers: list[tuple[Hashable, int]]
    ) -> list[tuple[int, Hashable, int]]:
        plan = super()._load_plan(resident, factor, tiers)
        return [(index, key, offset // self.block_size) for index, key, offset in plan]


skips_in_device_blocks = tiered(
    "a tier block's offset counted in device blocks",
    SkipsInDeviceBlocks,
    tiered_swap.invariant_tier_blocks_cover_loaded_blocks,
)


class LoadsOverResidentPrefix(BlockManager):
    """The partial swap-in skips the resident part of the first tier block when it reads it, but writes from that
    tier block's first device block on: the suffix lands over the resident prefix."""

    def _load_plan(
        self, resident: int, factor: int, tiers: list[tuple[Hashable, int]]
    ) -> list[tuple[int, Hashable, int]]:
        plan = super()._load_plan(resident, factor, tiers)
        return [(index - resident % factor, key, offset) for index, key, offset in plan]


loads_over_resident_prefix = tiered(
    "the suffix loads over the resident prefix",
    LoadsOverResidentPrefix,
    tiered_swap.invariant_load_lands_after_resident_prefix,
)


class SkipsEveryResidentBlock(BlockManager):
    """The partial swap-in skips as many device blocks of the first tier block as the sequence has resident in
    all, where only those inside that tier block were meant: the rest of that tier block never comes back."""

    def _load_plan(
        self, resident: int, factor: int, tiers: list[tuple[Hashable, int]]
    ) -> list[tuple[int, Hashable, int]]:
        first = tiers[0][0]
        kept = [
            (k, o)
            for _, k, o in super()._load_plan(resident, factor, tiers)
            if k != first or o >= resident * self.block_size
        ]
        return [(resident + n, key, offset) for n, (key, offset) in enumerate(kept)]


skips_every_resident_block = tiered(
    "skips every resident block in the first tier block",
    SkipsEveryResidentBlock,
    tiered_swap.invariant_swap_round_trip_exact,
)


class KeepsRejectedDraftBlock(BlockManager):
    """A rollback drops the rejected tokens but keeps every block the draft took, as an engine that keeps its
    lookahead slots for the next draft: a block no token is in stays out of the free queue."""

    def rollback(self, seq: SeqId, n: int) -> None:
        self._table(seq)
        tokens = self._tokens[seq]
        del tokens[len(tokens) - check_rollback(seq, n, len(tokens)) :]


keeps_rejected_draft_block = manager(
    "rollback keeps the blocks of rejected drafts", KeepsRejectedDraftBlock, spec.invariant_table_length_exact
)


class RollsBackFirstBlocks(BlockManager):
    """A rollback releases the blocks it no longer needs from the front of the table (``del table[:k]`` where
    ``del table[-k:]`` was meant): the tokens kept are read from the blocks after their own."""

    def rollback(self, seq: SeqId, n: int) -> None:
        table, tokens = self._table(seq), self._tokens[seq]
        kept = len(tokens) - check_rollback(seq, n, len(tokens))
        surplus = len(table) - spec.blocks_for(kept, self._block_size)
        self._pool.release(table[:surplus][::-1])
        del table[:surplus], tokens[kept:]


rolls_back_first_blocks = manager(
    "rollback releases the first blocks, not the last",
    RollsBackFirstBlocks,
    speculative.invariant_rollback_keeps_prefix,
)


class ClampsRollback(BlockManager):
    """A rollback of more tokens than the sequence holds empties it instead of being refused (``min(n, len)``, as
    a scheduler that trusts its own count of accepted tokens)."""

    def rollback(self, seq: SeqId, n: int) -> None:
        held = len(self._tokens[seq]) if seq in self._tokens else 0
        super().rollback(seq, min(n, held) if isinstance(n, int) else n)


clamps_rollback = manager(
    "an over-long rollback empties the sequence", ClampsRollback, invariant_out_of_contract_call_rejected
)
