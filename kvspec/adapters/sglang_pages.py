"""kvspec's radix page manager over SGLang's ``RadixCache`` and its real ``PagedTokenToKVPoolAllocator``.

    kvspec check --impl kvspec.adapters.sglang_pages:factory --machine "radix pages"
    kvspec check --impl kvspec.adapters.sglang_pages:thin_factory --machine "radix pages"

Tested: SGLang 0.5.23.  The pool is SGLang's paged allocator (``device="cpu"``, no KV
tensors: ``kvcache=None``; ``need_sort=False``, what ``kv_cache_configurator`` passes outside
prefill/decode disaggregation), the tree is SGLang's ``RadixCache`` over it, both at the page
size the machine asks for.  Two variants:

* ``factory`` (``SglangPages``) replays the scheduler's calls on the two structures, as
  ``probes/sglang_radix_pages.py`` does -- the sequence SGLang ran as ``cache_finished_req``
  before 0.5 split it into ``RadixCache.checkpoint`` and ``common.release_kv_cache``:

  - ``admit(request, tokens)`` -> ``match_prefix``, ``inc_lock_ref`` on the node it returns
    (``PrefillAdder.add_one_req`` pins the prefix before it sizes the batch), the admission
    test, ``evict`` of what the free pages lack, ``alloc`` of whole pages; a refusal
    ``dec_lock_ref``\\ s again.
  - ``decode(request, token)`` -> ``evict`` of one page when the request needs a page and
    none is free, then ``alloc_decode`` (at page size 1 ``alloc(1)``, as ``alloc_for_decode``
    branches: ``alloc_decode`` counts new pages by ``seq_len % page_size == 1`` and at page
    size 1 answers ``last_loc + 1`` without taking it off the free list); ``None`` from
    either is ``OutOfBlocks``.
  - ``release(request, keep)`` -> with ``keep``: ``insert`` of the whole pages, ``free`` of
    the duplicates it exposed (``[cached, prefix_len)``) and of the partial last page;
    without (abort, ``retract_decode``): ``free`` of everything past the cached prefix;
    then ``dec_lock_ref``.

* ``thin_factory`` (``ThinSglangPages``) calls the scheduler's own functions on a real
  ``Req`` with a row in a real ``ReqToTokenPool``, and replays nothing past the admission
  test: ``Req.init_next_round_input`` (``match_kv_cache``: a match of at most ``len - 1``
  tokens, "to enable logprob computation"), ``tree.lock`` (``_commit_prefill_admission``),
  ``allocation.alloc_token_slots`` / ``alloc_paged_token_slots_extend`` and
  ``write_cache_indices`` (``alloc_for_extend``'s calls); ``check_decode_capacity`` with
  ``new_tokens_required_next_decode``'s count, then ``alloc_token_slots`` /
  ``alloc_paged_token_slots_decode`` (``check_decode_mem`` and ``alloc_for_decode``); and
  ``common.release_kv_cache(req, tree, checkpoint=keep)`` -- SGLang 0.5.23 has no
  ``cache_finished_req`` / ``cache_unfinished_req`` any more: ``release_kv_cache`` (and
  ``checkpoint_kv_cache``, which only chunked prefill calls) are them.  Each allocation
  function evicts for itself, as it does in the server.

Both: ``evict(n)`` -> ``evict(EvictParams(num_tokens=n))``, whose answer is the slots the
tree hands the allocator's ``free_segment``, leaf after leaf, each deepest slot first (the
adapter notes them on the way); the sizes are ``available_size``, ``evictable_size``,
``protected_size``; ``snapshot`` reads the allocator's free pages, the tree (as
``kvspec.adapters.sglang`` reads one) and each request's tokens and slots.

*Emulated* (the adapter's, not one engine call): the admission test -- free + evictable
pages against the pages the tail needs, ``PrefillAdder``'s budget stripped of its reserves
for tokens not yet generated -- in both variants; the replay variant's ``decode`` and
``release``, and the thin variant's ``decode`` (a gate and an allocation).  The request
ledger is the scheduler's (its ``Req`` objects): an admission of a running request, or a
call on one that is not running, is refused by it, with ``InvalidOperation``.

Numbering: the allocator never hands out page 0 ("the padded slot 0 is used for writing
dummy outputs", ``PagedTokenToKVPoolAllocator.clear``), so its pages are ``1 .. num_pages``;
kvspec page ``p`` is engine page ``p + 1`` and kvspec slot ``s`` engine slot ``s +
page_size``.  A slot's ``contents`` are the adapter's record: with ``kvcache=None`` the engine
holds no KV, and a forward pass would write exactly the slots the engine handed out.

Conventions: the radix tree's, as ``kvspec.adapters.sglang`` declares them (whole-leaf
eviction, recency per node, locks by handle, extra keys as namespaces), at the machine's
page size; ``trusts_caller=True`` as there (``evict`` of a negative count is a no-op, an
empty prompt is admitted); and the allocator's ``page_reuse="last_freed_first"``:
``alloc`` takes the pages at the front of ``free_pages``, and with ``need_sort=False``
``_release_page_ids`` puts the pages each ``free`` frees (``torch.unique``: lowest first)
and each evicted leaf's ``free_segment`` frees (its tokens' order) at the front, so the
page freed last is reused first.  The order among leaves SGLang's ``evict`` heap pops is
the model's (``spec.radix_conventions``): a heap over the evictable leaves keyed by
``last_access_time``, ties left to ``TreeNode.__lt__``, which finds neither first -- and no
two leaves share a stamp, every walk stamping one path and each new leaf stamped after
it.  Where SGLang differs from ``spec.radix_pages`` with no convention to declare it --
in the thin variant the match one token short of a fully cached prompt, eviction ahead of
need, and the leaf split at the prompt boundary -- the verdict shows it under the
convention tier (``invariant_pages_refine_spec``).
"""

