"""kvspec's ``RadixCache`` protocol over SGLang's own ``RadixCache`` (tested: SGLang 0.5.23).

    kvspec check --impl kvspec.adapters.sglang:factory

The tree is SGLang's, built by ``RadixCache.create_simulated(mock_allocator=...,
page_size=...)``: no GPU memory pool, and a simulated token allocator that records the
KV indices the tree frees.  The calls SGLang's scheduler makes, one per operation (two for a
lock), and no check SGLang lacks:

* ``insert(key, values)`` -> ``insert(InsertParams(key=RadixKey(key), value=values))``;
  the answer is its ``prefix_len``.
* ``match_prefix(key)`` -> ``match_prefix(MatchPrefixParams(key=RadixKey(key)))``; the
  values are the engine's ``path_device_indices`` of the node it returns.
* ``lock(key)`` -> ``inc_lock_ref(match_prefix(MatchPrefixParams(key=...)).last_device_node)``:
  what SGLang's scheduler does (``schedule_policy``: ``req.lock = tree_cache.lock(req.last_node)``
  on the node its match returned), so a lock marks and splits exactly as a match does; a
  key with no cached prefix locks the root, a no-op.
* ``unlock(key)`` -> ``dec_lock_ref(node)`` on the node where the key's longest cached
  prefix ends, found by reading the tree (``RadixKey.child_key_at`` / ``match_at``: no time
  stamp, no split): the node its lock locked.  A key that ends inside a node holds no lock
  (every lock ends a node); out of contract, the adapter releases the node the key reaches,
  as a caller releasing a handle it never locked would.
* ``evict(n)`` -> ``evict(EvictParams(num_tokens=n))``; the evicted values are what the
  tree handed the simulated allocator's ``free_segment``, segment after segment.  A
  segment (a whole leaf) is freed in one call; the adapter lists its tokens deepest
  first, as the spec lists a leaf's.

Importing ``sglang.srt.mem_cache.radix_cache`` pulls in ``torchvision.transforms``
through SGLang's model configs.  On a CPU-only machine the torchvision wheels do not
load, so the adapter first lets transformers record torchvision as absent, then gives
SGLang a stand-in module whose attributes are empty placeholder classes
(``stand_in_for_torchvision``).  Nothing the radix tree runs touches them.

Conventions, as read from ``sglang/srt/mem_cache/radix_cache.py``:

* ``eviction_granularity="whole_leaves"``: ``evict`` pops a leaf and frees its whole
  segment (``free_segment(x.value)``, ``num_evicted += len(x.value)``) until at least
  ``num_tokens`` are freed.
* ``recency="per_node"``: ``_match_prefix_helper`` and ``_insert_helper`` read
  ``access_time = time.monotonic()`` once and set it on each child they visit *before*
  comparing its key, so a walk ending inside a node stamps the node whole, then
  ``_split_node`` cuts it: the lower part (the original ``TreeNode``, the unmatched tail)
  keeps the walk's stamp, the upper part is a new ``TreeNode`` stamped in ``__init__``.
  An insert's new leaf is a ``TreeNode`` made after the walk, so it is newer; ``LRUStrategy``
  orders leaves by ``last_access_time`` (``evict``'s heap of ``(priority, node)``: a tie would
  fall to ``TreeNode.__lt__``, which finds neither first -- but no two leaves share a stamp,
  a walk stamping one path).  ``inc_lock_ref`` / ``dec_lock_ref`` only walk to
  the root adjusting ``lock_ref``: they neither stamp nor split.  What this leaves
  unmodelled (the split's upper part stamped after its walk: no eviction order can see it)
  and in which tier the rest is checked is said in ``kvspec.spec.radix_conventions``.
* ``lock_by="handle"``: ``inc_lock_ref(node)`` walks from the node to the root,
  ``while node != self.root_node``: locking the root is a no-op.
* ``page_size``: passed to ``create_simulated``; keys are cut to whole pages
  (``RadixKey.page_aligned``) and matched page by page.
* ``extra_key_namespaces``: ``RadixKey.extra_key`` keeps equal token ids apart (its child
  keys are ``(extra_key, page)``); the adapter passes a kvspec extra key as it.
* ``trusts_caller=True``: ``dec_lock_ref`` decrements without checking (a count can go
  below zero), ``insert`` truncates or accepts values of any length and any index, and
  ``evict`` of zero or fewer tokens is a no-op.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions, RadixConventions
from kvspec.spec.implementation import Implementation
from kvspec.spec.prefix_cache import ExtraKey
from kvspec.spec.radix_cache import Key, RadixState, name_tokens

VERSION = "0.5.23"


def conventions(page_size: int = 1) -> Conventions:
    radix = RadixConventions(
        eviction_granularity="whole_leaves",
        recency="per_node",
        lock_by="handle",
        page_size=page_size,
        extra_key_namespaces=True,
    )
    return Conventions(radix=radix, trusts_caller=True)


class _StandIn(types.ModuleType):
    """A module whose every public attribute is an empty placeholder class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__module__": self.__name__})
        setattr(self, name, placeholder)
        return placeholder


def stand_in_for_torchvision() -> None:
    """Make transformers see torchvision as absent, then give SGLang's imports a stand-in.

    Does nothing when a torchvision is installed or already imported.
    """
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached (lru_cache) as False before the stand-in exists
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    modules = [_StandIn(name, "kvspec's stand-in: torchvision is not installed") for name in names]
    for module in modules:
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        module.__path__ = []
        sys.modules[module.__name__] = module
    modules[0].transforms = modules[1]  # type: ignore[attr-defined]
    modules[1].functional = modules[2]  # type: ignore[attr-defined]


