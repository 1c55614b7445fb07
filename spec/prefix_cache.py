"""Layer 3 -- the prefix cache: chained block hashes and prefix-aware admission.

Rules (lecture §8, vLLM automatic prefix caching, Mooncake §3):

* A token's K and V depend on every token before it, so a block of KV can be
  reused only by a request whose *whole prefix* up to the end of that block is
  the same -- and whose *extra key* (adapter, namespace, salt: opaque, compared
  for equality) is the same.  The spec names that exactly with the **ideal
  key** of full block i: ``(extra_key, tokens[: (i + 1) * B])``.
* Implementations name it with a **chained hash**:
  ``h_0 = H(ROOT, tokens of block 0, extra)``, ``h_i = H(h_{i-1}, tokens of
  block i, extra)``, with a fixed root and a stable, collision-resistant H
  (never Python's salted ``hash()``).  Only full blocks are hashed; a partial
  tail has no hash and is never cached.
* Admission, ``add_sequence(seq, prompt, extra_key)``: the longest run of
  cached full blocks *from the start* is shared (a hit; never copied), capped
  at ``(len(prompt) - 1) // B`` blocks so that at least the last prompt token
  is computed (its logits start generation).  The rest is written as in layer
  2.  The hit costs no allocation but a hit block sitting in the free queue
  leaves it, so room is counted as ``num_free - revived hits``; short of it,
  ``OutOfBlocks`` and nothing changes.  ``WritePlan.cached_tokens = hits * B``.
* A block is registered under its hash the moment it becomes full (before the
  next token allocates), in order; a hash already cached elsewhere leaves the
  new block uncached (the pool's ``register`` answers False).
* ``fork`` passes the parent's extra key to the child; ``free`` releases as in
  layer 2 and full blocks stay cached in the free queue until allocation takes
  them (the pool's policy order: LRU or LFU) or ``evict(n)`` forgets them.
* **Deferred commit** (``commit="after_forward"``, as engines that cache a
  block only once the forward that computes its KV has run): a block that
  fills is *pending*, not registered; ``commit(seq)`` -- the forward over
  the sequence finished -- registers its pending blocks in order (one that
  already carries a hash is skipped), and a fork's child inherits the
  parent's pending blocks.  Freeing a sequence before its commit is an
  **abort**: its pending blocks are dropped, never registered, so KV that
  was never computed is never reused.  Under ``on_fill`` (the default)
  ``commit`` does nothing.
* ``rollback(seq, n)`` (optional; ``kvspec.spec.speculative``) drops
  rejected draft tokens as in layer 2; a block no longer full leaves the
  pending list, and a registered one the sequence now ends in is copied
  before the next write into it -- registered meaning that it carries a
  hash, whether or not ``lookup`` names it (under ``duplicate_hash="keep"``
  a second block carries the hash ``lookup`` finds the first by).
* Ownership: the caller keeps every list it passes (prompts, tokens, groups)
  and may overwrite it at once; the manager keeps copies.  What it answers
  (hashes, hit blocks, plans) belongs to the caller.
* ``cached_prefix(tokens, extra_key)`` names the blocks admission would reuse
  (uncapped) and changes nothing -- in particular it touches no LRU position.

Theory of operation: transitions are pure, so one that raises part-way (a
write short of blocks) leaves nothing behind.  ``CachingManager`` wraps the layer-2 model; its pool
registers blocks under their *ideal keys*, so the model's cache is exact by
construction.  The property machine learns the relation between an
implementation's hashes and ideal keys as it sees them and requires it to stay
a bijection, then compares states through that renaming.

Invariants:

* ``invariant_hash_iff_prefix`` [safety] -- equal hash <=> equal whole prefix and extra key.
* ``invariant_hash_change_propagates`` [safety] -- changing a token of block k changes
  hash k and every later one, never an earlier one.
* ``invariant_hit_is_exact_prefix`` [safety] -- a hit block holds exactly the requested
  prefix, and was cached (not evicted, not reallocated) when it was hit.
* ``invariant_hits_stop_at_first_miss`` [safety] -- the hit length counts whole blocks
  only up to the first miss of the cache's own hash map, as it was when asked.
* ``invariant_reuse_preserves_read_back`` [safety] -- a sequence reads back what it was
  given, hit or not.
* ``invariant_cached_block_holds_its_prefix`` [safety] -- a cached block holds the
  last block of the prefix it is cached under (an aborted request's block,
  reallocated, must not be registered by a commit that outlived the abort).
* ``invariant_evicts_only_what_is_needed`` [convention] -- a write forgets a cached block
  only by handing that very block out.
  (Plus, reused by name: the pool's ``invariant_in_use_never_reclaimed`` and
  ``invariant_eviction_order``, and every layer-1/2 invariant.)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs

from kvspec.spec import block_manager, block_pool, speculative, swap
from kvspec.spec.block_manager import Manager, ManagerState, SeqId, WritePlan
from kvspec.spec.block_pool import Pool, PoolState
from kvspec.spec.components import component_kind, optional_operation
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.invariants import invariant

ExtraKey = Hashable
Commit = Literal["on_fill", "after_forward"]
COMMITS: tuple[Commit, ...] = ("on_fill", "after_forward")
IdealKey = tuple[ExtraKey, tuple[int, ...]]


def check_extra_key(extra_key: object) -> ExtraKey:
    """Extra keys have a canonical encoding: None, int, str, bytes, or tuples of them."""
    if extra_key is None or isinstance(extra_key, str | bytes):
        return extra_key
    if isinstance(extra_key, int) and not isinstance(extra_key, bool):
        return extra_key
    if isinstance(extra_key, tuple):
        for part in extra_key:
            check_extra_key(part)
        return extra_key
    raise InvalidOperation(f"extra key {extra_key!r} is not None, int, str, bytes or a tuple of them")


def ideal_keys(tokens: Sequence[int], block_size: int, extra_key: ExtraKey = None) -> tuple[IdealKey, ...]:
    """The exact identity of each full block: its extra key and the whole prefix it ends."""
    full = len(tokens) // block_size
    return tuple((extra_key, tuple(tokens[: (i + 1) * block_size])) for i in range(full))


def max_hit_blocks(prompt_length: int, block_size: int) -> int:
    """At least the last prompt token is computed, so a hit stops one token short."""
    return (prompt_length - 1) // block_size


@runtime_checkable
class PrefixCachingManager(block_manager.BlockManager, Protocol):
    """A block manager with a prefix cache; the factory, ``prefix_caching_manager(pool, block_size,
    commit="on_fill")``, takes the commit point."""

    def add_sequence(self, seq: SeqId, prompt: Sequence[int], extra_key: ExtraKey = None) -> WritePlan: ...
    def block_hashes(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[Hashable, ...]: ...
    def cached_prefix(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]: ...
    def evict(self, n: int) -> list[int]: ...
    def commit(self, seq: SeqId) -> None: ...


# -- the model -------------------------------------------------------------------


PREFIX_CACHING_MANAGER = component_kind(
    "prefix_caching_manager", PrefixCachingManager, builds='prefix_caching_manager(pool, block_size, commit="on_fill")'
)
# commit="after_forward": filled blocks are cached once the forward ran
DEFERRED_COMMIT = optional_operation(
    "deferred_commit", PrefixCachingManager, "commit", kinds=(PREFIX_CACHING_MANAGER.name,)
)


@attrs.frozen
class CachingManager:
    """The layer-2 model plus each sequence's extra key; its pool is keyed by ideal keys."""

    manager: Manager
    extra_keys: Mapping[SeqId, ExtraKey]
    commit: Commit = "on_fill"
    pending: Mapping[SeqId, tuple[int, ...]] = attrs.field(factory=dict)  # after_forward: filled block indices


