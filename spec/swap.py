"""Layer 2's swap: a group of sequences moved between two devices' managers (optional).

Rules (vLLM §4.5, lecture §6.2):

* ``move_sequences(src, dst, seqs)`` moves a group of sequences to another
  device's manager of the same implementation (a GPU's and a CPU's): all of
  their distinct blocks are copied into freshly allocated blocks of ``dst``
  -- all or nothing -- the sharing inside the group is kept, and the blocks
  are released in ``src``.  It answers the (source block, destination block)
  copies, in order of first use.
* Moved blocks arrive uncached: ``dst``'s prefix cache does not learn them,
  so a later prompt recomputes rather than hits them (swap is for resuming,
  not for sharing).
* A group of no sequences, or of one named twice, a sequence ``src`` does
  not hold or ``dst`` already holds, and managers of different block sizes
  raise ``InvalidOperation``; ``dst`` short of blocks raises ``OutOfBlocks``.
  Either way both managers are as they were.

The optional operation ``SWAP`` of every manager kind (``BlockManager.
move_sequences``); the scheduler's swap preemption (``kvspec.spec.preemption``)
moves victims out and back in with it.  Both managers' invariants
(``kvspec.spec.block_manager``) judge the move.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvspec.spec import block_pool
from kvspec.spec.block_manager import MANAGERS, BlockManager, Manager, SeqId, free, holders, require_live, require_new
from kvspec.spec.components import optional_operation
from kvspec.spec.errors import InvalidOperation

SWAP = optional_operation("swap", BlockManager, "move_sequences", kinds=MANAGERS)


def move_sequences(
    src: Manager, dst: Manager, seqs: Sequence[SeqId]
) -> tuple[Manager, Manager, tuple[tuple[int, int], ...]]:
    """Move a group of sequences from ``src`` to ``dst``, all or nothing, keeping their sharing.

    Returns the (source block, destination block) copies, in order of first use.
    """
    if len(set(seqs)) != len(seqs) or not seqs:
        raise InvalidOperation(f"a group to move needs distinct sequences, got {list(seqs)!r}")
    for seq in seqs:
        require_live(src, seq)
        require_new(dst, seq)
    if src.block_size != dst.block_size:
        raise InvalidOperation(f"block sizes differ: {src.block_size} and {dst.block_size}")
    distinct = list(dict.fromkeys(b for seq in seqs for b in src.tables[seq]))
    dst_pool, fresh = block_pool.allocate(dst.pool, len(distinct))
    mapping = dict(zip(distinct, fresh, strict=True))
    group_holders = holders({seq: src.tables[seq] for seq in seqs})
    dst_pool = block_pool.share(dst_pool, [mapping[b] for b, n in group_holders.items() for _ in range(n - 1)])
    contents = dict(dst.contents)
    for old, new in mapping.items():
        contents[new] = src.contents[old]
    moved_tables = {seq: tuple(mapping[b] for b in src.tables[seq]) for seq in seqs}
    dst = attrs.evolve(
        dst,
        pool=dst_pool,
        tables={**dst.tables, **moved_tables},
        tokens={**dst.tokens, **{seq: src.tokens[seq] for seq in seqs}},
        contents=contents,
    )
    for seq in seqs:
        src = free(src, seq)
    return src, dst, tuple(mapping.items())
