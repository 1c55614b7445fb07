"""The reference block manager: block tables over any ``BlockPool``.

Each write is checked for room before anything changes, so ``OutOfBlocks``
leaves the manager as it was.  Slots live in a per-block list of token ids;
a KV store mirrors them through the ``WritePlan`` each write returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from kvspec.spec.block_manager import ManagerState, SeqId, WritePlan, blocks_for, check_block_size, check_tokens
from kvspec.spec.block_pool import BlockPool as BlockPoolProtocol
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.kv_store import KVStore
from kvspec.spec.speculative import check_rollback
from kvspec.spec.tiered_swap import TierLoad, require_continuation, tier_contents, tier_factor


class BlockManager:
    """Sequences, their block tables and the token ids in their slots."""

    def __init__(self, pool: BlockPoolProtocol, block_size: int) -> None:
        self._block_size = check_block_size(block_size)
        self._pool = pool
        self._tables: dict[SeqId, list[int]] = {}
        self._tokens: dict[SeqId, list[int]] = {}
        self._contents: list[list[int]] = [[] for _ in range(pool.capacity)]

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
        prompt = check_tokens(prompt, allow_empty=False)
        self._require_new(seq)
        self._ensure_room(blocks_for(len(prompt), self._block_size))
        self._tables[seq], self._tokens[seq] = [], []
        return self._write(seq, prompt)

    def append(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan:
        tokens = check_tokens(tokens, allow_empty=True)
        self._table(seq)
        self._ensure_room(self._blocks_needed(seq, len(tokens)))
        return self._write(seq, tokens)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        table = self._table(parent)
        self._require_new(child)
        self._pool.share(table)
        self._tables[child] = list(table)
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
            dst._contents[new] = list(self._contents[old])
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
            self._contents[table[index]] = list(contents[key][offset : offset + size])
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
        contents = {
            b: tuple(c)
            for b, c in enumerate(self._contents)
            if pool.refcounts[b] > 0 or pool.block_hashes[b] is not None
        }
        return ManagerState(
            block_size=self._block_size,
            pool=pool,
            tables={s: tuple(t) for s, t in self._tables.items()},
            tokens={s: tuple(t) for s, t in self._tokens.items()},
            contents=contents,
        )

    # -- the write path ------------------------------------------------------------

    def _blocks_needed(self, seq: SeqId, count: int) -> int:
        """New blocks for ``count`` more tokens, plus one if the last block must be copied."""
        table, length = self._tables[seq], len(self._tokens[seq])
        fresh = blocks_for(length + count, self._block_size) - len(table)
        return fresh + int(self._needs_copy(seq) and count > 0)

    def _needs_copy(self, seq: SeqId) -> bool:
        table = self._tables[seq]
        partial = len(self._tokens[seq]) % self._block_size != 0
        return partial and (self._pool.refcount(table[-1]) > 1 or self._last_block_cached(seq))

    def _last_block_cached(self, seq: SeqId) -> bool:
        """Hook: whether the sequence's partial last block is registered (only a rollback leaves one so)."""
        return False

    def _write(self, seq: SeqId, tokens: Sequence[int]) -> WritePlan:
        """Write tokens after the last one; the caller has checked there is room."""
        table, written, size = self._tables[seq], self._tokens[seq], self._block_size
        copies = []
        if tokens and self._needs_copy(seq):
            copies.append(self._copy_last_block(seq))
        slots = []
        for token in tokens:
            offset = len(written) % size
            if offset == 0:
                (block,) = self._pool.allocate(1)
                self._contents[block] = []
                table.append(block)
            block = table[-1]
            self._contents[block][offset:] = [token]
            slots.append((block, offset))
            written.append(token)
            if offset == size - 1:
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
