"""kvspec's ``KVStore`` protocol over the Mooncake store (tested: mooncake-transfer-engine-non-cuda 0.3.13.post1).

    kvspec check --impl kvspec.adapters.mooncake:factory --machine "tiered KV store"

A real Mooncake cluster on loopback: one ``mooncake_master`` (with its HTTP
metadata server) that the adapter starts on 127.0.0.1 ports it picks, and one
``mooncake.store.MooncakeDistributedStore`` client per kvspec node (one to
four), each mounting a 16 MiB DRAM segment -- the node's one tier, ``cpu``.
A block is one object: its tokens, then padding to ``16 MiB / (capacity +
1/2)`` bytes, so that a segment holds exactly ``capacity`` of them.  The
master lives as long as the process (it dies with it: ``PR_SET_PDEATHSIG``),
``shutdown()`` stops it and the clients, and every new store resets the
cluster (``remove_all(force=True)``), so the machines' examples share it.

* ``put(n, key, tokens)`` -> client ``n``'s ``put_from`` with
  ``ReplicateConfig(replica_num=1, preferred_segment=<n's segment>)``; ``-200``
  (no space) is ``OutOfBlocks``.
* ``replicate(key, s, t)`` -> client ``s``'s ``create_copy_task(key, [<t's
  segment>])``, its completion awaited (``query_task``).
* ``get(n, key)`` -> where ``get_replica_desc`` names a replica on ``n``, a read of
  the object's head through client ``n`` (``get_into_ranges``); else a miss.
* ``lookup(key)`` -> ``get_replica_desc``: the nodes whose segments hold a replica.
* ``remove(n, key)`` -> ``batch_replica_clear([key], <n's segment>)``; nothing
  cleared is ``InvalidOperation`` (a lease, or no such replica).
  ``evict(n, 0)`` asks the same of the node's copies in turn -- emulated.
* ``fail(n)`` closes client ``n``: the master unmounts its segment and drops its
  replicas.  ``restart(n)`` sets up a new client, on a new port.
* ``settle()``: Mooncake evicts in the background (``BatchEvict``, every few
  milliseconds after a put found no space); the adapter waits for the set of
  objects to stop changing and answers what vanished.
* ``pin`` / ``unpin``: Mooncake protects readers with leases, not pins; the
  adapter counts the caller's pins itself -- emulated.

Conventions, as read from ``mooncake-store/src/master_service.cpp`` (``ExistKey``,
``GetReplicaList``, ``PutEnd``, ``BatchEvict``) and observed:

* ``tiers=("cpu",)``, ``max_nodes=4``.
* ``reput="skip"``: a put of an existing key answers 0 and keeps the object.
* ``read_lease=600.0`` and ``leases_new_copies``: every query that names an
  object (``is_exist``, ``get_replica_desc``, a read) grants it a lease
  (``GrantLease(default_kv_lease_ttl)``), and a lease blocks its removal (-706)
  and its eviction.  The adapter's own snapshot queries every object, so under
  it every copy is leased from the step it was stored; the master runs with a
  10-minute TTL, longer than any example, and model time never advances.
* ``eviction="background"``, ``victims="engine"``: ``BatchEvict`` picks by lease
  timeout across randomly ordered shards.  Leased, nothing is ever evictable here.
* Its caller is not trusted: the master refuses the removal of a leased
  object (-706), and what the adapter maps (a node, a pin) it checks.
* What the adapter cannot make exact, it declares above: lease ends (not
  observable, the TTL outlasts an example), the eviction order, and which
  replica a read through a node's client comes from (the local one, as the
  client prefers it).
"""

from __future__ import annotations

import atexit
import ctypes
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions, StoreConventions, StorePolicy
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.kv_store import NODE_FAULTS, REMOVE, REPLICATE, SETTLE, StoreState, Tokens

