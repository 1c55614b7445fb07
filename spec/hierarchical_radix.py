"""Layer 3, hierarchical form -- a radix cache over a device tier and a host tier (SGLang's HiCache).

Rules (SGLang ``HiRadixCache`` over its ``HiCacheController``, write-through policy):

* Every cached token (named by its prefix, as in ``spec.radix_cache``) has a *device copy* -- the KV slot
  its caller stored it in, what a forward reads --, a *host copy* -- a slot of the cache's own host pool of
  ``host_capacity`` slots --, or both.  A copy holds a KV: the id of the caller's write that computed it
  (the value an insert stored); a copy still being filled by a transfer holds none yet.
* ``insert(key, values)`` -- the radix chapter's insert: tokens on the device keep their copies and the
  answer counts them (the leading run on the device); tokens held on the host alone take the new values as
  device copies (the caller recomputed them: SGLang's insert "changes the reference if the node is
  evicted"); the rest are cached on the device.  The walk is marked used, then the tokens given copies.
* ``match_prefix(key)`` answers ``(values, host_hit)``: the device copies of the longest prefix of ``key``
  on the device, and how many tokens after it are held on the host alone (``host_hit_length``); it marks
  them all used.  Those host tokens are not read until they are loaded back.
* ``write_through(key)`` starts copying the device run of ``key`` that has no host copy yet to the host
  (``write_backup``; a whole run from the root, so host copies stay prefix closed, as SGLang backs a
  parent up before its child).  Its host slots are taken now: with too few free, host leaves are evicted
  first; with too few even then, the call is refused ``OutOfBlocks`` and changes nothing.  The write is
  *in flight* until ``finish_writes()`` lands every write (``writing_check``).
* ``evict(n)`` frees the device copies of ``min(n, evictable)`` tokens, one token at a time from the least
  recently used *device leaf* (on the device, extended by no token on the device) that no transfer pins.
  A token with a landed host copy is *demoted* to it (``_evict_backuped``); one without is dropped from the
  cache (``_evict_regular``: host copies being prefix closed, it is a leaf of the whole tree).  The answer
  is the freed device slots, in that order.
* ``evict_host(n)`` drops ``min(n, held on the host alone)`` tokens, each the least recently used *host
  leaf*: held on the host alone and extended by no cached token (``evict_host``); it answers how many.
* ``load_back(key, values)`` loads the host hit of ``key`` (as a match counts it) into the device slots
  ``values``, one a token, all or none (``load_back``): another count is ``InvalidOperation``.  The load
  is *in flight* until ``finish_loads()`` lands every load (``loading_check``); meanwhile the tokens have
  their device slots and a match answers them (the forward waits on the load, ``load_cache_event``).
* A transfer pins both its copies: no eviction, device or host, takes a token whose write or load is in
  flight (SGLang locks the node, ``inc_lock_ref``).  Bad arguments raise ``InvalidOperation``, no change.

Theory of operation: the model is the radix chapter's trie (``spec.radix_cache.Radix``, its recency per
token and its helpers) whose ``values`` are the device copies, with the KV each device copy holds
(``device_kv``; absent while a load fills it) and the host copies with theirs (``host_kv``; None while a
write fills it).  A real cache keeps runs of tokens in nodes and *splits* a node where a walk ends inside
it -- also while the node's write-through or load is in flight, so each half must keep its own tokens'
host slots and its share of the transfer.  The abstract state (``HierState``) lists every cached token's
copies and the KV they hold, so a split that leaves a host slot on the wrong half shows as a copy holding
another token's KV, and one that drops a pending write shows as a pin released.

Not modelled: the storage tier (SGLang's ``hicache_storage``: a third copy, prefetched into the host),
request locks (the radix chapter's), the write-back policy and hit-count thresholds (the caller decides
when to write through), pages and extra keys.

Invariants (tier in brackets):

* ``invariant_hicache_copies_hold_their_kv`` [safety] -- every landed copy holds a KV its caller
  computed for exactly that token.
* ``invariant_hicache_every_token_readable`` [safety] -- a token off the device has a landed host copy;
  a token on the device has its whole prefix there.  So a device eviction demotes a token to a landed host
  copy or drops it, and with the prefix closure nothing stays cached below a dropped token.
* ``invariant_hicache_write_through_pins_device`` [safety] -- a token whose write-through is in flight
  keeps its device copy and its pending host copy until the write lands.
* ``invariant_hicache_host_evicts_only_leaves`` [safety] -- a host copy is dropped only from a token held
  on the host alone (no device copy, no load in flight) that no remaining token extends.
* ``invariant_hicache_hit_read_from_device`` [safety] -- a match answers the device copies of the key's
  longest run on the device, never a host-only token's slot.
* ``invariant_hicache_refines_spec`` [convention] -- the implementation is in the model's state.
  (The cached tokens stay prefix closed: ``spec.radix_cache.invariant_radix_prefix_closed``.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvspec.spec import radix_cache as chapter
from kvspec.spec.block_manager import check_tokens
from kvspec.spec.components import component_kind
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.invariants import invariant, refinement
from kvspec.spec.radix_cache import Key, Radix, RadixState


@attrs.frozen
class Copies:
    """One cached token's copies: its device slot and the KV there, whether it has a host copy, and its KV."""

    device: int | None = None
    device_kv: int | None = None  # None while a load into the device slot is in flight
    host: bool = False
    host_kv: int | None = None  # None while a write-through into the host copy is in flight

    @property
    def writing(self) -> bool:
        return self.host and self.host_kv is None

    @property
    def loading(self) -> bool:
        return self.device is not None and self.device_kv is None


