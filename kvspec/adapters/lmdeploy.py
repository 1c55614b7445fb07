"""kvspec's ``BlockManager`` protocol over LMDeploy's PyTorch-engine block manager (tested: LMDeploy 0.18.0).

    kvspec check --impl kvspec.adapters.lmdeploy:factory

LMDeploy's ``lmdeploy.pytorch.paging.block_manager.DefaultBlockManager`` keeps
the GPU *and* the CPU blocks of a scheduler: a ``LogicalAllocator`` maps each
sequence's logical blocks to physical ones on either device, and
``try_swap_out`` / ``try_swap_in`` move a whole sequence between them by
re-mapping its logical blocks (the cache engine then copies KV along the
``swap_map`` they answer).  kvspec's swap is a move between two managers, a
GPU's and a CPU's: the adapter builds one LMDeploy ``Scheduler`` (with its
block manager) per *pair* of kvspec managers -- the two a machine builds one
after the other, before either is used -- the first the GPU's, the second the
CPU's.  A manager built alone gets a scheduler with no CPU blocks.

* ``add_sequence`` / ``append`` on the GPU manager -> a ``SchedulerSequence``
  of its own session (``add_sequence`` of the tokens, ``update_token_ids`` in
  decode mode for an append), ``can_allocate`` (``OutOfBlocks`` when false,
  the scheduler's own test) and ``allocate`` with the new tokens as
  ``prealloc_size``.  LMDeploy never writes a sequence on the CPU: on the CPU
  manager the adapter allocates from the allocator's CPU side itself
  (``LogicalAllocator.allocate(n, "cpu")``) -- emulated.
* ``free`` -> ``DefaultBlockManager.free``, then the session forgets the sequence.
* ``move_sequences(cpu, group)`` -> ``try_swap_out`` of each (``try_swap_in``
  the other way): a group moves all or nothing, so the adapter first sees that
  the destination has the group's blocks free (``try_swap_*`` checks each
  sequence alone).  The answer pairs each source block with its destination,
  from the ``swap_map`` the engine answers.
* Token contents: LMDeploy keeps none on the scheduler side (KV lives in the
  cache engine's tensors).  The adapter keeps, per physical block, the tokens
  written to its slots -- as the model's forward writes KV -- and copies them
  along each ``swap_map``, as the cache engine does: ``read`` goes through the
  engine's block table and these copies.
* ``snapshot()`` reads the engine: block tables (``get_block_table``: physical
  ids, CPU ids counted from the CPU's first block), the sequences' tokens
  (``all_ids``), reference counts of the logical blocks mapped to each
  physical one, and each device's free stack in the order it hands out.

Conventions, as read from ``paging/block_manager/base_block_manager.py``:

* ``pool.unhashed_free_position="head"``: ``PhysicalAllocator.free`` writes
  freed blocks just before the free region, so they are handed out next;
  ``policies=("lru",)`` (no prefix caching: nothing is cached or evicted).
* No fork (``DefaultBlockManager`` has none) and no partial swap-in.
* Its caller is not trusted: a kvspec sequence the adapter does not hold, or
  tokens that are no token ids, cannot be mapped and are refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any

from kvspec.spec.block_manager import ManagerState, WritePlan, blocks_for, check_tokens
from kvspec.spec.block_pool import BlockPool, PoolState
from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions, PoolConventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.swap import SWAP

VERSION = "0.18.0"
CONVENTIONS = Conventions(pool=PoolConventions(unhashed_free_position="head", policies=("lru",)))
GPU, CPU = "gpu", "cpu"


def engine_modules() -> Any:
    """LMDeploy's scheduler and what it is built from (importing LMDeploy takes a few seconds)."""
    from lmdeploy.pytorch import config, messages
    from lmdeploy.pytorch.paging import scheduler
    from lmdeploy.pytorch.strategies.ar import sequence

    return config, messages, scheduler, sequence


class Rack:
    """One LMDeploy scheduler and its block manager, shared by the GPU and the CPU manager over it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.managers: list[LMDeployManager] = []
        self.used = False
        self.contents: dict[int, list[int]] = {}  # physical block -> the tokens in its slots
        self._sessions = itertools.count()

    def join(self, manager: LMDeployManager) -> str:
        self.managers.append(manager)
        config, messages, scheduler, sequence = engine_modules()
        gpu, cpu = (m.capacity for m in self.managers) if len(self.managers) == 2 else (manager.capacity, 0)
        cache = config.CacheConfig(
            max_batches=4,
            block_size=self.block_size,
            num_cpu_blocks=cpu,
            num_gpu_blocks=gpu,
            enable_prefix_caching=False,
        )
        limits = config.SchedulerConfig(max_batches=4, max_session_len=1 << 20, max_request_output_len=1 << 20)
        meta = messages.SequenceMeta(self.block_size, strategy=sequence.ARSequenceStrategy())
        self.scheduler = scheduler.Scheduler(scheduler_config=limits, cache_config=cache, seq_meta=meta)
        self.engine = self.scheduler.block_manager
        self.decode = messages.UpdateTokenMode.DECODE
        return GPU if len(self.managers) == 1 else CPU

    def offset(self, device: str) -> int:
        """The first physical id of ``device``'s blocks."""
        return 0 if device == GPU else int(self.engine.allocator.cpu_mem_offset())

    def new_sequence(self, tokens: Sequence[int]) -> Any:
        import torch

        session = self.scheduler.add_session(next(self._sessions))
        return session.add_sequence(torch.tensor(list(tokens), dtype=torch.long))


