"""vLLM's CPU offloading manager as layer 7's store (``kvspec.adapters.vllm_offload``).

Skipped unless vLLM imports.  Pins what the adapter maps (one node, one tier, pending stores, a pin
that is not a cache access, the GPU worker's slot writes), what each policy does (LRU ranks, ARC's
lists and ghosts), the engine behaviour its verdict reports, and a short run of the store machine.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import Phase, settings

pytest.importorskip(
    "vllm.v1.kv_offload.cpu.manager", reason="vLLM is not installed (kvspec/adapters/install-engines.sh)"
)

from kvspec.adapters import vllm_offload  # noqa: E402
from kvspec.properties.running import run_machine  # noqa: E402
from kvspec.properties.test_kv_store import KVStoreMachine  # noqa: E402
from kvspec.spec import kv_store  # noqa: E402
from kvspec.spec.errors import InvalidOperation, OutOfBlocks  # noqa: E402

QUICK = settings(max_examples=30, derandomize=True, phases=[Phase.generate])  # found, not shrunk


def store(capacity: int, policy: str) -> Any:
    return vllm_offload.factory().kv_store(1, (capacity,), (policy,))


def test_one_node_one_tier_and_only_its_policies() -> None:
    implementation = vllm_offload.factory()
    assert implementation.conventions.store.tiers == ("cpu",) and implementation.conventions.store.max_nodes == 1
    for shape in ((2, (1,), ("lru",)), (1, (1, 1), ("lru", "lru")), (1, (1,), ("lfu",))):
        with pytest.raises(InvalidOperation):
            implementation.kv_store(*shape)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_pending_store_is_not_readable_and_a_failed_one_leaves_a_miss(policy: str) -> None:
    offload = store(2, policy)
    offload.put(0, "a", (1, 2))
    assert (offload.find(0, "a"), offload.get(0, "a")) == ("pending", None)
    assert offload.snapshot().pending == {(0, "a")}
    offload.complete(0, "a", True)
    assert (offload.find(0, "a"), offload.get(0, "a")) == ("hit", (1, 2))
    offload.put(0, "b", (3,))
    offload.complete(0, "b", False)
    assert (offload.find(0, "b"), offload.lookup("b")) == ("miss", ())


def test_lru_evicts_the_least_recently_used_ready_chunk_and_never_a_pinned_one() -> None:
    offload = store(2, "lru")
    for key in ("a", "b"):
        offload.put(0, key, (ord(key),))
        offload.complete(0, key, True)
    offload.get(0, "a")  # a use: b is now the least recently used
    offload.pin(0, "b")
    offload.put(0, "c", (3,))  # b is pinned: a goes
    assert offload.snapshot().tiers == ((("b", "c"),),)
    with pytest.raises(OutOfBlocks):  # b pinned, c pending: nothing can go
        offload.put(0, "d", (4,))
    assert offload.snapshot().pins == {(0, "b"): 1}


def test_arc_moves_a_reused_chunk_to_t2_and_remembers_its_victims() -> None:
    offload = store(2, "arc")
    for key in ("a", "b"):
        offload.put(0, key, (ord(key),))
        offload.complete(0, key, True)
    offload.get(0, "a")
    offload.put(0, "c", (3,))  # T1 holds b: b goes, into B1
    lists = offload.snapshot().arc[(0, 0)]
    assert (lists.recent, lists.frequent, lists.recent_ghosts) == (("c",), ("a",), ("b",))


def test_a_refused_store_still_adapts_arc_to_its_ghost() -> None:
    """The engine's choice the adapter declares (``refusal_adapts_policy``): ``prepare_store`` calls
    ``on_store_miss`` (ARC's ghost-hit adaptation) before it finds no evictable chunk and answers None; what a
    refusal must keep (``kept_by_a_refusal``) is as it was."""
    offload = store(1, "arc")
    offload.put(0, "a", (1,))
    offload.complete(0, "a", True)
    offload.put(0, "b", (2,))  # a goes, into B1; b stays pending, so nothing is evictable
    before = offload.snapshot()
    with pytest.raises(OutOfBlocks):
        offload.put(0, "a", (1,))
    after = offload.snapshot()
    assert before.arc[(0, 0)].target == 0.0 and after.arc[(0, 0)].target == 1.0
    assert kv_store.kept_by_a_refusal(before) == kv_store.kept_by_a_refusal(after)


def test_a_store_of_a_ready_chunk_is_a_use() -> None:
    offload = store(2, "lru")
    for key in ("a", "b"):
        offload.put(0, key, (ord(key),))
        offload.complete(0, key, True)
    offload.put(0, "a", (0,))  # touched, not rewritten
    assert offload.snapshot().tiers == ((("b", "a"),),)
    assert offload.get(0, "a") == (ord("a"),)


def test_the_store_machine_finds_no_safety_finding() -> None:
    """Judged against the model of its declared choices, the refused store's ARC adaptation included."""
    outcome = run_machine(KVStoreMachine, vllm_offload.factory(), QUICK)
    assert not [f for f in outcome.findings if f.tier in ("safety", "harness")], [f.detail for f in outcome.findings]
