"""What an implementation under test hands the conformance suite.

Rules:

* An implementation is named by ``module:factory``; the factory takes no
  arguments and returns an ``Implementation``.  ``pytest --kv-impl=...``,
  ``KVSPEC_IMPL=...`` and ``kvspec check --impl ...`` all take that form.
* Every component is optional; one left as ``None`` is *borrowed* from the
  reference implementation and run on top of this implementation's own
  components -- so an alternative allocator alone (``block_pool(capacity,
  policy)`` returning a ``kvspec.spec.block_pool.BlockPool``) is enough to
  run every machine, and a radix cache alone runs the radix machines.
* A verdict counts only the machines that call at least one component the
  implementation brought: what a machine learns of borrowed components alone
  is the reference's verdict, not this implementation's.
* ``block_manager(pool, block_size)`` returns a ``kvspec.spec.block_manager.BlockManager``.
* Later layers add their own factories here, each documented in the spec
  module that defines its protocol (layer 5's ``paged_kv_cache``,
  ``tiny_model``, ``contiguous_kv_cache`` and ``decode_attention``: in
  ``kvspec.spec.paged_attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvspec.spec.block_manager import BlockManager
from kvspec.spec.block_pool import BlockPool, Policy
from kvspec.spec.conventions import Conventions


@attrs.frozen
class Implementation:
    """Factories for each layer; ``None`` means "use the reference's on top of my pool"."""

    name: str
    block_pool: Callable[[int, Policy], BlockPool] | None = None
    conventions: Conventions = Conventions()  # see spec.conventions: the engine's legitimate choices
    block_manager: Callable[[BlockPool, int], BlockManager] | None = None
    prefix_caching_manager: Callable[..., Any] | None = None  # see spec.prefix_cache
    radix_cache: Callable[..., Any] | None = None  # see spec.radix_cache
    scheduler: Callable[..., Any] | None = None  # see spec.scheduler
    paged_kv_cache: Callable[..., Any] | None = None  # see spec.paged_attention
    # Layer 5's yardstick and kernels (see spec.paged_attention); a user normally leaves them to the reference:
    tiny_model: Callable[..., Any] | None = None  # tiny_model(**sizes): the model whose logits are compared
    contiguous_kv_cache: Callable[..., Any] | None = None  # contiguous_kv_cache(shape): the contiguous twin
    decode_attention: Callable[..., Any] | None = None  # the batched decode kernel over block tables
    contiguous_allocator: Callable[..., Any] | None = (
        None  # contiguous_allocator(capacity, placement): see spec.contiguous
    )
    kv_store: Callable[..., Any] | None = None  # kv_store(nodes, capacities, policies): see spec.kv_store
    sliding_window_manager: Callable[..., Any] | None = None  # (pool, block_size, window): see spec.sliding_window
    radix_page_manager: Callable[..., Any] | None = None  # (num_pages, page_size): see spec.radix_pages

    borrowed: frozenset[str] = frozenset()  # the components complete_with took from the reference

    def complete_with(self, reference: Implementation) -> Implementation:
        """Fill every component this implementation leaves out from ``reference``."""
        filled = {
            field.name: getattr(reference, field.name)
            for field in attrs.fields(Implementation)
            if getattr(self, field.name) is None
        }
        return attrs.evolve(self, borrowed=self.borrowed | frozenset(filled), **filled)

    def own_components(self) -> frozenset[str]:
        """The factories this implementation brought itself."""
        return frozenset(
            field.name
            for field in attrs.fields(Implementation)
            if callable(getattr(self, field.name)) and field.name not in self.borrowed
        )