_RACKS: list[Rack] = []


def rack_for(block_size: int) -> Rack:
    """The rack a new manager joins: the one built last, while it has one manager, unused, of this block size."""
    last = _RACKS[-1] if _RACKS else None
    if last is None or len(last.managers) != 1 or last.used or last.block_size != block_size:
        _RACKS[:] = [Rack(block_size)]
    return _RACKS[-1]


class DevicePool:
    """One device's blocks of the rack's allocator, seen (read-only) through ``kvspec.spec.block_pool.BlockPool``."""

    def __init__(self, manager: LMDeployManager) -> None:
        self._manager = manager

    @property
    def capacity(self) -> int:
        return self._manager.capacity

    def _allocator(self) -> Any:
        return self._manager.rack.engine.allocator.get_phy_allocator(self._manager.device)

    def num_free(self) -> int:
        return int(self._allocator().get_num_free_blocks())

    def refcount(self, block: int) -> int:
        return self.snapshot().refcounts[block]

    def snapshot(self) -> PoolState:
        manager, allocator = self._manager, self._allocator()
        memory, offset = manager.rack.engine.allocator._log_mem, manager.rack.offset(manager.device)
        refcounts = [0] * self.capacity
        for logical in memory.ref_count.nonzero()[0]:
            physical = int(memory.phy_map[logical]) - offset
            if 0 <= physical < self.capacity:
                refcounts[physical] += int(memory.ref_count[logical])
        used = allocator._num_blocks - allocator._free_count
        return PoolState(
            capacity=self.capacity,
            refcounts=tuple(refcounts),
            free_queue=tuple(int(b) - offset for b in allocator._free_blocks[used:]),
            block_hashes=(None,) * self.capacity,
            cached={},
        )

    def __getattr__(self, operation: str) -> Any:
        if operation in ("allocate", "share", "release", "register", "lookup", "evict"):
            raise InvalidOperation(f"LMDeploy's allocator is driven by its block manager, not by {operation}")
        raise AttributeError(operation)