VERSION = "0.3.13.post1"
LEASE_SECONDS = 600.0
CONVENTIONS = Conventions(
    store=StoreConventions(
        tiers=("cpu",),
        max_nodes=4,
        policies=("lru",),
        reput="skip",
        read_lease=LEASE_SECONDS,
        leases_new_copies=True,
        eviction="background",
        victims="engine",
    ),
)
MIB = 1 << 20
SEGMENT = 16 * MIB  # the smallest segment the store accepts
HEAD = 64  # a block's tokens: a count and up to 15 token ids, as little-endian int32
NO_SPACE = -200


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def die_with_parent() -> None:
    """Run in the master's process before it starts: the kernel stops it if this process dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Cluster:
    """A master on loopback and the clients of the live nodes: started once, shared by every store."""

    def __init__(self) -> None:
        import mooncake
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.client_class, self.config_class = MooncakeDistributedStore, ReplicateConfig
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.workdir = tempfile.mkdtemp(prefix="kvspec-mooncake-")
        self.master = subprocess.Popen(
            [
                str(Path(mooncake.__file__).parent / "mooncake_master"),
                f"--rpc_port={self.rpc}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http}",
                f"--metrics_port={self.metrics}",
                "--enable_metric_reporting=false",
                f"--default_kv_lease_ttl={int(LEASE_SECONDS * 1000)}",
                "--eviction_high_watermark_ratio=1.0",
            ],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
        deadline = time.monotonic() + 30
        while not (port_open(self.rpc) and port_open(self.http)):
            if self.master.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start (exit status {self.master.returncode})")
            time.sleep(0.05)
        self.clients: list[Client | None] = []
        atexit.register(self.stop)

    def ports(self) -> tuple[int, ...]:
        return (self.rpc, self.http, self.metrics, *(c.port for c in self.clients if c is not None))

    def client(self) -> Client:
        return Client(self)

    def nodes(self, count: int) -> list[Client]:
        """``count`` live clients (the first ones kept, the rest set up), and no other mounted segment."""
        while len(self.clients) > count:
            extra = self.clients.pop()
            if extra is not None:
                extra.close()
        self.clients += [None] * (count - len(self.clients))
        self.clients = [client if client is not None and client.open else self.client() for client in self.clients]
        return [client for client in self.clients if client is not None]

    def stop(self) -> None:
        for client in self.clients:
            if client is not None:
                client.close()
        self.clients = []
        if self.master.poll() is None:
            self.master.terminate()
            try:
                self.master.wait(10)
            except subprocess.TimeoutExpired:
                self.master.kill()
                self.master.wait(10)


class Client:
    """One node: a store client with its 16 MiB segment, and a registered buffer for its transfers."""

    def __init__(self, cluster: Cluster) -> None:
        self.port = free_port()
        self.segment = f"127.0.0.1:{self.port}"
        self.store = cluster.client_class()
        status = self.store.setup(
            self.segment,
            f"http://127.0.0.1:{cluster.http}/metadata",
            SEGMENT,
            SEGMENT,
            "tcp",
            "",
            f"127.0.0.1:{cluster.rpc}",
        )
        if status != 0:
            raise RuntimeError(f"Mooncake client setup on {self.segment} answered {status}")
        self.buffer = ctypes.create_string_buffer(SEGMENT)
        self.address = ctypes.addressof(self.buffer)
        self.store.register_buffer(self.address, SEGMENT)
        self.open = True

    def close(self) -> None:
        if self.open:
            self.store.unregister_buffer(self.address)
            self.store.close()
            self.open = False


_CLUSTER: list[Cluster] = []


def cluster() -> Cluster:
    if not _CLUSTER:
        _CLUSTER.append(Cluster())
    return _CLUSTER[0]


def shutdown() -> None:
    """Stop the master and every client this process started."""
    if _CLUSTER:
        _CLUSTER.pop().stop()


class MooncakeStore:
    """Mooncake clients on one master, seen through ``kvspec.spec.kv_store.KVStore``: a node per client."""

    def __init__(self, nodes: int, capacities: Sequence[int], policies: Sequence[StorePolicy]) -> None:
        if not isinstance(nodes, int) or not 1 <= nodes <= 4 or len(capacities) != 1 or len(policies) != 1:
            raise InvalidOperation("this Mooncake store is one to four clients with one tier (cpu) each")
        self.cluster = cluster()
        self.capacity = capacities[0]
        self.size = int(SEGMENT / (self.capacity + 0.5))
        self.clients = self.cluster.nodes(nodes)
        self.clients[0].store.remove_all(True)
        self.alive = [True] * nodes
        self.keys: dict[str, Hashable] = {}  # Mooncake's key -> kvspec's
        self.pins: dict[tuple[int, Hashable], int] = {}
        self.read: dict[tuple[str, str, int], Tokens] = {}  # (key, segment, buffer address) -> its tokens
        self.refused: frozenset[tuple[int, str]] | None = None  # the replicas when a put last found no space

    # -- mapping ----------------------------------------------------------------------------------

    def _node(self, node: object) -> Client:
        if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(self.clients):
            raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(self.clients) - 1})")
        if not self.alive[node]:
            raise InvalidOperation(f"node {node} has failed; restart it first")
        return self.clients[node]

    def _key(self, key: Hashable) -> str:
        name = repr(key)
        self.keys.setdefault(name, key)
        return name

    def _config(self, *segments: str) -> Any:
        config = self.cluster.config_class()
        config.replica_num = len(segments)
        config.preferred_segments = list(segments)
        return config

    def _replicas(self, names: Sequence[str]) -> dict[str, list[tuple[int, int]]]:
        """Mooncake key -> (node, buffer address) of each memory replica on a live node."""
        nodes = {client.segment: n for n, client in enumerate(self.clients) if self.alive[n]}
        found: dict[str, list[tuple[int, int]]] = {}
        for name, replicas in self.clients[self._any()].store.batch_get_replica_desc(list(names)).items():
            for replica in replicas:
                if replica.is_memory_replica():
                    where = replica.get_memory_descriptor().buffer_descriptor
                    if where.transport_endpoint in nodes:
                        found.setdefault(name, []).append((nodes[where.transport_endpoint], where.buffer_address))
        return found

    def _any(self) -> int:
        return self.alive.index(True)

    def _read(self, node: int, name: str) -> Tokens:
        """The tokens at the head of the object, read through node ``node``'s client."""
        client = self.clients[node]
        client.store.get_into_ranges([client.address], [[name]], [[[0]]], [[[0]]], [[[HEAD]]])
        count, *tokens = struct.unpack_from(f"<{HEAD // 4}i", client.buffer.raw, 0)
        return tuple(tokens[:count])

    # -- operations ---------------------------------------------------------------------------------

    def put(self, node: int, key: Hashable, tokens: Sequence[int]) -> None:
        client = self._node(node)
        contents = tuple(tokens)
        valid = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in contents)
        if key is None or not contents or len(contents) >= HEAD // 4 or not valid:
            raise InvalidOperation(f"a block is a key and 1-15 token ids, got {key!r}: {contents!r}")
        struct.pack_into(f"<{1 + len(contents)}i", client.buffer, 0, len(contents), *contents)
        status = client.store.put_from(self._key(key), client.address, self.size, self._config(client.segment))
        if status == NO_SPACE:  # the master's evictor starts: what it takes, settle answers
            self.refused = self.refused if self.refused is not None else self._places()
            raise OutOfBlocks(1, 0, what=f"space in node {node}'s segment (or any other)")
        if status != 0:
            raise RuntimeError(f"Mooncake put of {key!r} answered {status}")

    def get(self, node: int, key: Hashable) -> Tokens | None:
        self._node(node)
        name = self._key(key)
        if node not in [n for n, _ in self._replicas([name]).get(name, [])]:
            return None
        return self._read(node, name)

    def replicate(self, key: Hashable, source: int, target: int) -> None:
        origin, there = self._node(source), self._node(target)
        name = self._key(key)
        holders = [n for n, _ in self._replicas([name]).get(name, [])]
        if source not in holders or target in holders:
            raise InvalidOperation(f"node {source} must hold {key!r} and node {target} must not")
        task, status = origin.store.create_copy_task(name, [there.segment])
        if status != 0:
            raise RuntimeError(f"Mooncake copy task of {key!r} answered {status}")
        deadline = time.monotonic() + 30
        while True:
            answer, status = origin.store.query_task(task)
            state = str(getattr(answer, "status", ""))
            if state.endswith("SUCCESS"):
                return
            if state.endswith("FAILED") or time.monotonic() > deadline:
                raise OutOfBlocks(1, 0, what=f"space in node {target}'s segment for a replica ({state})")
            time.sleep(0.02)

    def pin(self, node: int, key: Hashable) -> None:
        self._held(node, key)
        self.pins[(node, key)] = self.pins.get((node, key), 0) + 1

    def unpin(self, node: int, key: Hashable) -> None:
        self._held(node, key)
        if not self.pins.get((node, key)):
            raise InvalidOperation(f"block {key!r} on node {node} is not pinned")
        self.pins[(node, key)] -= 1

    def _held(self, node: int, key: Hashable) -> str:
        self._node(node)
        name = self._key(key)
        if node not in [n for n, _ in self._replicas([name]).get(name, [])]:
            raise InvalidOperation(f"node {node} holds no block {key!r}")
        return name

    def remove(self, node: int, key: Hashable) -> None:
        name = self._held(node, key)
        if self.pins.get((node, key)) or not self.clients[node].store.batch_replica_clear(
            [name], self.clients[node].segment
        ):
            raise InvalidOperation(f"block {key!r} on node {node} is in use (a lease, or a pin)")

    def demote(self, node: int, tier: int) -> Hashable | None:
        self._node(node)
        raise InvalidOperation(f"tier {tier!r}: a Mooncake node has one tier, the last: evict from it instead")

    def evict(self, node: int, tier: int) -> Hashable | None:
        """The node's first copy (by repr) that ``batch_replica_clear`` gives up; None when every one is in use."""
        client = self._node(node)
        if tier != 0 or isinstance(tier, bool):
            raise InvalidOperation(f"tier {tier!r} is not a tier (0..0: cpu)")
        held = sorted(name for name, places in self._replicas(list(self.keys)).items() if node in dict(places))
        for name in held:
            if not self.pins.get((node, self.keys[name])) and client.store.batch_replica_clear([name], client.segment):
                return self.keys[name]
        return None

    def fail(self, node: int) -> None:
        self._node(node).close()
        self.alive[node] = False
        self.pins = {place: count for place, count in self.pins.items() if place[0] != node}

    def restart(self, node: int) -> None:
        if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < len(self.clients):
            raise InvalidOperation(f"node {node!r} is not a node of this store (0..{len(self.clients) - 1})")
        if self.alive[node]:
            raise InvalidOperation(f"node {node} is alive: only a failed node restarts")
        self.clients[node] = self.cluster.clients[node] = self.cluster.client()
        self.alive[node] = True

    def lookup(self, key: Hashable) -> tuple[tuple[int, int], ...]:
        if not any(self.alive):
            return ()
        name = self._key(key)
        return tuple(sorted((n, 0) for n, _ in self._replicas([name]).get(name, [])))

    def settle(self) -> tuple[tuple[int, Hashable], ...]:
        """Wait for the master's evictor to finish what a refused put started; the copies it took."""
        if self.refused is None or not any(self.alive):
            return ()
        before, self.refused = self.refused, None
        now = self._places()
        time.sleep(0.05)  # BatchEvict runs every few milliseconds once a put found no space
        while (later := self._places()) != now:
            now = later
            time.sleep(0.05)
        return tuple(sorted(((n, self.keys[name]) for n, name in before - now), key=repr))

    def _places(self) -> frozenset[tuple[int, str]]:
        return frozenset((n, name) for name, places in self._replicas(list(self.keys)).items() for n, _ in places)

    # -- the abstraction function ---------------------------------------------------------------------

    def snapshot(self) -> StoreState:
        """The master's replicas of every key ever put (``batch_get_replica_desc``), each replica's tokens read
        once through its node's client (objects are immutable: a replica is re-read when its buffer moves)."""
        replicas = self._replicas(list(self.keys)) if any(self.alive) else {}
        contents: dict[tuple[int, Hashable], Tokens] = {}
        for name, places in replicas.items():
            for node, address in places:
                where = (name, self.clients[node].segment, address)
                if where not in self.read:
                    self.read[where] = self._read(node, name)
                contents[(node, self.keys[name])] = self.read[where]
        tiers = tuple(
            (tuple(sorted((key for n, key in contents if n == node), key=repr)),) for node in range(len(self.clients))
        )
        return StoreState(
            capacities=(self.capacity,),
            alive=tuple(self.alive),
            tiers=tiers,
            contents=contents,
            pins={place: count for place, count in self.pins.items() if count and place in contents},
            directory={self.keys[name]: tuple(sorted((n, 0) for n, _ in places)) for name, places in replicas.items()},
            names=CONVENTIONS.store.tiers,
            leases=dict.fromkeys(contents, LEASE_SECONDS),  # every copy the snapshot names is leased (see above)
        )


def engine_version() -> str:
    from importlib.metadata import version

    return version("mooncake-transfer-engine-non-cuda")


def quiet_logs() -> None:
    """Mooncake's client logs each miss of ``batch_get_replica_desc`` as an ERROR (glog, to stderr), and kvspec
    asks after keys that may be gone: raise glog's threshold in the loaded library to FATAL."""
    from mooncake import store

    ctypes.c_int.in_dll(ctypes.CDLL(store.__file__), "_ZN3fLI17FLAGS_minloglevelE").value = 3


def factory() -> Implementation:
    """The Mooncake store under test as layer 7's store; every other layer is the reference's."""
    quiet_logs()  # and fail here, with the engine's ImportError, when Mooncake is missing

    store = Offer(
        MooncakeStore,
        operations={REPLICATE, NODE_FAULTS, SETTLE, REMOVE},
        emulated={"get", "pin", "unpin", "evict"},
    )
    return Implementation(name=f"Mooncake store {engine_version()}", kv_store=store, conventions=CONVENTIONS)
