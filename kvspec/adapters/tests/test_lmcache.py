"""LMCache's DRAM and disk backends as layer 7's store (``kvspec.adapters.lmcache``).

Skipped unless LMCache imports.  Pins what the adapter composes (demotion is a write to disk on
eviction, a disk hit read in place, immutable puts), the engine behaviour the verdict reports (a
forced remove releases pins; a removed disk chunk keeps its bytes counted), the verdict's safety
finding reproduced by LMCache's own calls alone (``docs/findings/lmcache_disk_accounting.py``: a
release that fixes it fails here), and a short run of the store machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings

pytest.importorskip("lmcache.v1.storage_backend.local_disk_backend", reason="LMCache is not installed")

from kvspec.adapters import lmcache  # noqa: E402
from kvspec.properties.running import run_machine  # noqa: E402
from kvspec.properties.test_kv_store import KVStoreMachine  # noqa: E402
from kvspec.spec import kv_store  # noqa: E402
from kvspec.spec.errors import InvalidOperation  # noqa: E402

QUICK = settings(max_examples=30, derandomize=True, phases=[Phase.generate])  # found, not shrunk
FINDING = Path(__file__).resolve().parents[3] / "docs" / "findings" / "lmcache_disk_accounting.py"


def store(dram: int, disk: int, policy: str = "lru") -> Any:
    return lmcache.factory().kv_store(1, (dram, disk), (policy, policy))


def test_two_tiers_of_exactly_their_chunks() -> None:
    backends = store(2, 3)
    assert backends.dram.memory_allocator is not None and backends.disk.max_cache_size == 3 * lmcache.CHUNK_BYTES
    with pytest.raises(InvalidOperation):
        lmcache.factory().kv_store(1, (1,), ("lru",))


def test_a_full_dram_tier_writes_its_victim_to_disk() -> None:
    backends = store(1, 2)
    backends.put(0, "a", (1, 2))
    backends.put(0, "b", (3,))
    state = backends.snapshot()
    assert state.tiers == ((("b",), ("a",)),) and state.contents[(0, "a")] == (1, 2)
    assert backends.get(0, "a") == (1, 2)  # read in place, from the file
    assert backends.lookup("a") == ((0, 1),)


def test_a_put_of_a_held_key_is_skipped() -> None:
    backends = store(2, 2)
    backends.put(0, "a", (1,))
    backends.put(0, "a", (9,))
    assert backends.snapshot().contents == {(0, "a"): (1,)}


def test_a_forced_remove_drops_a_pinned_chunk_and_its_pins() -> None:
    """The caller-contract finding: ``remove(key, force=True)`` releases the pins a retrieve holds."""
    backends = store(2, 2)
    backends.put(0, "a", (1,))
    backends.pin(0, "a")
    backends.remove(0, "a")
    assert backends.snapshot().contents == {} and backends.snapshot().pins == {}


def test_a_removed_disk_chunk_stays_counted_and_a_later_demotion_evicts_a_live_one() -> None:
    """The safety finding: ``LocalDiskBackend.remove`` gives back ``usage`` but not ``current_cache_size``,
    which its own admission uses, so the disk evicts a chunk it had room for."""
    backends = store(1, 2)
    for key, tokens in (("a", (1,)), ("b", (2,)), ("c", (3,))):  # a and b go down to disk
        backends.put(0, key, tokens)
    backends.remove(0, "a")
    assert backends.disk.current_cache_size == 2 * lmcache.CHUNK_BYTES  # one chunk on disk, two counted
    before = backends.snapshot()
    backends.demote(0, 0)  # c goes down: the disk had room, yet b is evicted
    after = backends.snapshot()
    assert (0, "b") not in after.contents
    assert kv_store.invariant_demotion_keeps_the_block(before, after) is not None


@pytest.mark.skipif(not FINDING.exists(), reason="the finding's script lives in the repository (docs/findings)")
def test_the_disk_accounting_finding_reproduces_with_lmcache_alone() -> None:
    """The script calls only LMCache: removes leave phantom bytes, so a disk with room evicts a chunk, a put it
    has room for is skipped, and a disk emptied by removes takes nothing.  A fixed release fails here."""
    spec = importlib.util.spec_from_file_location("lmcache_disk_accounting", FINDING)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclass looks its module up there
    spec.loader.exec_module(script)
    found = script.damage()
    assert found.evicted_with_room and found.skipped_with_room and found.emptied_disk_takes_nothing, found


def test_the_store_machine_finds_only_the_disk_leak_under_safety() -> None:
    """A forced remove of a pinned chunk is the caller's own request (a caller-contract finding), never
    damage: the one safety rule that may fail is the disk's eviction with room."""
    outcome = run_machine(KVStoreMachine, lmcache.factory(), QUICK)
    safety = {
        f.invariant.name if f.invariant else f.detail for f in outcome.findings if f.tier in ("safety", "harness")
    }
    assert safety <= {"invariant_demotion_keeps_the_block"}, safety
