"""LMDeploy's DefaultBlockManager as a GPU and a CPU block manager (``kvspec.adapters.lmdeploy``).

Skipped unless LMDeploy imports.  Pins how the adapter pairs two kvspec managers into one engine
block manager, the swap round trip along the engine's ``swap_map``, all-or-nothing group moves, the
engine behaviour its verdict reports, and a short run of the block-manager machine.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import Phase, settings

pytest.importorskip("lmdeploy.pytorch.paging.scheduler", reason="LMDeploy is not installed")

from kvspec.adapters import lmdeploy  # noqa: E402
from kvspec.impl.block_pool import BlockPool  # noqa: E402
from kvspec.properties.loading import load_implementation  # noqa: E402
from kvspec.properties.running import run_machine  # noqa: E402
from kvspec.properties.test_block_manager import BlockManagerMachine  # noqa: E402
from kvspec.spec.errors import InvalidOperation, OutOfBlocks  # noqa: E402

QUICK = settings(max_examples=30, derandomize=True, phases=[Phase.generate])  # found, not shrunk


def managers(gpu: int, cpu: int, block_size: int) -> tuple[Any, Any]:
    implementation = lmdeploy.factory()
    first = implementation.block_manager(BlockPool(gpu, "lru"), block_size)
    return first, implementation.block_manager(BlockPool(cpu, "lru"), block_size)


def test_two_managers_built_in_a_row_are_one_engine_block_manager() -> None:
    gpu, cpu = managers(4, 3, 2)
    assert (gpu.device, cpu.device) == ("gpu", "cpu") and gpu.rack is cpu.rack
    engine = gpu.rack.engine
    assert (engine.num_gpu_blocks, engine.num_cpu_blocks) == (4, 3)


def test_a_swap_round_trip_reads_what_the_sequence_held() -> None:
    gpu, cpu = managers(4, 3, 2)
    assert gpu.add_sequence(0, [1, 2, 3]).slots == ((0, 0), (0, 1), (1, 0))
    gpu.append(0, [4, 5])
    assert gpu.move_sequences(cpu, [0]) == ((0, 0), (1, 1), (2, 2))
    assert (cpu.read(0), gpu.sequences(), gpu.pool.num_free()) == ((1, 2, 3, 4, 5), (), 4)
    cpu.move_sequences(gpu, [0])
    assert gpu.read(0) == (1, 2, 3, 4, 5) and gpu.block_table(0) == (0, 1, 2)


def test_a_group_moves_all_or_nothing() -> None:
    gpu, cpu = managers(4, 2, 1)
    gpu.add_sequence(0, [1])
    gpu.add_sequence(1, [2, 3])
    before = (gpu.snapshot(), cpu.snapshot())
    with pytest.raises(OutOfBlocks):
        gpu.move_sequences(cpu, [0, 1])
    assert (gpu.snapshot(), cpu.snapshot()) == before


def test_no_fork() -> None:
    gpu, _ = managers(2, 1, 1)
    gpu.add_sequence(0, [1])
    with pytest.raises(InvalidOperation):
        gpu.fork(0, 1)


def test_a_table_is_freed_first_block_first() -> None:
    """The convention finding: ``DefaultBlockManager.free`` hands the table to the allocator in table order,
    and ``PhysicalAllocator.free`` puts the blocks back where the next allocation starts, in that order."""
    gpu, _ = managers(3, 1, 1)
    gpu.add_sequence(0, [1, 2])
    gpu.free(0)
    assert gpu.snapshot().pool.free_queue == (0, 1, 2)  # kvspec's model releases last block first: (1, 0, 2)


def test_the_block_manager_machine_finds_no_safety_finding() -> None:
    # as ``kvspec check`` runs it: the pool LMDeploy's managers run on is borrowed from the reference
    outcome = run_machine(BlockManagerMachine, load_implementation("kvspec.adapters.lmdeploy:factory"), QUICK)
    assert not [f for f in outcome.findings if f.tier == "safety"], [f.detail for f in outcome.findings]