@attrs.frozen
class HierState:
    """The abstract state: each cached token's copies."""

    copies: Mapping[Key, Copies]


@runtime_checkable
class HierarchicalRadixCache(Protocol):
    """What a two-tier radix cache offers; thin enough to wrap SGLang's ``HiRadixCache``."""

    def match_prefix(self, key: Sequence[int]) -> tuple[tuple[int, ...], int]: ...
    def insert(self, key: Sequence[int], values: Sequence[int]) -> int: ...
    def write_through(self, key: Sequence[int]) -> int: ...
    def finish_writes(self) -> int: ...
    def evict(self, num_tokens: int) -> tuple[int, ...]: ...
    def evict_host(self, num_tokens: int) -> int: ...
    def load_back(self, key: Sequence[int], values: Sequence[int]) -> int: ...
    def finish_loads(self) -> int: ...
    def snapshot(self) -> HierState: ...


HIERARCHICAL_RADIX_CACHE = component_kind(
    "hierarchical_radix_cache", HierarchicalRadixCache, builds="hierarchical_radix_cache(host_capacity)"
)


# -- the model -------------------------------------------------------------------


@attrs.frozen
class HierRadix(Radix):
    """The chapter's trie over device copies (``values``), with the KV of each copy on either tier."""

    device_kv: Mapping[Key, int] = attrs.field(factory=dict)
    host_kv: Mapping[Key, int | None] = attrs.field(factory=dict)
    host_capacity: int = 0


def new_hier(host_capacity: int) -> HierRadix:
    return HierRadix(values={}, last_use={}, locks={}, clock=0, host_capacity=host_capacity)


def abstract(hier: HierRadix) -> HierState:
    cached = dict.fromkeys([*hier.values, *hier.host_kv])
    return HierState(
        {
            token: Copies(
                hier.values.get(token), hier.device_kv.get(token), token in hier.host_kv, hier.host_kv.get(token)
            )
            for token in cached
        }
    )


def named(hier: HierRadix, key: object) -> Key:
    return chapter.key_of(hier, key, None, cut=True)


def runs(hier: HierRadix, key: Key) -> tuple[int, int]:
    """How many leading tokens of ``key`` are on the device, and how many after them on the host alone."""
    on_device = end = chapter.cached_length(hier, key)
    while end < len(key) and key[: end + 1] in hier.host_kv:
        end += 1
    return on_device, end - on_device


def match_prefix(hier: HierRadix, key: Sequence[int]) -> tuple[HierRadix, tuple[tuple[int, ...], int]]:
    tokens = named(hier, key)
    on_device, host_hit = runs(hier, tokens)
    used = chapter.path(tokens, on_device + host_hit)
    return chapter.mark(hier, used), (tuple(hier.values[token] for token in used[:on_device]), host_hit)


