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
  optional operations.  Layers of third parties come in ``extensions``,
  keyed by the name of the component kind their spec module declares.
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
from kvspec.spec.components import KINDS, DeclarationError, Offer, Operation, as_offer, check_offer
from kvspec.spec.contiguous import ContiguousAllocator, Placement
from kvspec.spec.conventions import Conventions
from kvspec.spec.invariants import REGISTRY, Invariant
from kvspec.spec.kv_store import KVStore
from kvspec.spec.paged_attention import KVShape, PagedKVCache, SequenceCache
from kvspec.spec.prefix_cache import PrefixCachingManager
from kvspec.spec.radix_cache import RadixCache
from kvspec.spec.radix_pages import RadixPageManager
from kvspec.spec.scheduler import Scheduler, SchedulerConfig
from kvspec.spec.sliding_window import WindowManager

AnyOffer = Offer[..., Any]


def as_extensions(value: Mapping[str, object]) -> Mapping[str, AnyOffer]:
    return {kind: offer for kind, offer in ((k, as_offer(v)) for k, v in value.items()) if offer is not None}


@attrs.frozen
class Implementation:
    """Everything an implementation offers; a component left ``None`` is borrowed from the reference.

    Each component's type is the offer a complete record holds -- its factory's call and the protocol it
    builds -- which is what a machine sees: machines run only records completed from the reference.
    """

    name: str
    block_pool: Offer[[int, Policy], BlockPool] = attrs.field(default=None, converter=as_offer)
    conventions: Conventions = Conventions()  # see spec.conventions: the engine's legitimate choices
    block_manager: Offer[[BlockPool, int], BlockManager] = attrs.field(default=None, converter=as_offer)
    # prefix_caching_manager(pool, block_size, commit="on_fill"):
    prefix_caching_manager: Offer[..., PrefixCachingManager] = attrs.field(default=None, converter=as_offer)
    radix_cache: Offer[[], RadixCache] = attrs.field(default=None, converter=as_offer)
    scheduler: Offer[[BlockManager, BlockManager, SchedulerConfig], Scheduler] = attrs.field(
        default=None, converter=as_offer
    )
    paged_kv_cache: Offer[[BlockManager, KVShape], PagedKVCache] = attrs.field(default=None, converter=as_offer)
    # Layer 5's yardstick and kernels (see spec.paged_attention); a user normally leaves them to the reference.
    # tiny_model(**sizes) builds a model with ``config`` and ``forward``; decode_attention is a kernel function:
    tiny_model: AnyOffer = attrs.field(default=None, converter=as_offer)
    contiguous_kv_cache: Offer[[KVShape], SequenceCache] = attrs.field(default=None, converter=as_offer)
    decode_attention: AnyOffer = attrs.field(default=None, converter=as_offer)
    contiguous_allocator: Offer[[int, Placement], ContiguousAllocator] = attrs.field(default=None, converter=as_offer)
    kv_store: Offer[..., KVStore] = attrs.field(default=None, converter=as_offer)  # (nodes, capacities, policies)
    sliding_window_manager: Offer[[BlockPool, int, int], WindowManager] = attrs.field(default=None, converter=as_offer)
    radix_page_manager: Offer[[int, int], RadixPageManager] = attrs.field(default=None, converter=as_offer)
    extensions: Mapping[str, AnyOffer] = attrs.field(factory=dict, converter=as_extensions)  # third parties' layers

    borrowed: frozenset[str] = frozenset()  # the components complete_with took from the reference

    def __attrs_post_init__(self) -> None:
        for kind, offer in self.offers().items():  # an offer knows its kind, for its messages and checks
            if offer.kind != kind:
                named = attrs.evolve(offer, kind=kind)
                if kind in self.extensions:
                    self.extensions[kind] = named  # type: ignore[index]  # our own dict, built by as_extensions
                else:
                    object.__setattr__(self, kind, named)

    def offers(self) -> dict[str, AnyOffer]:
        """Every component this record holds (its own and borrowed), by kind."""
        named = {field.name: getattr(self, field.name) for field in attrs.fields(Implementation)}
        own = {kind: offer for kind, offer in named.items() if isinstance(offer, Offer)}
        return {**own, **self.extensions}

    def component(self, kind: str) -> AnyOffer:
        """The offer of ``kind``; a machine of a third party's layer reaches its component this way."""
        offer = self.offers().get(kind)
        if offer is None:
            raise DeclarationError(f"{self.name} offers no {kind}")
        return offer

    def offers_operation(self, kind: str, operation: Operation) -> bool:
        """Whether the component of ``kind`` in use (own or borrowed) offers the optional ``operation``."""
        offer = self.offers().get(kind)
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
        filled: dict[str, Any] = {
            kind: offer
            for kind, offer in reference.offers().items()
            if kind not in self.offers() and kind not in reference.extensions
        }
        return attrs.evolve(self, borrowed=self.borrowed | frozenset(filled), **filled)

    def own_components(self) -> frozenset[str]:
        """The components this implementation brought itself."""
        return frozenset(self.offers()) - self.borrowed

    def validate(self) -> Implementation:
        """This record, if usable; else a one-line ``DeclarationError``."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise DeclarationError(f"the implementation's name must be a non-empty string, not {self.name!r}")
        if not isinstance(self.conventions, Conventions):
            raise DeclarationError(f"conventions must be a spec.conventions.Conventions, not {self.conventions!r}")
        offers = self.offers()
        if not set(offers) - self.borrowed:
            raise DeclarationError(f"{self.name} declares no component: nothing of it could be checked")
        for kind, offer in offers.items():
            check_offer(kind, offer)
        return self


def declared_kinds() -> tuple[str, ...]:
    """The component kinds kvspec's own layers declare (an ``Implementation`` field each)."""
    return tuple(field.name for field in attrs.fields(Implementation) if field.name in KINDS)