@functools.cache
def engine() -> types.SimpleNamespace:
    """SGLang's radix cache module and the few names the adapter calls."""
    stand_in_for_torchvision()
    import torch
    from sglang.srt.mem_cache import base_prefix_cache as base
    from sglang.srt.mem_cache import radix_cache

    return types.SimpleNamespace(
        torch=torch,
        RadixCache=radix_cache.RadixCache,
        RadixKey=radix_cache.RadixKey,
        InsertParams=base.InsertParams,
        MatchPrefixParams=base.MatchPrefixParams,
        EvictParams=base.EvictParams,
    )


def engine_version() -> str:
    import sglang

    return str(sglang.__version__)


class SimulatedAllocator:
    """The token-to-KV allocator ``create_simulated`` accepts: records what the tree frees."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free_segment(self, free_index: Any, *, start_pos: int = 0) -> None:
        self.freed.extend(reversed(free_index.tolist()))  # one leaf at once; listed deepest token first


class SglangRadixCache:
    """An SGLang ``RadixCache`` seen through ``kvspec.spec.radix_cache.RadixCache``."""

    def __init__(self, page_size: int = 1) -> None:
        self._sgl = engine()
        self.allocator = SimulatedAllocator()
        self.engine = self._sgl.RadixCache.create_simulated(mock_allocator=self.allocator, page_size=page_size)

    def _key(self, key: Sequence[int], extra_key: ExtraKey) -> Any:
        from array import array

        return self._sgl.RadixKey(array("q", key), extra_key)

    def match_prefix(self, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
        params = self._sgl.MatchPrefixParams(key=self._key(key, extra_key))
        return tuple(self.engine.path_device_indices(self.engine.match_prefix(params).last_device_node).tolist())

    def insert(self, key: Sequence[int], values: Sequence[int], extra_key: ExtraKey = None) -> int:
        tensor = self._sgl.torch.tensor(list(values), dtype=self._sgl.torch.int64)
        return int(self.engine.insert(self._sgl.InsertParams(key=self._key(key, extra_key), value=tensor)).prefix_len)

    def lock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        params = self._sgl.MatchPrefixParams(key=self._key(key, extra_key))
        self.engine.inc_lock_ref(self.engine.match_prefix(params).last_device_node)

    def unlock(self, key: Sequence[int], extra_key: ExtraKey = None) -> None:
        self.engine.dec_lock_ref(self._reached(key, extra_key))

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        start = len(self.allocator.freed)
        self.engine.evict(self._sgl.EvictParams(num_tokens=num_tokens))
        return tuple(self.allocator.freed[start:])

    def total_size(self) -> int:
        return int(self.engine.total_size())

    def evictable_size(self) -> int:
        return int(self.engine.evictable_size())

    def protected_size(self) -> int:
        return int(self.engine.protected_size())

    def snapshot(self) -> RadixState:
        """Each node's tokens (named by page and extra key, ``name_tokens``) and values; a node's own locks are
        its ``lock_ref`` less its children's."""
        values: dict[Key, int] = {}
        locks: dict[Key, int] = {}
        stack: list[tuple[tuple[int, ...], Any]] = [((), self.engine.root_node)]
        while stack:
            tokens, node = stack.pop()
            children = list(node.children.values())
            named = name_tokens(tokens, self.engine.page_size, node.key.extra_key)
            if node is not self.engine.root_node:
                own = node.lock_ref - sum(child.lock_ref for child in children)
                if own:
                    locks[named] = own
            for child in children:
                path = tokens + tuple(child.key)
                named = name_tokens(path, self.engine.page_size, child.key.extra_key)
                for depth, value in enumerate(child.value.tolist(), start=len(tokens) + 1):
                    values[named[:depth]] = value
                stack.append((path, child))
        return RadixState(values=values, locks=locks)

    # -- handles -------------------------------------------------------------------------

    def _reached(self, key: Sequence[int], extra_key: ExtraKey) -> Any:
        """The deepest node the longest cached prefix of ``key`` reaches (the root if none), read off the tree."""
        engine, page_size = self.engine, self.engine.page_size
        radix_key = self._key(key, extra_key).page_aligned(page_size)
        node, depth = engine.root_node, 0
        while depth < len(radix_key):
            child = node.children.get(radix_key.child_key_at(depth, page_size))
            shared = 0 if child is None else child.key.match_at(radix_key, depth, page_size)
            if not shared:
                break
            node, depth = child, depth + shared
            if shared < len(child.key):
                break
        return node


def factory_with_page_size(page_size: int) -> Callable[[], Implementation]:
    def factory() -> Implementation:
        engine()  # fail here, with the engine's ImportError, when SGLang is not installed
        name = f"SGLang {engine_version()} RadixCache" + (f" (page size {page_size})" if page_size != 1 else "")
        return Implementation(
            name=name,
            # lock is two engine calls (match_prefix, inc_lock_ref); unlock reads the tree for the node to release
            radix_cache=Offer(functools.partial(SglangRadixCache, page_size), emulated={"lock", "unlock"}),
            conventions=conventions(page_size),
        )

    return factory


factory = factory_with_page_size(1)
