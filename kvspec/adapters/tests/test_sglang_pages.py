"""SGLang's RadixCache over its real PagedTokenToKVPoolAllocator (``kvspec.adapters.sglang_pages``).

Skipped unless SGLang imports.  Pins what the adapter maps (page 0 reserved, the release
sequence, SGLang's own ``check_memory`` rule after each call), the engine behaviour its
verdict reports, and safety at page sizes 1, 4 and 16 in both variants.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

pytest.importorskip("sglang", reason="SGLang is not installed (kvspec/adapters/install-engines.sh)")

from kvspec.adapters import sglang_pages  # noqa: E402  (after the skip: it imports the engine lazily, but needs it)
from kvspec.properties.harness import LockstepMachine  # noqa: E402
from kvspec.properties.running import run_machine  # noqa: E402
from kvspec.properties.test_radix_pages import RadixPagesMachine  # noqa: E402
from kvspec.spec import radix_pages  # noqa: E402
from kvspec.spec.errors import OutOfBlocks  # noqa: E402
from kvspec.spec.invariants import invariant_result_matches_spec, invariant_verdict_matches_spec  # noqa: E402

FACTORIES = {"replayed": sglang_pages.factory, "thin": sglang_pages.thin_factory}


def manager(variant: str, num_pages: int, page_size: int) -> Any:
    return FACTORIES[variant]().component("radix_page_manager")(num_pages, page_size)


def check_memory(pages: Any) -> None:
    """SGLang's own rule (``Scheduler.check_memory``), over the engine's numbers: nothing counted twice or lost."""
    state = pages.snapshot()
    assert (
        radix_pages.invariant_pages_conserved(
            state, pages.evictable_size(), pages.protected_size(), pages.available_size()
        )
        is None
    )
    assert radix_pages.invariant_pages_single_owner(state) is None


@pytest.mark.parametrize("variant", FACTORIES)
def test_page_zero_is_reserved_and_hidden(variant: str) -> None:
    pages = manager(variant, 3, 2)
    assert sorted(pages.allocator.get_all_free_pages().tolist()) == [1, 2, 3]  # the engine's numbers
    assert pages.admit(1, [5, 6, 7]) == 0
    assert pages.snapshot().requests[1].slots == (0, 1, 2)  # kvspec page p is engine page p + 1
    assert pages.snapshot().free == frozenset({2})
    check_memory(pages)


@pytest.mark.parametrize("variant", FACTORIES)
def test_release_caches_whole_pages_and_frees_duplicates_and_the_partial_page(variant: str) -> None:
    pages = manager(variant, 6, 2)
    pages.admit(1, [1, 2, 3, 4, 5])
    pages.admit(2, [1, 2, 3, 4, 9])  # nothing cached yet: its own pages
    pages.release(1, True)  # pages of [1, 2] and [3, 4] cached, the partial [5] freed
    check_memory(pages)
    pages.release(2, True)  # its [1, 2] and [3, 4] are duplicates: freed, and so is [9]
    check_memory(pages)
    state = pages.snapshot()
    assert len(state.cache.values) == 4 and len(state.free) == 4
    assert pages.admit(3, [1, 2, 3, 4, 8]) == 4
    check_memory(pages)


@pytest.mark.parametrize("variant", FACTORIES)
def test_freed_pages_are_handed_out_before_lower_free_ones(variant: str) -> None:
    """``need_sort=False`` (a server outside disaggregation): ``free`` prepends the pages it frees, as both
    variants declare (``page_reuse="last_freed_first"``); the reference hands out the lowest free page."""
    pages = manager(variant, 5, 2)
    pages.admit(1, [1, 2])
    pages.admit(2, [3, 4])
    pages.release(1, False)
    pages.release(2, False)
    pages.admit(3, [5, 6])
    assert pages.snapshot().requests[3].slots == (2, 3)  # page 1, freed last; the reference takes page 0
    assert FACTORIES[variant]().conventions.radix.page_reuse == "last_freed_first"


def test_the_model_of_last_freed_first_follows_the_engine_through_evictions() -> None:
    """The shrunk sequence of the replayed variant's verdict before it declared ``last_freed_first``: the leaf
    evicted at the end holds pages 4 and 3 in the engine (answered 7, 6, 9, 8) where the lowest-first model had
    given it pages 3 and 4 (9, 8, 7, 6).  Under the declared convention the model follows the engine all the way."""
    calls: list[tuple[Any, ...]] = [
        ("admit", 2, (1, 4, 7, 0, 3, 6, 9)),
        ("release", 2, True),
        ("admit", 3, (0,) * 12),
        ("admit", 4, (0,) * 10),
        ("release", 4, True),
        ("admit", 1, (1, 4, 7, 0, 3, 6, 9)),
        ("decode", 1, 8),
        ("release", 1, True),
        ("admit", 5, (1, 4, 7, 0, 3, 6, 9)),
        ("decode", 5, 6),
        ("release", 5, True),
        ("admit", 6, (1, 4, 7, 0, 3, 6, 9, 0, 0)),
        ("decode", 6, 9),
        ("release", 6, True),
    ]
    pages, spec = manager("replayed", 5, 2), radix_pages.new_pages(5, 2, sglang_pages.page_manager_conventions().radix)
    for operation, *args in calls:
        answer = getattr(pages, operation)(*args)
        result = getattr(radix_pages, operation)(spec, *args)
        spec, expected = result if isinstance(result, tuple) else (result, None)
        assert (answer, pages.snapshot()) == (expected, radix_pages.abstract(spec)), (operation, args)
    assert pages.evict(1) == radix_pages.evict(spec, 1)[1] == (7, 6, 9, 8)


def test_the_thin_variant_matches_one_token_short_of_a_cached_prompt() -> None:
    """``Req.init_next_round_input`` matches at most ``len - 1`` tokens; the replayed match takes every whole page."""
    for variant, hit in (("replayed", 4), ("thin", 2)):
        pages = manager(variant, 6, 2)
        pages.admit(1, [1, 2, 3, 4])
        pages.release(1, True)
        assert pages.admit(2, [1, 2, 3, 4]) == hit


def test_the_thin_variant_evicts_a_cached_page_for_a_decode_that_needs_none() -> None:
    """``alloc_paged_token_slots_decode`` evicts a page per request whenever fewer are free ("over estimate ...:
    assume each request needs a new page"), even when the decode fills the request's partial page."""
    for variant, cached_after in (("replayed", 2), ("thin", 0)):
        pages = manager(variant, 3, 2)
        pages.admit(1, [1, 2, 3])
        pages.release(1, True)  # [1, 2] cached, the partial page freed
        pages.admit(2, [5, 6, 7])  # the two free pages: none left
        pages.decode(2, 8)  # into its partial page
        assert len(pages.snapshot().cache.values) == cached_after


def test_alloc_decode_at_page_size_1_hands_out_a_slot_it_never_took() -> None:
    """SGLang 0.5.23: ``PagedTokenToKVPoolAllocator.alloc_decode`` counts new pages as ``seq_len % page_size == 1``,
    never true at page size 1, and answers ``last_loc + 1`` without taking it off the free list.  The scheduler
    never calls it at page size 1 (``alloc_for_decode`` uses ``alloc_token_slots``); the adapter does as it does."""
    engine = sglang_pages.engine()
    torch = engine.torch
    allocator = engine.PagedTokenToKVPoolAllocator(
        size=4, page_size=1, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False
    )
    first = allocator.alloc(1)  # slot 1
    decoded = allocator.alloc_decode(torch.tensor([2]), torch.tensor([2]), first)
    assert decoded.tolist() == [2] and 2 in allocator.get_all_free_pages().tolist()  # still free
    assert allocator.alloc(1).tolist() == [2]  # handed out a second time


@pytest.mark.parametrize("variant", FACTORIES)
def test_decode_without_a_page_is_out_of_blocks_and_changes_nothing(variant: str) -> None:
    pages = manager(variant, 2, 2)
    pages.admit(1, [1, 2, 3, 4])
    before = pages.snapshot()
    with pytest.raises(OutOfBlocks):
        pages.decode(1, 5)
    assert pages.snapshot() == before


def pinned(page_size: int) -> type[LockstepMachine]:
    """The radix-pages machine at one page size (its own draws 2, 3 and 4)."""

    class RadixPagesAtOnePageSize(RadixPagesMachine):
        @initialize(num_pages=st.integers(5, 10))
        def start(self, num_pages: int) -> None:
            RadixPagesMachine.start(self, page_size, num_pages)

    return RadixPagesAtOnePageSize


KNOWN = frozenset(
    {radix_pages.invariant_pages_refine_spec, invariant_result_matches_spec, invariant_verdict_matches_spec}
)
"""The convention rules the thin variant's verdict breaks (its match one token short, its eviction ahead of need):
examples past them go on checking safety alone."""


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("variant", FACTORIES)
def test_safety_holds_at_page_size(variant: str, page_size: int) -> None:
    """Every safety rule of the radix-pages machine, at the page sizes the machine itself does not draw."""
    budget = settings(max_examples=25, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
    outcome = run_machine(pinned(page_size), FACTORIES[variant](), budget, known=KNOWN)
    assert not [f for f in outcome.findings if f.tier == "safety"], outcome.findings
    checked = outcome.statistics.checks + outcome.statistics.checks_after_known
    assert checked[radix_pages.invariant_pages_conserved] > 100  # checked, not vacuous