from __future__ import annotations

import functools
import types
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvspec.adapters.sglang import SglangRadixCache, conventions, engine_version, stand_in_for_torchvision
from kvspec.spec.block_manager import blocks_for
from kvspec.spec.components import Offer
from kvspec.spec.conventions import Conventions
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.radix_cache import RadixState
from kvspec.spec.radix_pages import NEVER_WRITTEN, Held, PagesState, RequestId

VERSION = "0.5.23"
MAX_RUNNING = 64  # rows of the thin variant's ReqToTokenPool: more requests than a machine runs at once


@functools.cache
def engine() -> types.SimpleNamespace:
    """SGLang's paged allocator, radix cache and the scheduler's cache functions."""
    stand_in_for_torchvision()
    import torch
    from sglang.srt.mem_cache import allocation, common
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    return types.SimpleNamespace(
        torch=torch,
        allocation=allocation,
        common=common,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        CacheInitParams=CacheInitParams,
        RadixCache=RadixCache,
        RadixKey=RadixKey,
        EvictParams=EvictParams,
        InsertParams=InsertParams,
        MatchPrefixParams=MatchPrefixParams,
        ReqToTokenPool=ReqToTokenPool,
    )


@functools.cache
def scheduler_side() -> types.SimpleNamespace:
    """The scheduler's ``Req`` and sampling parameters, with SGLang's process-wide server arguments published.

    ``release_kv_cache`` reads two of them (``get_serving().strip_thinking_cache``,
    ``get_spec().speculative_algorithm``); a plain server's defaults are published unless some are already.
    """
    engine()
    from sglang.srt import runtime_context
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    context = runtime_context.get_context()
    if not context.is_config_namespace_published("serving"):
        context.set_server_args(ServerArgs(model_path="kvspec-no-model", device="cpu", skip_tokenizer_init=True))
    return types.SimpleNamespace(Req=Req, SamplingParams=SamplingParams)


class _TreeView(SglangRadixCache):
    """``kvspec.adapters.sglang``'s reading of a tree (``snapshot``), over a tree built here."""

    def __init__(self, tree: Any) -> None:  # no simulated tree of its own: the one given is the engine's
        self._sgl = engine()
        self.engine = tree