def new_caching_manager(block_size: int, pool: Pool, commit: Commit = "on_fill") -> CachingManager:
    if commit not in COMMITS:
        raise InvalidOperation(f"unknown commit point {commit!r}; choose from {COMMITS}")
    return CachingManager(manager=block_manager.new_manager(pool, block_size), extra_keys={}, commit=commit)


def cached_prefix(cm: CachingManager, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[int, ...]:
    """The longest run of cached full blocks from the start, stopping at the first miss."""
    tokens, extra_key = block_manager.check_tokens(tokens, allow_empty=True), check_extra_key(extra_key)
    hits = []
    for key in ideal_keys(tokens, cm.manager.block_size, extra_key):
        block = block_pool.lookup(cm.manager.pool, key)
        if block is None:
            break
        hits.append(block)
    return tuple(hits)


def add_sequence(
    cm: CachingManager, seq: SeqId, prompt: Sequence[int], extra_key: ExtraKey = None
) -> tuple[CachingManager, WritePlan]:
    """Share the cached prefix, write the rest, register blocks as they fill."""
    prompt = block_manager.check_tokens(prompt, allow_empty=False)
    extra_key = check_extra_key(extra_key)
    manager = cm.manager
    block_manager.require_new(manager, seq)
    size = manager.block_size
    hits = cached_prefix(cm, prompt, extra_key)[: max_hit_blocks(len(prompt), size)]
    manager = attrs.evolve(manager, pool=block_pool.share(manager.pool, hits))
    manager = block_manager.start_sequence(manager, seq, hits)
    cm = attrs.evolve(cm, manager=manager, extra_keys={**cm.extra_keys, seq: extra_key})
    cm, plan = _write_registering(cm, seq, prompt[len(hits) * size :])
    return cm, attrs.evolve(plan, cached_tokens=len(hits) * size)


def append(cm: CachingManager, seq: SeqId, tokens: Sequence[int]) -> tuple[CachingManager, WritePlan]:
    tokens = block_manager.check_tokens(tokens, allow_empty=True)
    block_manager.require_live(cm.manager, seq)
    return _write_registering(cm, seq, tokens)


def fork(cm: CachingManager, parent: SeqId, child: SeqId) -> CachingManager:
    manager = block_manager.fork(cm.manager, parent, child)
    pending = {**cm.pending, child: cm.pending.get(parent, ())}
    return attrs.evolve(
        cm, manager=manager, extra_keys={**cm.extra_keys, child: cm.extra_keys[parent]}, pending=pending
    )


def free(cm: CachingManager, seq: SeqId) -> CachingManager:
    """Release the sequence; before its commit, an abort: its pending blocks are dropped."""
    manager = block_manager.free(cm.manager, seq)
    return attrs.evolve(
        cm,
        manager=manager,
        extra_keys={s: k for s, k in cm.extra_keys.items() if s != seq},
        pending={s: p for s, p in cm.pending.items() if s != seq},
    )


def commit(cm: CachingManager, seq: SeqId) -> CachingManager:
    """The forward over ``seq`` ran: register its pending blocks, in order, skipping any already cached."""
    block_manager.require_live(cm.manager, seq)
    manager = cm.manager
    table, tokens, size = manager.tables[seq], manager.tokens[seq], manager.block_size
    for index in cm.pending.get(seq, ()):
        if manager.pool.block_hashes[table[index]] is None:
            key = (cm.extra_keys[seq], tokens[: (index + 1) * size])
            pool, _ = block_pool.register(manager.pool, table[index], key)
            manager = attrs.evolve(manager, pool=pool)
    return attrs.evolve(cm, manager=manager, pending={s: p for s, p in cm.pending.items() if s != seq})


def rollback(cm: CachingManager, seq: SeqId, n: int) -> CachingManager:
    """Layer 2's rollback; the blocks no longer full leave the sequence's pending list."""
    manager = speculative.rollback(cm.manager, seq, n)
    full = len(manager.tokens[seq]) // manager.block_size
    pending = {s: tuple(i for i in p if s != seq or i < full) for s, p in cm.pending.items()}
    return attrs.evolve(cm, manager=manager, pending=pending)


def move_sequences(
    src: CachingManager, dst: CachingManager, seqs: Sequence[SeqId]
) -> tuple[CachingManager, CachingManager, tuple[tuple[int, int], ...]]:
    """Layer 2's move (swap): the group's extra keys travel with it, its blocks arrive uncached."""
    src_manager, dst_manager, mapping = swap.move_sequences(src.manager, dst.manager, seqs)
    keys = {seq: src.extra_keys[seq] for seq in seqs}
    src = attrs.evolve(
        src,
        manager=src_manager,
        extra_keys={s: k for s, k in src.extra_keys.items() if s not in keys},
        pending={s: p for s, p in src.pending.items() if s not in keys},
    )
    return src, attrs.evolve(dst, manager=dst_manager, extra_keys={**dst.extra_keys, **keys}), mapping


def evict(cm: CachingManager, n: int) -> tuple[CachingManager, tuple[int, ...]]:
    pool, victims = block_pool.evict(cm.manager.pool, n)
    return attrs.evolve(cm, manager=attrs.evolve(cm.manager, pool=pool)), victims


def _write_registering(cm: CachingManager, seq: SeqId, tokens: tuple[int, ...]) -> tuple[CachingManager, WritePlan]:
    """Layer 2's write, cut at block boundaries so each block is registered the moment it fills."""
    manager, size, extra_key = cm.manager, cm.manager.block_size, cm.extra_keys[seq]
    copies: list[tuple[int, int]] = []
    slots: list[tuple[int, int]] = []
    start = 0
    while start < len(tokens):
        room_in_block = size - len(manager.tokens[seq]) % size
        manager, plan = block_manager.write(manager, seq, tokens[start : start + room_in_block])
        copies += plan.copies
        slots += plan.slots
        start += room_in_block
        written = manager.tokens[seq]
        if len(written) % size == 0 and cm.commit == "after_forward":
            cm = attrs.evolve(cm, pending={**cm.pending, seq: cm.pending.get(seq, ()) + (len(written) // size - 1,)})
        elif len(written) % size == 0:
            key = (extra_key, written)
            pool, _ = block_pool.register(manager.pool, manager.tables[seq][-1], key)
            manager = attrs.evolve(manager, pool=pool)
    return attrs.evolve(cm, manager=manager), WritePlan(copies=tuple(copies), slots=tuple(slots))


def abstract(cm: CachingManager) -> ManagerState:
    return block_manager.abstract(cm.manager)


def rename_hashes(state: ManagerState, rename: Mapping[Hashable, Hashable]) -> ManagerState:
    """The same state with every block hash replaced through ``rename`` (impl hash -> ideal key)."""
    pool = state.pool
    hashes = tuple(None if h is None else rename.get(h, h) for h in pool.block_hashes)
    cached = {rename.get(h, h): b for h, b in pool.cached.items()}
    return attrs.evolve(state, pool=attrs.evolve(pool, block_hashes=hashes, cached=cached))


# -- invariants ------------------------------------------------------------------


@invariant(
    "KV depends on the whole prefix: equal hashes must mean equal prefixes (and extra keys), and back",
    "safety",
)
def invariant_hash_iff_prefix(pairs: Iterable[tuple[Hashable, IdealKey]]) -> str | None:
    """``pairs`` are every (implementation hash, ideal key) seen for the same block so far."""
    ideal_of: dict[Hashable, IdealKey] = {}
    hash_of: dict[IdealKey, Hashable] = {}
    for block_hash, key in pairs:
        if ideal_of.setdefault(block_hash, key) != key:
            return f"hash {block_hash!r} names two prefixes: {ideal_of[block_hash]} and {key}"
        if hash_of.setdefault(key, block_hash) != block_hash:
            return f"prefix {key} has two hashes: {hash_of[key]!r} and {block_hash!r}"
    return None


@invariant(
    "lecture exercise 10: a changed token changes its block's KV and every later block's, no earlier one's",
    "safety",
)
def invariant_hash_change_propagates(
    original: Sequence[Hashable], changed: Sequence[Hashable], changed_block: int
) -> str | None:
    for i, (before, after) in enumerate(zip(original, changed, strict=True)):
        if i < changed_block and before != after:
            return f"changing block {changed_block} changed the hash of earlier block {i}"
        if i >= changed_block and before == after:
            return f"changing block {changed_block} left the hash of block {i} unchanged"
    return None


@invariant(
    "a hit must reuse KV computed for exactly this prefix; an evicted or reallocated block holds something else",
    "safety",
)
def invariant_hit_is_exact_prefix(
    before: PoolState,
    contents: Mapping[int, Sequence[int]],
    hits: Sequence[int],
    prompt: Sequence[int],
    block_size: int,
) -> str | None:
    """``before`` and ``contents`` are the cache's own pool when asked and block contents, ``hits`` the blocks it
    answered, ``prompt`` what the caller asked for: each hit carried a hash then, and holds the prompt's block."""
    for i, block in enumerate(hits):
        if before.block_hashes[block] is None:
            return f"hit block {block} (logical {i}) was not cached: evicted or reallocated"
        want = tuple(prompt[i * block_size : (i + 1) * block_size])
        if tuple(contents.get(block, ())) != want:
            return f"hit block {block} holds {tuple(contents.get(block, ()))}, the prompt's block {i} is {want}"
    return None


@invariant(
    "a prefix cache can reuse only a run from the start: counting past the first miss overstates the savings",
    "safety",
)
def invariant_hits_stop_at_first_miss(
    before: PoolState, hashes: Sequence[Hashable], cached_tokens: int, block_size: int
) -> str | None:
    """``before`` is the cache's own pool when asked, ``hashes`` the prompt's block hashes as it computes them:
    the tokens it reports cached are whole blocks of the run of leading hashes its map held."""
    run = next((i for i, h in enumerate(hashes) if h not in before.cached), len(hashes))
    if cached_tokens % block_size or cached_tokens > run * block_size:
        return f"reported {cached_tokens} cached tokens, the run of hits up to the first miss is {run} blocks"
    return None


@invariant(
    "reuse is an optimisation: what a sequence reads back must not depend on whether its prefix was a hit",
    "safety",
)
def invariant_reuse_preserves_read_back(seq: SeqId, read_back: Sequence[int], given: Sequence[int]) -> str | None:
    """``read_back`` is what the implementation reads for ``seq``, ``given`` the caller's record of what it wrote
    there (admitted, appended, inherited by a fork, less what it rolled back)."""
    if tuple(read_back) != tuple(given):
        return f"sequence {seq!r} reads back {tuple(read_back)}, it was given {tuple(given)}"
    return None


@invariant(
    "cached blocks are free to keep until their space is needed: forgetting more loses hits for nothing",
    "convention",
)
def invariant_evicts_only_what_is_needed(before: PoolState, after: PoolState, allocated: Sequence[int]) -> str | None:
    """A write may forget a cached block only by handing that very block out (``allocated``)."""
    forgotten = [b for b, h in enumerate(before.block_hashes) if h is not None and after.block_hashes[b] != h]
    needless = sorted(set(forgotten) - set(allocated))
    if needless:
        return f"forgot the cached blocks {needless} while allocating only {sorted(set(allocated))}"
    return None


@invariant(
    "a cached block is reused by every later request with its prefix: it must hold that prefix's last block",
    "safety",
)
def invariant_cached_block_holds_its_prefix(state: ManagerState) -> str | None:
    """Over a state whose hashes are ideal keys (an implementation's renamed through the learned relation)."""
    size = state.block_size
    for block, key in enumerate(state.pool.block_hashes):
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], tuple):
            held, want = tuple(state.contents.get(block, ())), key[1][-size:]
            if held != want:
                return f"block {block} is cached under a prefix ending {want}, but holds {held}"
    return None
