"""vLLM's v1 ``KVCacheManager`` (``kvspec.adapters.vllm_kv_cache_manager``): full, sliding, hybrid.

Skipped unless vLLM imports.  Pins the adapter's mapping (the null block, hits capped at the last
prompt token, extra keys as cache salts, deferred commit as ``delay_cache_blocks`` then
``cache_blocks``, a refused append leaving the request as it was), the sliding window's convention
as read from vLLM (blocks leave the table at the request's next allocation, for the window of the
next token), and, for the hybrid (two KV cache groups over one pool, no kvspec layer of its own),
kvspec's safety rules checked on the engine's state after every operation of random runs.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (kvspec/adapters/install-engines.sh)")

from kvspec.adapters import vllm_kv_cache_manager as adapter  # noqa: E402
from kvspec.impl.block_pool import BlockPool  # noqa: E402
from kvspec.spec import block_pool, sliding_window  # noqa: E402
from kvspec.spec.conventions import WindowConventions  # noqa: E402
from kvspec.spec.errors import OutOfBlocks  # noqa: E402
from kvspec.spec.prefix_cache import DEFERRED_COMMIT, Commit  # noqa: E402


def full(capacity: int, block_size: int, commit: Commit = "on_fill") -> adapter.VllmPrefixCachingManager:
    return adapter.VllmPrefixCachingManager(BlockPool(capacity, "lru"), block_size, commit)


def test_the_null_block_is_hidden_and_blocks_renumbered() -> None:
    manager = full(4, 2)
    assert manager._tables.engine.block_pool.num_gpu_blocks == 5
    manager.add_sequence(0, [1, 2, 3])
    assert manager.block_table(0) == (0, 1) and manager.pool.num_free() == 2
    assert manager.read(0) == (1, 2, 3)


def test_a_prompt_hits_whole_blocks_but_its_last_token_is_computed() -> None:
    manager = full(8, 4)
    manager.add_sequence(0, list(range(9)))
    assert manager.add_sequence(1, list(range(9)) + [30]).cached_tokens == 8
    assert manager.add_sequence(2, list(range(8))).cached_tokens == 4  # capped at len - 1
    assert manager.cached_prefix(list(range(8))) == manager.block_table(0)[:2]  # a lookup is not capped


def test_extra_keys_are_cache_salts() -> None:
    manager = full(8, 2)
    manager.add_sequence(0, [1, 2, 3], extra_key="tenant-a")
    assert manager.add_sequence(1, [1, 2, 3], extra_key=("tenant-a",)).cached_tokens == 0
    assert manager.add_sequence(2, [1, 2, 3], extra_key="tenant-a").cached_tokens == 2
    assert manager.block_hashes([1, 2], "1") != manager.block_hashes([1, 2], 1)


def test_a_refused_admission_or_append_changes_nothing() -> None:
    manager = full(2, 2)
    manager.add_sequence(0, [1, 2, 3])
    before = manager.snapshot()
    with pytest.raises(OutOfBlocks):
        manager.add_sequence(1, [7, 8, 9])
    with pytest.raises(OutOfBlocks):
        manager.append(0, [4, 5])
    assert manager.snapshot() == before and manager._tables.requests[0].num_tokens == 3


def test_nothing_to_append_is_no_engine_call() -> None:
    manager = full(2, 2)
    manager.add_sequence(0, [1, 2])
    assert manager.append(0, []).slots == () and manager.read(0) == (1, 2)


def test_deferred_commit_caches_blocks_only_after_the_forward() -> None:
    manager = full(8, 2, commit="after_forward")
    manager.add_sequence(0, [1, 2, 3, 4])
    assert manager.add_sequence(1, [1, 2, 3, 4, 5]).cached_tokens == 0
    manager.commit(0)
    assert manager.add_sequence(2, [1, 2, 3, 4, 5]).cached_tokens == 4


def test_evict_hands_the_first_cached_free_blocks_to_evict_blocks() -> None:
    manager = full(4, 1)
    manager.add_sequence(0, [1, 2, 3])
    manager.free(0)
    assert manager.evict(2) == [2, 1]  # freed last block first: the tail block is evicted first
    assert manager.cached_prefix([1, 2, 3]) == (0,)


def test_fork_and_swap_are_not_offered() -> None:
    offer = adapter.full().prefix_caching_manager
    assert offer is not None and offer.operations == frozenset({DEFERRED_COMMIT})
    assert not hasattr(adapter.VllmPrefixCachingManager, "fork")


# -- the sliding window ---------------------------------------------------------------------------


def test_slid_out_entries_are_the_null_block_dropped_at_the_next_allocation() -> None:
    """vLLM's window is the next token's: ``get_num_skipped_tokens(c) = c - W + 1``, applied when the request
    next allocates.  An admission keeps the whole prompt; one token more drops what left."""
    windows = adapter.VllmSlidingWindowManager(BlockPool(8, "lru"), 2, 4)
    windows.add_sequence(0, 9)
    assert windows.block_table(0) == (0, 1, 2, 3, 4)
    windows.append(0, 1)
    assert windows.block_table(0) == (None, None, None, 3, 4)
    assert windows.snapshot().pool.refcounts[:3] == (0, 0, 0)


def test_a_refused_append_has_already_released_what_slid_out() -> None:
    """``allocate_slots`` runs ``remove_skipped_blocks`` before it checks for room ("We can do this even if
    we cannot schedule this request"): declared (``release="at_next_allocation"``), the release is left out of
    what a refusal must leave as it was, and the model's refused call does the same."""
    windows = adapter.VllmSlidingWindowManager(BlockPool(1, "lru"), 1, 1)
    windows.add_sequence(0, 1)
    before = windows.snapshot()
    with pytest.raises(OutOfBlocks):
        windows.append(0, 2)
    after = windows.snapshot()
    assert windows.block_table(0) == (None,) and after.pool.num_free == 1
    declared = adapter.SLIDING_CONVENTIONS.window
    assert sliding_window.refusal_view(before, declared) == sliding_window.refusal_view(after, declared)
    # no token to come reads a slid-out block: under any convention a refusal may release it (never a safety
    # finding); releasing it undeclared parts the implementation from the model (a refinement finding)
    assert after.pool.free_queue == (0,) and sliding_window.refusal_view(before, WindowConventions()) == after
    spec = sliding_window.new_windows(1, 1, block_pool.new_pool(1, "lru", adapter.CONVENTIONS.pool), declared)
    spec = sliding_window.add_sequence(spec, 0, 1)
    with pytest.raises(OutOfBlocks):
        sliding_window.append(spec, 0, 2)
    assert sliding_window.abstract(sliding_window.after_refusal(spec, 0)) == after


def test_the_next_tokens_window_is_released_at_the_next_allocation() -> None:
    """W = 3 in blocks of 2: each append first releases what left the window of the next token at the tokens
    computed so far.  Judged on the caller's record, the declared window rule holds at every step."""
    windows = adapter.VllmSlidingWindowManager(BlockPool(6, "lru"), 2, 3)
    declared = adapter.SLIDING_CONVENTIONS.window

    def slid_out(tokens: int, before_last_write: int) -> tuple[bool, ...]:
        """Which entries hold no block, once the declared rule is checked on the caller's record."""
        record = {0: sliding_window.Written(tokens, before_last_write)}
        assert sliding_window.invariant_window_blocks_exact(windows.snapshot(), declared, record) is None
        return tuple(block is None for block in windows.block_table(0))

    windows.add_sequence(0, 5)
    assert slid_out(5, 0) == (False, False, False)  # the whole prompt, until the next step
    windows.append(0, 1)
    assert slid_out(6, 5) == (True, False, False)  # tokens 0-1 had left the window of token 5
    windows.append(0, 2)
    assert slid_out(8, 6) == (True, True, False, False)
    with pytest.raises(OutOfBlocks):
        windows.append(0, 11)
    assert slid_out(8, 6) == (True, True, True, False)  # released, though the append was refused


# -- the hybrid: kvspec's safety rules on both groups -----------------------------------------------

OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "append", "free"]),
        st.integers(0, 3),  # the sequence
        st.lists(st.integers(0, 2), min_size=1, max_size=6),  # tokens
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(4, 12), block_size=st.integers(1, 3), window=st.integers(1, 6), operations=OPERATIONS)
def test_hybrid_keeps_every_safety_rule(
    capacity: int, block_size: int, window: int, operations: list[tuple[str, int, list[int]]]
) -> None:
    manager = adapter.VllmHybridManager(capacity, block_size, window)
    for operation, seq, tokens in operations:
        live = seq in manager.sequences()
        try:
            if operation == "admit" and not live:
                manager.add_sequence(seq, tokens)
            elif operation == "append" and live:
                manager.append(seq, tokens)
            elif operation == "free" and live:
                manager.free(seq)
        except OutOfBlocks:
            pass
        check_hybrid(manager)


def check_hybrid(manager: adapter.VllmHybridManager) -> None:
    """The pool's rules with both groups' entries as holders; the full group reads back every token, the
    sliding group every token of the next token's window."""
    tables = {seq: manager.tables(seq) for seq in manager.sequences()}
    holders = Counter(b for full, sliding in tables.values() for b in (*full, *sliding) if b is not None)
    pool = manager.pool()
    for rule, arguments in block_pool.STATE.evaluations(pool, holders):
        assert rule(*arguments) is None, f"{rule.name}: {rule(*arguments)}"
    for seq in tables:
        tokens = manager.tokens(seq)
        assert manager.read(seq, 0, range(len(tokens))) == tokens, f"{seq}: the full group reads back other tokens"
        window = range(max(0, len(tokens) - manager.window + 1), len(tokens))
        expected = tuple(tokens[p] for p in window)
        assert manager.read(seq, 1, window) == expected, f"{seq}: the window of its next token is not held"