class SglangPages:
    """``spec.radix_pages.RadixPageManager`` over SGLang's tree and paged allocator, the scheduler's calls replayed."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self._sgl = sgl = engine()
        self.page_size = page_size
        self.allocator = sgl.PagedTokenToKVPoolAllocator(
            size=num_pages * page_size,
            page_size=page_size,
            dtype=sgl.torch.float16,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )
        self.tree = sgl.RadixCache(
            sgl.CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator, page_size=page_size
            )
        )
        self._view = _TreeView(self.tree)
        self._contents = [NEVER_WRITTEN] * (num_pages * page_size)
        self._requests: dict[RequestId, Any] = {}  # the scheduler's record of each running request
        self._evicted: list[int] | None = None  # the slots the tree frees while ``evict`` runs
        self._free_segment = self.allocator.free_segment
        self.allocator.free_segment = self._noted_free_segment

    # -- the scheduler's calls, replayed ------------------------------------------------------

    def admit(self, request_id: RequestId, tokens: Sequence[int]) -> int | None:
        self._new(request_id)
        node = self.tree.match_prefix(self._sgl.MatchPrefixParams(key=self._key(tokens))).last_device_node
        prefix = self._engine_slots(self.tree.path_device_indices(node))
        self.tree.inc_lock_ref(node)
        pages = blocks_for(len(tokens) - len(prefix), self.page_size)
        if not self._room(pages):
            self.tree.dec_lock_ref(node)
            return None
        short = pages * self.page_size - self.allocator.available_size()
        if short > 0:
            self.tree.evict(self._sgl.EvictParams(num_tokens=short))
        slots = prefix + self._engine_slots(self.allocator.alloc(pages * self.page_size))[: len(tokens) - len(prefix)]
        self._requests[request_id] = types.SimpleNamespace(
            tokens=list(tokens), slots=slots, node=node, cached=len(prefix)
        )
        self._write(slots[len(prefix) :], tokens[len(prefix) :])
        return len(prefix)

    def decode(self, request_id: RequestId, token: int) -> None:
        held, torch = self._running(request_id), self._sgl.torch
        if len(held.tokens) % self.page_size == 0 and self.allocator.available_size() < self.page_size:
            self.tree.evict(self._sgl.EvictParams(num_tokens=self.page_size))
        if self.page_size == 1:  # alloc_for_decode's branch: alloc_decode counts no new page at page size 1
            out = self.allocator.alloc(1)
        else:
            seq_lens = torch.tensor([len(held.tokens) + 1])
            out = self.allocator.alloc_decode(seq_lens, seq_lens, self._tensor(held.slots[-1:]))
        if out is None:
            raise OutOfBlocks(1, 0, "pages")
        (slot,) = self._engine_slots(out)
        held.tokens.append(token)
        held.slots.append(slot)
        self._write([slot], [token])

    def release(self, request_id: RequestId, keep: bool) -> None:
        held = self._running(request_id)
        del self._requests[request_id]
        whole = len(held.tokens) - len(held.tokens) % self.page_size
        if keep:
            key, value = self._key(held.tokens[:whole]), self._tensor(held.slots[:whole])
            inserted = self.tree.insert(self._sgl.InsertParams(key=key, value=value))
            self.allocator.free(self._tensor(held.slots[held.cached : inserted.prefix_len]))  # duplicates
            self.allocator.free(self._tensor(held.slots[whole:]))  # the partial last page
        else:
            self.allocator.free(self._tensor(held.slots[held.cached :]))
        self.tree.dec_lock_ref(held.node)

    # -- both variants ----------------------------------------------------------------------

    def evict(self, num_tokens: int) -> tuple[int, ...]:
        self._evicted = []
        try:
            self.tree.evict(self._sgl.EvictParams(num_tokens=num_tokens))
            return tuple(self._evicted)
        finally:
            self._evicted = None

    def available_size(self) -> int:
        return int(self.allocator.available_size())

    def evictable_size(self) -> int:
        return int(self.tree.evictable_size())

    def protected_size(self) -> int:
        return int(self.tree.protected_size())

    def snapshot(self) -> PagesState:
        tree = self._view.snapshot()
        values = {key: value - self.page_size for key, value in tree.values.items()}
        free = frozenset(int(page) - 1 for page in self.allocator.get_all_free_pages().tolist())
        requests = {rid: self._held(record) for rid, record in self._requests.items()}
        return PagesState(self.page_size, free, RadixState(values, dict(tree.locks)), requests, tuple(self._contents))

    def _held(self, record: Any) -> Held:
        return Held(tuple(record.tokens), tuple(record.slots), record.cached)

    # -- the scheduler's ledger and the engine's numbers -------------------------------------

    def _new(self, request_id: RequestId) -> None:
        if request_id in self._requests:
            raise InvalidOperation(f"request {request_id} is running already")

    def _running(self, request_id: RequestId) -> Any:
        held = self._requests.get(request_id)
        if held is None:
            raise InvalidOperation(f"request {request_id} is not running")
        return held

    def _room(self, pages: int) -> bool:
        """Enough free and evictable pages for ``pages`` more: the admission test, without reserves."""
        return pages * self.page_size <= self.allocator.available_size() + self.tree.evictable_size()

    def _key(self, tokens: Sequence[int]) -> Any:
        return self._sgl.RadixKey(array("q", tokens))

    def _tensor(self, slots: Sequence[int]) -> Any:
        """kvspec slots as the engine's index tensor."""
        return self._sgl.torch.tensor([slot + self.page_size for slot in slots], dtype=self._sgl.torch.int64)

    def _engine_slots(self, indices: Any) -> list[int]:
        """An engine index tensor as kvspec slots."""
        return [int(index) - self.page_size for index in indices.tolist()]

    def _noted_free_segment(self, free_index: Any, *, start_pos: int) -> None:
        """The allocator's own ``free_segment``; while ``evict`` runs, each leaf's slots are noted, deepest first."""
        if self._evicted is not None:
            self._evicted += reversed(self._engine_slots(free_index))
        self._free_segment(free_index, start_pos=start_pos)

    def _write(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        for slot, token in zip(slots, tokens, strict=True):
            self._contents[slot] = token


class ThinSglangPages(SglangPages):
    """The same structures under SGLang's own scheduler-side functions: a real ``Req`` in a real ``ReqToTokenPool``."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self._scheduler = scheduler_side()
        self.rows = self._sgl.ReqToTokenPool(
            size=MAX_RUNNING, max_context_len=num_pages * page_size + 1, device="cpu", enable_memory_saver=False
        )
        self.tree.req_to_token_pool = self.rows

    def admit(self, request_id: RequestId, tokens: Sequence[int]) -> int | None:
        self._new(request_id)
        allocation, torch = self._sgl.allocation, self._sgl.torch
        req = self._scheduler.Req(str(request_id), "", array("q", tokens), self._scheduler.SamplingParams())
        req.init_next_round_input(self.tree)
        req.lock = self.tree.lock(req.last_node)
        cached, extend = req.prefix_len, len(tokens) - req.prefix_len
        if not self._room(blocks_for(extend, self.page_size)):
            self.tree.unlock(req.lock)
            return None
        (row,) = self.rows.alloc([req])
        prefix = self.tree.prefix_device_indices(req)
        before, after, new = (torch.tensor([n]) for n in (cached, len(tokens), extend))
        if self.page_size == 1:
            out = allocation.alloc_token_slots(self.tree, extend)
        else:
            last = prefix[-1:] if cached else torch.tensor([-1])
            out = allocation.alloc_paged_token_slots_extend(self.tree, before, before, after, after, last, extend)
        rows = torch.tensor([row])
        allocation.write_cache_indices(out, rows, rows, before, before, after, after, new, new, [prefix], self.rows)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(tokens)
        self._requests[request_id] = req
        self._write(self._engine_slots(out), tokens[cached:])
        return cached

    def decode(self, request_id: RequestId, token: int) -> None:
        req, allocation, torch = self._running(request_id), self._sgl.allocation, self._sgl.torch
        length = req.kv.kv_committed_len
        needed = self.page_size if length % self.page_size == 0 else 0  # new_tokens_required_next_decode
        if not self.allocator.check_decode_capacity(num_tokens=needed, tree_cache=self.tree):
            raise OutOfBlocks(1, 0, "pages")
        if self.page_size == 1:
            out = allocation.alloc_token_slots(self.tree, 1)
        else:
            last = self.rows.req_to_token[req.kv.req_pool_idx, length - 1 : length].to(torch.int64)
            lengths = torch.tensor([length + 1])
            out = allocation.alloc_paged_token_slots_decode(self.tree, lengths, lengths, last)
        self.rows.write((req.kv.req_pool_idx, length), out.to(torch.int32))
        req.output_ids.append(token)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = length + 1
        self._write(self._engine_slots(out), [token])

    def release(self, request_id: RequestId, keep: bool) -> None:
        req = self._running(request_id)
        del self._requests[request_id]
        self._sgl.common.release_kv_cache(req, self.tree, checkpoint=keep)

    def _held(self, record: Any) -> Held:
        tokens = tuple(record.origin_input_ids) + tuple(record.output_ids)
        row = self.rows.req_to_token[record.kv.req_pool_idx, : len(tokens)]
        return Held(tokens, tuple(self._engine_slots(row)), record.kv.cache_protected_len)


def page_manager_conventions() -> Conventions:
    """The tree's conventions, and the paged allocator's: the page freed last is reused first."""
    tree = conventions()
    return attrs.evolve(tree, radix=attrs.evolve(tree.radix, page_reuse="last_freed_first"))


def implementation(
    manager: Callable[[int, int], Any], emulated: set[str], variant: str, side: Callable[[], object] = engine
) -> Callable[[], Implementation]:
    def factory() -> Implementation:
        side()  # fail here, with the engine's ImportError, when SGLang is not installed
        return Implementation(
            name=f"SGLang {engine_version()} RadixCache over PagedTokenToKVPoolAllocator ({variant})",
            radix_page_manager=Offer(manager, emulated=emulated),
            conventions=page_manager_conventions(),
        )

    return factory


factory = implementation(SglangPages, {"admit", "decode", "release"}, "the scheduler's calls replayed")
thin_factory = implementation(
    ThinSglangPages, {"admit", "decode"}, "SGLang's own allocation and release_kv_cache", scheduler_side
)
