"""What an implementation under test declares: one record of everything it offers.

Rules:

* An implementation is named by ``module:factory``; the factory takes no
  arguments and returns an ``Implementation``.  ``pytest --kv-impl=...``,
  ``KVSPEC_IMPL=...`` and ``kvspec check --impl ...`` all take that form.
* The record declares, in one place: each component the implementation
  brings (an ``Offer`` from ``kvspec.spec.components``: the factory, the
  optional operations it supports, the operations its adapter emulates), its
  conventions (``kvspec.spec.conventions``), and whether it trusts its caller
  (``conventions.trusts_caller``).  A bare factory is an offer of none of the
  optional operations.  Each component is named by its kind's name
  (``block_pool=...``); a component of a third party's layer the same way,
  by the name of the kind its spec module declares.
* Every component is optional; one left out is *borrowed* from the
  reference implementation and run on top of this implementation's own
  components -- so an allocator alone (``block_pool(capacity, policy)``
  returning a ``kvspec.spec.block_pool.BlockPool``) is enough to run every
  machine that builds a pool, and a radix cache alone runs the radix machines.
* A verdict counts only the machines that call at least one component the
  implementation brought: what a machine learns of borrowed components alone
  is the reference's verdict, not this implementation's.  What the
  implementation does not offer is "not offered", never a violation.
* ``validate()`` refuses an unusable record in one line (a
  ``DeclarationError``): no component at all, a component that is not a
  factory, a class without its protocol's methods, an unknown operation.
* Each factory's call is documented beside its protocol, in the spec module of
  its layer (``component_kind``): ``block_pool(capacity, policy)``,
  ``block_manager(pool, block_size)``, ``prefix_caching_manager(pool,
  block_size, commit=)``, ``radix_cache()``, ``radix_page_manager(num_pages,
  page_size)``, ``scheduler(gpu, cpu, config)``, ``paged_kv_cache(manager,
  shape)`` and layer 5's yardsticks, ``contiguous_allocator(capacity,
  placement)``, ``kv_store(nodes, capacities, policies)``,
  ``sliding_window_manager(pool, block_size, window)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvspec.spec import (  # noqa: F401  (each declares its component kind, or optional operations, on import)
    batch_pool,
    block_manager,
    block_pool,
    contiguous,
    hierarchical_radix,
    kv_store,
    kv_store_placement,
    kv_transfer,
    paged_attention,
    prefix_cache,
    radix_cache,
    radix_pages,
    scheduler,
    scheduler_v1,
    sliding_window,
    speculative,
    swap,
    tiered_swap,
)
from kvspec.spec.block_manager import BlockManager
from kvspec.spec.block_pool import BlockPool, Policy
from kvspec.spec.components import DeclarationError, Offer, Operation, as_offer, check_offer
from kvspec.spec.contiguous import ContiguousAllocator, Placement
from kvspec.spec.conventions import REFERENCE, Conventions
from kvspec.spec.invariants import REGISTRY, Invariant
from kvspec.spec.kv_store import KVStore
from kvspec.spec.paged_attention import KVShape, PagedKVCache, SequenceCache
from kvspec.spec.prefix_cache import PrefixCachingManager
from kvspec.spec.radix_cache import RadixCache
from kvspec.spec.radix_pages import RadixPageManager
from kvspec.spec.scheduler import Scheduler, SchedulerConfig
from kvspec.spec.sliding_window import WindowManager

AnyOffer = Offer[..., Any]


def named_offers(components: Mapping[str, object]) -> Mapping[str, AnyOffer]:
    """Each component as an ``Offer`` that knows its kind (for its messages and checks); None: left out."""
    offers = {kind: as_offer(value) for kind, value in components.items()}
    return {kind: attrs.evolve(offer, kind=kind) for kind, offer in offers.items() if offer is not None}


@attrs.frozen(init=False)
class Implementation:
    """Everything an implementation offers: one offer per component kind it brings, by the kind's name.

    ``Implementation(name="mine", block_pool=MyPool, conventions=...)`` names each component by its kind's
    keyword (a kind of a third party's layer the same way); one left out is borrowed from the reference
    (``complete_with``).  A machine reaches a component of kvspec's layers by its kind's name, typed by its
    factory's call and the protocol it builds (``implementation.block_pool(capacity, policy)``), and one of
    any layer with ``component(kind)``.
    """

    name: str
    components: Mapping[str, AnyOffer] = attrs.field(factory=dict, converter=named_offers)  # kind -> offer
    conventions: Conventions = REFERENCE  # see spec.conventions: the engine's legitimate choices
    borrowed: frozenset[str] = frozenset()  # the components complete_with took from the reference

    def __init__(
        self,
        name: str,
        conventions: Conventions = REFERENCE,
        *,
        components: Mapping[str, object] | None = None,
        borrowed: frozenset[str] = frozenset(),
        **offered: object,
    ) -> None:
        self.__attrs_init__(name, {**(components or {}), **offered}, conventions, borrowed)

    # -- kvspec's layers' components, typed (a record completed from the reference holds every one) --------

    @property
    def block_pool(self) -> Offer[[int, Policy], BlockPool]:
        return self.component("block_pool")

    @property
    def block_manager(self) -> Offer[[BlockPool, int], BlockManager]:
        return self.component("block_manager")

    @property
    def prefix_caching_manager(self) -> Offer[..., PrefixCachingManager]:  # (pool, block_size, commit="on_fill")
        return self.component("prefix_caching_manager")

    @property
    def radix_cache(self) -> Offer[[], RadixCache]:
        return self.component("radix_cache")

    @property
    def scheduler(self) -> Offer[[BlockManager, BlockManager, SchedulerConfig], Scheduler]:
        return self.component("scheduler")

    @property
    def paged_kv_cache(self) -> Offer[[BlockManager, KVShape], PagedKVCache]:
        return self.component("paged_kv_cache")

    @property
    def tiny_model(self) -> AnyOffer:  # tiny_model(**sizes): a model with ``config`` and ``forward``
        return self.component("tiny_model")

    @property
    def contiguous_kv_cache(self) -> Offer[[KVShape], SequenceCache]:
        return self.component("contiguous_kv_cache")

    @property
    def decode_attention(self) -> AnyOffer:  # a kernel function (see spec.paged_attention)
        return self.component("decode_attention")

    @property
    def contiguous_allocator(self) -> Offer[[int, Placement], ContiguousAllocator]:
        return self.component("contiguous_allocator")

    @property
    def kv_store(self) -> Offer[..., KVStore]:  # (nodes, capacities, policies)
        return self.component("kv_store")

    @property
    def sliding_window_manager(self) -> Offer[[BlockPool, int, int], WindowManager]:
        return self.component("sliding_window_manager")

    @property
    def radix_page_manager(self) -> Offer[[int, int], RadixPageManager]:
        return self.component("radix_page_manager")

    def component(self, kind: str) -> AnyOffer:
        """The offer of the kind named ``kind``."""
        offer = self.components.get(kind)
        if offer is None:
            raise DeclarationError(f"{self.name} offers no {kind}")
        return offer

    def offers_operation(self, kind: str, operation: Operation) -> bool:
        """Whether the component of ``kind`` in use (own or borrowed) offers the optional ``operation``."""
        offer = self.components.get(kind)
        return offer is not None and operation in offer.operations

    def rules_not_offered(self) -> frozenset[Invariant]:
        """The rules no machine reaches against this implementation: no component of a kind that may offer one
        of the operations each needs offers it."""
        return frozenset(
            rule
            for rule in REGISTRY.values()
            if rule.needs and not any(self.offers_operation(kind, need) for need in rule.needs for kind in need.kinds)
        )

    def complete_with(self, reference: Implementation) -> Implementation:
        """Fill every component this implementation leaves out from ``reference``."""
        filled = {kind: offer for kind, offer in reference.components.items() if kind not in self.components}
        return attrs.evolve(self, components={**self.components, **filled}, borrowed=self.borrowed | frozenset(filled))

    def own_components(self) -> frozenset[str]:
        """The components this implementation brought itself."""
        return frozenset(self.components) - self.borrowed

    def without_borrowed(self) -> Implementation:
        """Only what this implementation brought: what a verdict judges it on."""
        own = {kind: offer for kind, offer in self.components.items() if kind not in self.borrowed}
        return attrs.evolve(self, components=own, borrowed=frozenset())

    def validate(self) -> Implementation:
        """This record, if usable; else a one-line ``DeclarationError``."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise DeclarationError(f"the implementation's name must be a non-empty string, not {self.name!r}")
        if not isinstance(self.conventions, Conventions):
            raise DeclarationError(f"conventions must be a spec.conventions.Conventions, not {self.conventions!r}")
        if not self.own_components():
            raise DeclarationError(f"{self.name} declares no component: nothing of it could be checked")
        for kind, offer in self.components.items():
            check_offer(kind, offer)
        return self