class LMDeployManager:
    """A GPU's or a CPU's view of an LMDeploy ``DefaultBlockManager``, as ``kvspec.spec.block_manager.BlockManager``."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise InvalidOperation(f"block size must be a positive int, got {block_size!r}")
        self.capacity = pool.capacity
        self.rack = rack_for(block_size)
        self.device = self.rack.join(self)
        self._sequences: dict[Hashable, Any] = {}  # kvspec sequence -> LMDeploy's SchedulerSequence

    @property
    def block_size(self) -> int:
        return self.rack.block_size

    @property
    def pool(self) -> DevicePool:
        return DevicePool(self)

    # -- writing ------------------------------------------------------------------------------------

    def _sequence(self, seq: Hashable) -> Any:
        if not isinstance(seq, Hashable) or seq not in self._sequences:
            raise InvalidOperation(f"sequence {seq!r} does not exist (never added, or freed)")
        return self._sequences[seq]

    def _physical(self, sequence: Any) -> list[int]:
        return [int(b) for b in self.rack.engine.get_block_table(sequence)]

    def _allocate(self, sequence: Any, tokens: int) -> None:
        """Blocks for ``tokens`` more tokens: the engine's own on the GPU, the allocator's CPU side on the CPU."""
        engine = self.rack.engine
        if self.device == GPU:
            if not engine.can_allocate(sequence, tokens):
                raise OutOfBlocks(engine.num_required_blocks(sequence, tokens), engine.get_num_free_gpu_blocks())
            engine.allocate(sequence, tokens)
            return
        needed = blocks_for(sequence.num_all_ids + tokens, self.block_size) - len(sequence.logical_blocks)
        if needed > 0:
            try:
                sequence.logical_blocks.append(engine.allocator.allocate(needed, CPU))
            except MemoryError:
                raise OutOfBlocks(needed, engine.get_num_free_cpu_blocks()) from None

    def _write(self, sequence: Any, start: int, tokens: tuple[int, ...]) -> WritePlan:
        """Write ``tokens`` into their slots from position ``start``, as the forward writes KV."""
        table, offset, slots = self._physical(sequence), self.rack.offset(self.device), []
        for position, token in enumerate(tokens, start):
            block, slot = table[position // self.block_size], position % self.block_size
            held = self.rack.contents.setdefault(block, [])
            del held[slot:]
            held.append(token)
            slots.append((block - offset, slot))
        return WritePlan(slots=tuple(slots))

    def add_sequence(self, seq: Hashable, prompt: Sequence[int]) -> WritePlan:
        tokens = check_tokens(prompt, allow_empty=False)
        if not isinstance(seq, Hashable) or seq in self._sequences:
            raise InvalidOperation(f"sequence {seq!r} already exists")
        self.rack.used = True
        sequence = self.rack.new_sequence(tokens)
        try:
            self._allocate(sequence, 0)  # the prompt is in the sequence already: blocks for it
        except OutOfBlocks:
            sequence.session.remove_sequence(sequence)
            raise
        self._sequences[seq] = sequence
        return self._write(sequence, 0, tokens)

    def append(self, seq: Hashable, tokens: Sequence[int]) -> WritePlan:
        written = check_tokens(tokens, allow_empty=True)
        sequence = self._sequence(seq)
        self.rack.used = True
        start = sequence.num_all_ids
        self._allocate(sequence, len(written))
        if written:
            sequence.update_token_ids(list(written), mode=self.rack.decode)
        return self._write(sequence, start, written)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        raise InvalidOperation("LMDeploy's DefaultBlockManager has no fork")

    def free(self, seq: Hashable) -> None:
        sequence = self._sequence(seq)
        self.rack.used = True
        self.rack.engine.free(sequence)
        sequence.session.remove_sequence(sequence)
        del self._sequences[seq]

    # -- reading ------------------------------------------------------------------------------------

    def read(self, seq: Hashable) -> tuple[int, ...]:
        sequence, size = self._sequence(seq), self.block_size
        table = self._physical(sequence)
        return tuple(self.rack.contents[table[i // size]][i % size] for i in range(sequence.num_all_ids))

    def block_table(self, seq: Hashable) -> tuple[int, ...]:
        offset = self.rack.offset(self.device)
        return tuple(block - offset for block in self._physical(self._sequence(seq)))

    def sequences(self) -> tuple[Hashable, ...]:
        return tuple(self._sequences)

    # -- swap ---------------------------------------------------------------------------------------

    def move_sequences(self, dst: LMDeployManager, seqs: Sequence[Hashable]) -> tuple[tuple[int, int], ...]:
        if not seqs or len(set(seqs)) != len(seqs):
            raise InvalidOperation(f"a group to move needs distinct sequences, got {list(seqs)!r}")
        moving = [self._sequence(seq) for seq in seqs]
        if any(seq in dst._sequences for seq in seqs):
            raise InvalidOperation(f"the destination already holds one of {list(seqs)!r}")
        if dst.block_size != self.block_size or dst.rack is not self.rack or dst.device == self.device:
            raise InvalidOperation("LMDeploy swaps between the GPU and the CPU of one block manager")
        needed = sum(len(sequence.logical_blocks) for sequence in moving)
        if needed > dst.pool.num_free():  # the group moves all or nothing
            raise OutOfBlocks(needed, dst.pool.num_free())
        self.rack.used = True
        swap = self.rack.engine.try_swap_out if self.device == GPU else self.rack.engine.try_swap_in
        copies: list[tuple[int, int]] = []
        for seq, sequence in zip(seqs, moving, strict=True):
            before = self.block_table(seq)
            moved, swap_map = swap(sequence)
            if not moved:
                raise InvalidOperation(f"LMDeploy refused to swap sequence {seq!r} (shared blocks)")
            self._carry(swap_map, dst)
            copies += [(block, int(swap_map[block])) for block in before]  # both count from each device's first
            dst._sequences[seq] = self._sequences.pop(seq)
        return tuple(copies)

    def _carry(self, swap_map: dict[Any, Any], dst: LMDeployManager) -> None:
        """The cache engine's copy along ``swap_map``: each source block's tokens into its destination."""
        source, target = self.rack.offset(self.device), self.rack.offset(dst.device)
        if self.device == CPU:  # try_swap_in answers source ids counted from the CPU's first block
            pairs = [(int(old) + source, int(new)) for old, new in swap_map.items()]
        else:
            pairs = [(int(old), int(new) + target) for old, new in swap_map.items()]
        for old, new in pairs:
            self.rack.contents[new] = list(self.rack.contents.get(old, []))

    # -- the abstraction function -------------------------------------------------------------------

    def snapshot(self) -> ManagerState:
        pool = self.pool.snapshot()
        tables = {seq: self.block_table(seq) for seq in self._sequences}
        offset = self.rack.offset(self.device)
        in_use = [b for b in range(self.capacity) if pool.refcounts[b] > 0]
        return ManagerState(
            block_size=self.block_size,
            pool=pool,
            tables=tables,
            tokens={seq: tuple(int(t) for t in sequence.all_ids) for seq, sequence in self._sequences.items()},
            contents={b: tuple(self.rack.contents.get(b + offset, ())) for b in in_use},
        )


def engine_version() -> str:
    from importlib.metadata import version

    return version("lmdeploy")


def factory() -> Implementation:
    """LMDeploy's block manager under test, with swap; every other layer is the reference's, on top of it."""
    engine_modules()  # fail here, with the engine's ImportError, when LMDeploy is not installed
    manager = Offer(LMDeployManager, operations={SWAP}, emulated={"add_sequence", "append"})
    return Implementation(
        name=f"LMDeploy {engine_version()} DefaultBlockManager", block_manager=manager, conventions=CONVENTIONS
    )
