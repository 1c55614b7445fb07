"""The Mooncake store as layer 7's store (``kvspec.adapters.mooncake``).

Skipped unless the Mooncake store imports and its master can start (the libraries it links are
installed).  Pins what the adapter maps (a client per node, a segment that holds exactly the tier's
blocks, replicas on distinct nodes, a closed client as a node fault, leases), and that the master and
clients it starts leave no process and no port behind: after ``shutdown()``, and when the process that
started them is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import Phase, settings

pytest.importorskip("mooncake.store", reason="the Mooncake store is not installed (kvspec/adapters/install-engines.sh)")

from kvspec.adapters import mooncake  # noqa: E402
from kvspec.properties.running import run_machine  # noqa: E402
from kvspec.properties.test_kv_store import KVStoreMachine  # noqa: E402
from kvspec.spec.errors import InvalidOperation, OutOfBlocks  # noqa: E402


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def implementation() -> Iterator[Any]:
    try:
        yield mooncake.factory()
    finally:
        mooncake.shutdown()


def test_the_master_and_its_clients_leave_no_process_and_no_port(implementation: Any) -> None:
    implementation.kv_store(3, (2,), ("lru",))
    running = mooncake.cluster()
    pid, ports = running.master.pid, running.ports()
    assert alive(pid) and all(mooncake.port_open(port) for port in ports[:2])
    mooncake.shutdown()
    assert not alive(pid), "mooncake_master outlived shutdown()"
    assert not [port for port in ports if mooncake.port_open(port)], "a port is still open"


def test_a_killed_parent_takes_its_master_along() -> None:
    """The master dies with the process that started it (``PR_SET_PDEATHSIG``), even one killed outright."""
    script = textwrap.dedent(
        """
        from kvspec.adapters import mooncake
        mooncake.factory().kv_store(1, (1,), ("lru",))
        print(mooncake.cluster().master.pid, *mooncake.cluster().ports(), flush=True)
        import time; time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    pid, *ports = (int(word) for word in child.stdout.readline().split())
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid) and not [port for port in ports if mooncake.port_open(port)]


def test_a_segment_holds_exactly_the_tier_and_a_put_lands_on_its_node(implementation: Any) -> None:
    store = implementation.kv_store(2, (2,), ("lru",))
    store.put(0, "a", (1, 2))
    store.put(0, "b", (3,))
    assert store.lookup("a") == ((0, 0),) and store.get(0, "a") == (1, 2) and store.get(1, "a") is None
    store.put(1, "c", (4,))
    store.put(1, "d", (5,))
    with pytest.raises(OutOfBlocks):  # both segments full
        store.put(0, "e", (6,))
    assert store.snapshot().tiers == ((("a", "b"),), (("c", "d"),))


def test_replicas_on_distinct_nodes_and_a_fault_takes_only_its_own(implementation: Any) -> None:
    store = implementation.kv_store(3, (2,), ("lru",))
    store.put(0, "a", (1,))
    store.replicate("a", 0, 2)
    assert store.lookup("a") == ((0, 0), (2, 0))
    client = store.clients[1]  # replica_num = 2 placed by the master itself: copies on two distinct nodes
    client.store.put_from("r", client.address, store.size, store._config(store.clients[0].segment, client.segment))
    store.keys["r"] = "r"
    assert sorted(n for n, _ in store._replicas(["r"])["r"]) == [0, 1]
    store.fail(0)
    assert store.lookup("a") == ((2, 0),) and store.snapshot().contents[(2, "a")] == (1,)


def test_every_copy_is_leased_so_it_cannot_be_removed(implementation: Any) -> None:
    store = implementation.kv_store(1, (1,), ("lru",))
    store.put(0, "a", (1,))
    assert store.snapshot().leases == {(0, "a"): mooncake.LEASE_SECONDS}
    with pytest.raises(InvalidOperation):
        store.remove(0, "a")
    assert store.evict(0, 0) is None


def test_a_short_run_of_the_store_machine_finds_no_safety_finding(implementation: Any) -> None:
    outcome = run_machine(
        KVStoreMachine, implementation, settings(max_examples=8, stateful_step_count=15, phases=[Phase.generate])
    )
    assert not [f for f in outcome.findings if f.tier == "safety"], [f.detail for f in outcome.findings]
