"""The reference block manager: block tables over any ``BlockPool``.

Each write is checked for room before anything changes, so ``OutOfBlocks``
leaves the manager as it was.  Slots live in a per-block list of token ids;
a KV store mirrors them through the ``WritePlan`` each write returns.

Speed: a serving step appends a token or a few to every running sequence, so a
write checks a plain list of ints in C (``checked_tokens``), asks once whether the last
block must be copied (for the room it needs and for the write), and fills a
block's slots a block at a time, not a token at a time: the pool is asked for a
reference count once an append, and otherwise sees the same calls in the same order.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Hashable, Sequence

from kvspec.spec.block_manager import ManagerState, SeqId, WritePlan, blocks_for, check_block_size, check_tokens
from kvspec.spec.block_pool import BlockPool as BlockPoolProtocol
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.kv_store import KVStore
from kvspec.spec.speculative import check_rollback
from kvspec.spec.tiered_swap import TierLoad, require_continuation, tier_contents, tier_factor

_INT = {int}


def checked_tokens(tokens: Sequence[int], allow_empty: bool) -> tuple[int, ...]:
    """``check_tokens``, with the common case -- a non-empty list or tuple of plain non-negative ints -- checked in C;
    anything else gets the exact check and its error."""
    kind = type(tokens)
    if kind is list or kind is tuple:
        if len(tokens) == 1:  # a decode step's token
            token = tokens[0]
            if type(token) is int and token >= 0:
                return (token,)
        elif tokens and set(map(type, tokens)) == _INT and min(tokens) >= 0:
            return tokens if kind is tuple else tuple(tokens)  # type: ignore[return-value]  # a tuple, checked
    return check_tokens(tokens, allow_empty=allow_empty)


class BlockManager:
    """Sequences, their block tables and the token ids in their slots."""

    def __init__(self, pool: BlockPoolProtocol, block_size: int) -> None:
        self._block_size = check_block_size(block_size)
        self._pool = pool
        self._tables: dict[SeqId, list[int]] = {}
        self._tokens: dict[SeqId, list[int]] = {}
        # what each block's slots hold, immutable: a write gives its block a new run, so a block never handed out
        # is the one empty run (a pool of many blocks costs no object per block)
        self._contents: list[tuple[int, ...]] = [()] * pool.capacity

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def pool(self) -> BlockPoolProtocol:
        return self._pool

    def sequences(self) -> tuple[SeqId, ...]:
        return tuple(self._tables)

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._table(seq))

    def read(self, seq: SeqId) -> tuple[int, ...]:
        table, size = self._table(seq), self._block_size
        return tuple(self._contents[table[i // size]][i % size] for i in range(len(self._tokens[seq])))

    def add_sequence(self, seq: SeqId, prompt: Sequence[int]) -> WritePlan:
        prompt = checked_tokens(prompt, allow_empty=False)
        self._require_new(seq)
        self._ensure_room(blocks_for(len(prompt), self._block_size))
        self._tables[seq], self._tokens[seq] = [], []
        return self._write(seq, prompt)

    def append(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan:
        tokens = checked_tokens(tokens, allow_empty=True)
        table, size = self._table(seq), self._block_size
        offset = len(self._tokens[seq]) % size
        if len(tokens) == 1 and offset and not self._needs_copy(seq):  # a decode step into its own partial block
            block = table[-1]
            self._contents[block] = self._contents[block][:offset] + tokens
            self._tokens[seq] += tokens
            if offset + 1 == size:
                self._block_filled(seq, len(table) - 1)
            return WritePlan(slots=((block, offset),))
        copies_last_block = bool(tokens) and bool(self._needs_copy(seq))
        self._ensure_room(self._blocks_needed(seq, len(tokens)) + copies_last_block)
        return self._write(seq, tokens, copies_last_block)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self._table(parent)
        self._require_new(child)
        self._tables[child] = self._fork_table(parent)
        self._tokens[child] = list(self._tokens[parent])

    def free(self, seq: SeqId) -> None:
        self._pool.release(self._table(seq)[::-1])
        del self._tables[seq], self._tokens[seq]

    def move_sequences(self, dst: BlockManager, seqs: Sequence[SeqId]) -> tuple[tuple[int, int], ...]:
        if not seqs or len(set(seqs)) != len(seqs):
            raise InvalidOperation(f"a group to move needs distinct sequences, got {list(seqs)!r}")
        for seq in seqs:
            self._table(seq)
            dst._require_new(seq)
        if dst.block_size != self._block_size:
            raise InvalidOperation(f"block sizes differ: {self._block_size} and {dst.block_size}")
        distinct = list(dict.fromkeys(b for seq in seqs for b in self._tables[seq]))
        fresh = dst.pool.allocate(len(distinct))
        mapping = dict(zip(distinct, fresh, strict=True))
        group_holders = Counter(b for seq in seqs for b in self._tables[seq])
        dst.pool.share([mapping[b] for b, n in group_holders.items() for _ in range(n - 1)])
        for old, new in mapping.items():
            dst._contents[new] = self._contents[old]
        for seq in seqs:
            dst._tables[seq] = [mapping[b] for b in self._tables[seq]]
            dst._tokens[seq] = list(self._tokens[seq])
            self.free(seq)
        return tuple(mapping.items())

    def truncate(self, seq: SeqId, blocks: int) -> None:
        table = self._table(seq)
        if not isinstance(blocks, int) or isinstance(blocks, bool) or not 0 <= blocks <= len(table):
            raise InvalidOperation(f"sequence {seq!r} has {len(table)} blocks: it cannot keep {blocks!r}")
        self._pool.release(table[blocks:][::-1])
        del table[blocks:], self._tokens[seq][blocks * self._block_size :]

    def rollback(self, seq: SeqId, n: int) -> None:
        table, tokens = self._table(seq), self._tokens[seq]
        kept = len(tokens) - check_rollback(seq, n, len(tokens))
        needed = blocks_for(kept, self._block_size)
        self._pool.release(table[needed:][::-1])
        del table[needed:], tokens[kept:]

    def swap_in(
        self, store: KVStore, node: int, tier_block_size: int, seq: SeqId, keys: Sequence[Hashable]
    ) -> TierLoad:
        table, tokens, size = self._table(seq), self._tokens[seq], self._block_size
        factor = tier_factor(tier_block_size, size)
        contents = dict(zip(keys, tier_contents(store.snapshot(), node, keys), strict=True))
        require_continuation(seq, tokens, size, tier_block_size, list(contents.values()))
        plan = self._load_plan(len(table), factor, [(key, len(contents[key])) for key in keys])
        needed = sum(1 for index, _, _ in plan if index >= len(table))
        self._ensure_room(needed)
        fresh = iter(self._pool.allocate(needed))
        for index, key, offset in plan:
            if index >= len(table):
                table.append(next(fresh))
            self._contents[table[index]] = tuple(contents[key][offset : offset + size])
            tokens += self._contents[table[index]]
        return tuple((table[index], key, offset) for index, key, offset in plan)

    def _load_plan(
        self, resident: int, factor: int, tiers: list[tuple[Hashable, int]]
    ) -> list[tuple[int, Hashable, int]]:
        """(device block index, tier key, token offset) of each block to load, after the resident ones."""
        plan, index = [], resident
        for number, (key, length) in enumerate(tiers):
            for part in range(resident % factor if number == 0 else 0, blocks_for(length, self._block_size)):
                plan.append((index, key, part * self._block_size))
                index += 1
        return plan

    def snapshot(self) -> ManagerState:
        pool = self._pool.snapshot()
        # the blocks in use or cached, found in C: a count above zero, or a hash (a pool holds mostly neither)
        cached = map(operator.is_not, pool.block_hashes, itertools.repeat(None))
        in_use = map(operator.gt, pool.refcounts, itertools.repeat(0))
        live = itertools.compress(range(len(self._contents)), map(operator.or_, in_use, cached))
        contents = {b: self._contents[b] for b in live}
        return ManagerState(
            block_size=self._block_size,
            pool=pool,
            tables={s: tuple(t) for s, t in self._tables.items()},
            tokens={s: tuple(t) for s, t in self._tokens.items()},
            contents=contents,
        )

    def _fork_table(self, parent: SeqId) -> list[int]:
        """The child's table: the parent's, every block shared."""
        table = self._tables[parent]
        self._pool.share(table)
        return list(table)

    # -- the write path ------------------------------------------------------------

    def _blocks_needed(self, seq: SeqId, count: int) -> int:
        """New blocks for ``count`` more tokens, a copy of the last block apart."""
        table, length = self._tables[seq], len(self._tokens[seq])
        return -(-(length + count) // self._block_size) - len(table)  # blocks_for, inline: every append asks

    def _needs_copy(self, seq: SeqId) -> bool:
        table = self._tables[seq]
        partial = len(self._tokens[seq]) % self._block_size != 0
        return partial and (self._pool.refcount(table[-1]) > 1 or self._last_block_cached(seq))

    def _last_block_cached(self, seq: SeqId) -> bool:
        """Hook: whether the sequence's partial last block is registered (only a rollback leaves one so)."""
        return False

    def _write(self, seq: SeqId, tokens: Sequence[int], copies_last_block: bool | None = None) -> WritePlan:
        """Write tokens after the last one; the caller has checked there is room (``copies_last_block``: whether
        the partial last block is copied first, as the caller found; None: ask ``_needs_copy``)."""
        table, written, size = self._tables[seq], self._tokens[seq], self._block_size
        if copies_last_block is None:
            copies_last_block = bool(tokens) and bool(self._needs_copy(seq))
        copies = [self._copy_last_block(seq)] if copies_last_block else []
        slots: list[tuple[int, int]] = []
        count, done, length = len(tokens), 0, len(written)
        while done < count:  # a block's worth at a time: the slots left in the last block, or a new block
            offset = length % size
            if offset == 0:
                (block,) = self._pool.allocate(1)
                self._contents[block] = ()
                table.append(block)
            block = table[-1]
            taken = min(size - offset, count - done)
            run = tokens[done : done + taken]
            self._contents[block] = self._contents[block][:offset] + tuple(run)
            written += run
            if taken == 1:  # a decode step
                slots.append((block, offset))
            else:
                slots += zip(itertools.repeat(block), range(offset, offset + taken))
            done += taken
            length += taken
            if offset + taken == size:
                self._block_filled(seq, len(table) - 1)
        return WritePlan(copies=tuple(copies), slots=tuple(slots))

    def _copy_last_block(self, seq: SeqId) -> tuple[int, int]:
        table = self._tables[seq]
        source = table[-1]
        (copy,) = self._pool.allocate(1)
        self._contents[copy] = self._contents[source][: len(self._tokens[seq]) % self._block_size]
        self._pool.release([source])
        table[-1] = copy
        return source, copy

    def _block_filled(self, seq: SeqId, index: int) -> None:
        """Hook: logical block ``index`` of ``seq`` just became full (prefix caching registers it)."""

    # -- checks --------------------------------------------------------------------

    def _ensure_room(self, needed: int) -> None:
        if needed > self._pool.num_free():
            raise OutOfBlocks(needed, self._pool.num_free())

    def _table(self, seq: SeqId) -> list[int]:
        try:
            return self._tables[seq]
        except (KeyError, TypeError):
            raise InvalidOperation(f"sequence {seq!r} does not exist (never added, or freed)") from None

    def _require_new(self, seq: SeqId) -> None:
        if not isinstance(seq, Hashable) or seq in self._tables:
            raise InvalidOperation(f"sequence {seq!r} already exists")


class CopyingForkBlockManager(BlockManager):
    """Declares ``ManagerConventions(fork_partial_block="copy")`` (HF transformers' fork): the child shares the
    parent's full blocks and gets a copy of its partially filled last block at once, so neither copies on write."""

    def _fork_table(self, parent: SeqId) -> list[int]:
        table, filled = self._tables[parent], len(self._tokens[parent]) % self._block_size
        if not filled:
            return super()._fork_table(parent)
        self._ensure_room(1)
        self._pool.share(table[:-1])
        (copy,) = self._pool.allocate(1)
        self._contents[copy] = self._contents[table[-1]][:filled]
        return [*table[:-1], copy]