def insert(hier: HierRadix, key: Sequence[int], values: Sequence[int]) -> tuple[HierRadix, int]:
    tokens, stored = chapter.checked_insert(hier, key, values, None)
    on_device = chapter.cached_length(hier, tokens)
    hier = chapter.mark(hier, chapter.path(tokens, on_device))
    if on_device == len(tokens):
        return hier, on_device
    hier = chapter.add(hier, tokens, stored, on_device)  # host-only tokens take the caller's copies too
    written = {tokens[: i + 1]: stored[i] for i in range(on_device, len(tokens))}
    return attrs.evolve(hier, device_kv={**hier.device_kv, **written}), on_device


def write_through(hier: HierRadix, key: Sequence[int]) -> tuple[HierRadix, int]:
    tokens = named(hier, key)
    run = chapter.path(tokens, chapter.cached_length(hier, tokens))
    targets = [token for token in run if token not in hier.host_kv]
    short = len(hier.host_kv) + len(targets) - hier.host_capacity
    if short > 0:
        host_alone = len(hier.host_kv.keys() - hier.values.keys())
        if short > host_alone:
            raise OutOfBlocks(len(targets), hier.host_capacity - len(hier.host_kv) + host_alone, "host slots")
        hier, _ = evict_host(hier, short)
    return attrs.evolve(hier, host_kv={**hier.host_kv, **dict.fromkeys(targets)}), len(targets)


def finish_writes(hier: HierRadix) -> tuple[HierRadix, int]:
    landed = {token: hier.device_kv[token] for token, kv in hier.host_kv.items() if kv is None}
    return attrs.evolve(hier, host_kv={**hier.host_kv, **landed}), len(landed)


def load_back(hier: HierRadix, key: Sequence[int], values: Sequence[int]) -> tuple[HierRadix, int]:
    tokens, slots = named(hier, key), check_tokens(values, allow_empty=True)
    on_device, host_hit = runs(hier, tokens)
    if len(slots) != host_hit:
        raise InvalidOperation(f"{len(slots)} device slots to load a host hit of {host_hit} tokens")
    loading = dict(zip(chapter.path(tokens, on_device + host_hit)[on_device:], slots, strict=True))
    return attrs.evolve(hier, values={**hier.values, **loading}), host_hit


def finish_loads(hier: HierRadix) -> tuple[HierRadix, int]:
    landed = {t: kv for t in hier.values if t not in hier.device_kv and (kv := hier.host_kv.get(t)) is not None}
    return attrs.evolve(hier, device_kv={**hier.device_kv, **landed}), len(landed)


def in_transfer(hier: HierRadix, token: Key) -> bool:
    """Whether a write-through from, or a load into, ``token``'s device copy is in flight."""
    return (token in hier.host_kv and hier.host_kv[token] is None) or token not in hier.device_kv


def evict_device_token(hier: HierRadix) -> tuple[HierRadix, tuple[int, ...]] | None:
    """Free the least recently used unpinned device leaf: demoted to its host copy, or dropped if it has none."""
    leaves = [token for token in chapter.evictable_leaves(hier) if not in_transfer(hier, token)]
    if not leaves:
        return None
    leaf = leaves[0]
    device_kv = {token: kv for token, kv in hier.device_kv.items() if token != leaf}
    if leaf in hier.host_kv:
        values = {token: slot for token, slot in hier.values.items() if token != leaf}
        return attrs.evolve(hier, values=values, device_kv=device_kv), (hier.values[leaf],)
    hier, freed = chapter.without(hier, (leaf,))
    return attrs.evolve(hier, device_kv=device_kv), freed


def evict(hier: HierRadix, num_tokens: int) -> tuple[HierRadix, tuple[int, ...]]:
    return chapter.evict_by(hier, num_tokens, evict_device_token)


def host_leaves(hier: HierRadix) -> list[Key]:
    """Tokens held on the host alone that no cached token extends, least recently used first."""
    parents = {token[:-1] for token in [*hier.values, *hier.host_kv]}
    leaves = [token for token in hier.host_kv if token not in hier.values and token not in parents]
    return sorted(leaves, key=hier.last_use.__getitem__)


def evict_host_token(hier: HierRadix) -> tuple[HierRadix, tuple[int, ...]] | None:
    """Drop the least recently used host leaf; the answer counts it (``evict_host`` answers how many went)."""
    leaves = host_leaves(hier)
    if not leaves:
        return None
    leaf = leaves[0]
    host_kv = {token: kv for token, kv in hier.host_kv.items() if token != leaf}
    last_use = {token: time for token, time in hier.last_use.items() if token != leaf}
    return attrs.evolve(hier, host_kv=host_kv, last_use=last_use), (1,)


