"""Layers 2 and 3 -- speculative decoding: tokens appended on trial and rolled back.

Rules (vLLM's and SGLang's speculative decoding: a draft model proposes
``k`` tokens, they are appended and the target model verifies them in one
forward; the rejected ones are rolled back, then the target's own token is
appended):

* ``rollback(seq, n)`` -- a block manager's optional operation (``rollback``)
  -- drops the last ``n`` tokens of ``seq``: its table shrinks to the
  ceil((len - n) / B) blocks the remaining tokens need, and the blocks past
  them are released, last first, as ``free`` releases a table.  Nothing is
  written: the kept blocks hold what they held, slots past the sequence's end
  included, and a released block that is registered stays cached (it still
  holds the full block its hash names) until allocation or ``evict`` takes it.
* The block the sequence now ends in may be one that was full: shared with
  another table (a fork, a prefix hit) or registered under its hash (filled
  by the draft, or a hit).  Its slots past the sequence's end are other
  sequences' tokens, or the cached prefix's: the next write must not land in
  it.  So layer 2's copy-on-write rule reads in full: a write into a
  partially filled last block that is **shared or registered** first copies
  it (one block; the writer drops its reference, and a registered block left
  with no holder sits in the free queue, cached).  Without a rollback no
  partial block is ever registered, so the rule is layer 2's as it was.  An
  engine that instead drops an unshared block's hash and writes in place is
  safe, but not the reference: its cache forgets a block the model keeps.
* Under deferred commit (``kvspec.spec.prefix_cache``) a filled block that
  was not committed yet is pending; a rollback into it or past it drops it
  from the pending list: the forward that computed it verified other tokens,
  and the block will be written again.
* A prefix-caching manager forgets the hashes of the blocks that are no longer
  full: the next block that fills is hashed from the tokens it then holds.
* Rolling back more tokens than the sequence holds, a count that is not a
  non-negative int, or a sequence that does not exist is ``InvalidOperation``,
  and nothing changes.  ``rollback(seq, 0)`` changes nothing; rolling back
  every token leaves the sequence live with an empty table.

Theory of operation: the transitions here are pure functions of layer 2's
model (``rollback``); layer 3's (``kvspec.spec.prefix_cache.rollback``) adds
the pending list, and the copy-on-write rule itself lives in layer 2's one
write path (``kvspec.spec.block_manager.write``).  The machines speculate the
way an engine decodes: append ``k`` draft tokens, roll back ``j <= k``, append
the target's token.

Invariants (tier in brackets; every layer-1/2/3 invariant holds too -- the
table length, the holders and the cached blocks' contents above all):

* ``invariant_rollback_keeps_prefix`` [safety] -- a rollback keeps the
  sequence's first tokens in the first blocks of its table and writes nothing.
* ``invariant_no_write_into_cached_or_shared_block`` [safety] -- a write lands
  neither in a block another table holds nor in one that stays cached under
  its hash.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec import block_pool
from kvspec.spec.block_manager import MANAGERS, BlockManager, Manager, ManagerState, SeqId, blocks_for, require_live
from kvspec.spec.components import optional_operation
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import invariant


@runtime_checkable
class SpeculativeBlockManager(BlockManager, Protocol):
    """A block manager that offers ``rollback``: the rejected draft tokens go."""

    def rollback(self, seq: SeqId, n: int) -> None: ...


ROLLBACK = optional_operation("rollback", SpeculativeBlockManager, "rollback", kinds=MANAGERS)


def check_rollback(seq: SeqId, n: object, length: int) -> int:
    """The number of tokens to drop: a non-negative int, at most the ``length`` the sequence holds."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidOperation(f"a rollback drops a non-negative number of tokens, got {n!r}")
    if n > length:
        raise InvalidOperation(f"sequence {seq!r} holds {length} tokens: it cannot roll back {n}")
    return n


def rollback(manager: Manager, seq: SeqId, n: int) -> Manager:
    """Drop the last ``n`` tokens of ``seq``; release the blocks past the ones the rest need, last first."""
    require_live(manager, seq)
    tokens, table = manager.tokens[seq], manager.tables[seq]
    kept = len(tokens) - check_rollback(seq, n, len(tokens))
    needed = blocks_for(kept, manager.block_size)
    return attrs.evolve(
        manager,
        pool=block_pool.release(manager.pool, table[needed:][::-1]),
        tables={**manager.tables, seq: table[:needed]},
        tokens={**manager.tokens, seq: tokens[:kept]},
    )


def written_blocks(before: ManagerState, after: ManagerState) -> list[int]:
    """The blocks in use before and after whose slots changed in between."""
    return [
        block
        for block, held in before.contents.items()
        if before.pool.refcounts[block] > 0 and after.contents.get(block, held) != held
    ]


# -- invariants ------------------------------------------------------------------


@invariant(
    "the tokens a rollback keeps are the ones verified: moved, cut short or overwritten, the sequence decodes "
    "from KV it never had",
    "safety",
    needs=(ROLLBACK,),
)
def invariant_rollback_keeps_prefix(before: ManagerState, after: ManagerState, seq: SeqId, n: int) -> str | None:
    tokens, table = before.tokens[seq], before.tables[seq]
    kept = tokens[: len(tokens) - n]
    if after.tokens.get(seq) != kept:
        return f"rolling back {n} of {tokens} left {seq!r} with {after.tokens.get(seq)}"
    want = table[: blocks_for(len(kept), before.block_size)]
    if after.tables.get(seq) != want:
        return f"rolling back {n} tokens of {seq!r} left its table {after.tables.get(seq)}; it is {want}"
    written = written_blocks(before, after)
    if written:
        return f"rolling back {n} tokens of {seq!r} wrote into blocks {written}"
    return None


@invariant(
    "a block another table holds, or one a later prompt hits by its hash, holds their KV: writing a token into it "
    "hands them this sequence's",
    "safety",
    needs=(ROLLBACK,),
)
def invariant_no_write_into_cached_or_shared_block(before: ManagerState, after: ManagerState) -> str | None:
    """Over the states around one write; a block whose hash the write dropped (unregistered first) may change."""
    written = written_blocks(before, after)
    shared = [block for block in written if before.pool.refcounts[block] > 1]
    if shared:
        return f"the write changed blocks {shared}, which other tables held"
    hashes = before.pool.block_hashes
    cached = [
        block for block in written if hashes[block] is not None and after.pool.block_hashes[block] == hashes[block]
    ]
    if cached:
        return f"the write changed blocks {cached}, which stay cached under their hashes"
    return None