def evict_host(hier: HierRadix, num_tokens: int) -> tuple[HierRadix, int]:
    hier, dropped = chapter.evict_by(hier, num_tokens, evict_host_token)
    return hier, len(dropped)


def state_runs(state: HierState, key: Key) -> tuple[tuple[int, ...], int]:
    """Read off a cache's own state: the device slots of ``key``'s leading run on the device, and how many tokens
    after it are held on the host alone (what a match answers; what a load back takes slots for)."""
    slots: list[int] = []
    host_hit = 0
    for end in range(1, len(key) + 1):
        copies = state.copies.get(key[:end])
        if copies is not None and copies.device is not None and not host_hit:
            slots.append(copies.device)
        elif copies is not None and copies.device is None and copies.host:
            host_hit += 1
        else:
            break
    return tuple(slots), host_hit


def as_radix_state(state: HierState) -> RadixState:
    """The cached tokens as the radix chapter's state (for its rule that they stay prefix closed)."""
    return RadixState(values={token: copies.device or 0 for token, copies in state.copies.items()}, locks={})


# -- invariants ------------------------------------------------------------------


@invariant(
    "a forward reads what a copy holds: a host copy or loaded slot holding another token's KV corrupts every "
    "request that hits it",
    "safety",
)
def invariant_hicache_copies_hold_their_kv(state: HierState, computed_for: Mapping[int, Key]) -> str | None:
    """``computed_for``: the caller's record of each KV it wrote (an insert's value) and the token it computed."""
    for token, copies in state.copies.items():
        for tier, kv in (("device", copies.device_kv), ("host", copies.host_kv)):
            if kv is not None and computed_for.get(kv) != token:
                return f"the {tier} copy of {token} holds KV {kv}, computed for {computed_for.get(kv, 'no token')}"
    return None


@invariant(
    "a cached token is a promise of its KV: one off the device needs a landed host copy to load back, one on the "
    "device needs its whole prefix there for a forward to read it",
    "safety",
)
def invariant_hicache_every_token_readable(state: HierState) -> str | None:
    for token, copies in state.copies.items():
        if copies.device is None and copies.host_kv is None:
            pending = "only a host copy still being written" if copies.host else "no copy at all"
            return f"{token} is cached off the device with {pending}"
        parent = state.copies.get(token[:-1])
        if copies.device is not None and len(token) > 1 and (parent is None or parent.device is None):
            return f"{token} is on the device, its prefix {token[:-1]} is not"
    return None


@invariant(
    "a write-through reads the device slot until it lands: freeing the slot, or losing the pending host copy in a "
    "split, lands garbage on the host or loses the write",
    "safety",
)
def invariant_hicache_write_through_pins_device(before: HierState, after: HierState) -> str | None:
    for token, copies in before.copies.items():
        if not copies.writing:
            continue
        now = after.copies.get(token)
        if now is None or now.device != copies.device or not now.host:
            return f"{token}'s write-through was in flight, and the call left it with {now}"
    return None


@invariant(
    "a host copy is the only copy of a token off the device: dropping one under a cached child orphans the child, "
    "one with a device copy loses the backup, one being loaded loads garbage",
    "safety",
)
def invariant_hicache_host_evicts_only_leaves(before: HierState, after: HierState) -> str | None:
    for token, copies in before.copies.items():
        now = after.copies.get(token)
        if not copies.host or (now is not None and now.host):
            continue
        if copies.device is not None:
            return f"dropped the host copy of {token}, which {'is loading' if copies.loading else 'is on the device'}"
        extended = sorted((t for t in after.copies if t[: len(token)] == token and t != token), key=len)
        if extended:
            return f"dropped the host copy of {token}, which the cached {extended[0]} extends"
    return None


@invariant(
    "a forward reads the slots a match answers: a host-only token's slot is not its KV until it is loaded back",
    "safety",
)
def invariant_hicache_hit_read_from_device(before: HierState, key: Key, values: Sequence[int]) -> str | None:
    """``before`` is the cache's own state when asked; ``key`` the key's tokens."""
    on_device, _ = state_runs(before, key)
    if tuple(values) != on_device:
        return f"a match answered slots {tuple(values)}; the key's run on the device holds {on_device}"
    return None


invariant_hicache_refines_spec = refinement("invariant_hicache_refines_spec")
