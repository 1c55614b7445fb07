"""Conventions: the legitimate choices on which correct engines differ.

Rules:

* An implementation declares its conventions in ``Implementation.conventions``
  (default: the reference's).  The spec's models are parametrized by them, so
  an engine that chose differently from the reference is still checked by
  exact refinement -- against the model *of its own conventions*.
* A convention never weakens a safety rule: whichever way an engine chose,
  nothing leaks, nothing in use is reclaimed, and what is read back is what
  was written.
* ``trusts_caller`` declares that the engine does not validate out-of-contract
  calls (double free, unlock without lock, ...).  Its caller-contract findings
  are then reported in their own tier, and the machines stop generating those
  calls so that its safety rules are still exercised.

The fields, one per choice observed in vLLM v1 and SGLang:

* ``PoolConventions.unhashed_free_position`` -- where a freed block that
  carries no hash enters the free queue: the ``tail`` (reference: reused last)
  or the ``head`` (vLLM: reused first, keeping cached blocks longer).
* ``PoolConventions.duplicate_hash`` -- registering a second block under a
  hash already cached: ``refuse`` (reference: the map stays injective) or
  ``keep`` (vLLM: both blocks carry the hash, so block tables stay append-only).
* ``PoolConventions.policies`` -- the eviction policies the engine supports;
  machines draw only these.
* ``ManagerConventions.fork_partial_block`` -- what a fork does with the
  parent's partially filled last block: ``share`` it (reference, vLLM: the
  first write into it copies it) or ``copy`` it for the child at once (HF
  transformers: the child's table ends in a fresh block holding those slots).
* ``RadixConventions.eviction_granularity`` -- ``exact_tokens`` (reference:
  exactly ``min(asked, evictable)`` tokens) or ``whole_leaves`` (SGLang: whole
  unlocked leaves, at least ``min(asked, evictable)``).
* ``RadixConventions.recency`` -- ``per_token`` (reference) or ``per_node``
  (SGLang stamps the nodes a match or insert visits).
* ``RadixConventions.lock_by`` -- ``key`` (reference) or ``handle`` (SGLang
  locks the node a match returned; locking the root is a no-op).
* ``RadixConventions.page_size`` -- tokens per page; keys match in whole pages
  (reference: 1, though its cache is built for any page size).
* ``RadixConventions.extra_key_namespaces`` -- whether an extra key (adapter,
  tenant) separates otherwise equal keys (reference and SGLang: yes).
* ``RadixConventions.page_reuse`` -- which free page the radix page manager
  hands out next: the ``lowest_first`` (reference) or the ``last_freed_first``
  (SGLang's paged allocator, which puts the pages it frees at the front of its
  free list); see ``spec.radix_pages``.
* ``WindowConventions.slid_out`` -- what becomes of a block once every token
  in it has left the sliding window: ``dropped`` (reference, vLLM: released,
  its entry cleared) or ``ring`` (HF transformers: a sequence keeps
  ``ceil(min(L, W) / B)`` blocks while it lives and writes position ``p`` at
  ring slot ``p mod W``, over the token that slid out); see ``spec.sliding_window``.
* ``WindowConventions.window_of`` -- under ``dropped``, whose window keeps a
  block: the ``last_token``'s (reference: the last ``W`` tokens) or the
  ``next_token``'s (vLLM: the token computed next and the ``W - 1`` before it,
  one token narrower).
* ``WindowConventions.release`` -- under ``dropped``, when a slid-out block is
  released: ``eager``ly, by the call that slides it out (reference), or
  ``at_next_allocation`` of its sequence, refused or not (vLLM's
  ``remove_skipped_blocks`` in ``allocate_slots``).
* ``StoreConventions`` -- the tiered store's shape (its tiers, at most how
  many nodes), its policies, what a re-put of a held key does, whether stores
  are pending until completed, read leases, background eviction and who picks
  its victims, whether a hit is promoted: see ``spec.kv_store``.

What each choice means exactly is stated, and modelled, in the layer's spec
module: ``spec.block_pool`` for the pool's, ``spec.radix_cache`` for the
radix cache's.  The machines draw from what an implementation declares:
keys cut to its page size, extra keys only where it declares namespaces.
"""

from __future__ import annotations

from typing import Literal

import attrs

Policy = Literal["lru", "lfu"]
POLICIES: tuple[Policy, ...] = ("lru", "lfu")
StorePolicy = Literal["lru", "lfu", "arc"]


@attrs.frozen
class PoolConventions:
    """The block pool's choices (``spec.block_pool``)."""

    unhashed_free_position: Literal["tail", "head"] = "tail"
    duplicate_hash: Literal["refuse", "keep"] = "refuse"
    policies: tuple[Policy, ...] = POLICIES


@attrs.frozen
class ManagerConventions:
    """The block manager's choices (``spec.block_manager``)."""

    fork_partial_block: Literal["share", "copy"] = "share"  # copy: the child's copy of it made at the fork


@attrs.frozen
class RadixConventions:
    """The radix cache's choices (``spec.radix_cache``)."""

    eviction_granularity: Literal["exact_tokens", "whole_leaves"] = "exact_tokens"
    recency: Literal["per_token", "per_node"] = "per_token"
    lock_by: Literal["key", "handle"] = "key"
    page_size: int = 1
    extra_key_namespaces: bool = True
    page_reuse: Literal["lowest_first", "last_freed_first"] = "lowest_first"  # the page manager's free pages


@attrs.frozen
class StoreConventions:
    """The tiered KV store's choices (``spec.kv_store``, which states what each means)."""

    tiers: tuple[str, ...] = ("gpu", "cpu", "ssd")  # a node's tiers, fastest first
    max_nodes: int | None = None  # 1: a store of one node
    policies: tuple[StorePolicy, ...] = ("lru", "lfu", "arc")
    reput: Literal["refresh", "touch", "skip"] = "refresh"  # a put of a key the store holds
    stores: Literal["immediate", "pending"] = "immediate"  # pending: readable once completed
    read_lease: float = 0.0  # seconds of model time a hit leases (pins) the copy for
    leases_new_copies: bool = False  # a copy is leased from the moment it is stored (put, replica) too
    eviction: Literal["on_demand", "background"] = "on_demand"
    watermark: float = 1.0  # background: a tier holding this share of its capacity is evicted at settle
    victims: Literal["policy", "engine"] = "policy"  # who picks the background evictor's victims
    promotion: bool = True  # a hit moves the copy to the first tier
    refusal_adapts_policy: bool = False  # a put refused for want of room still adapts its first tier's policy


@attrs.frozen
class WindowConventions:
    """The sliding-window manager's choices (``spec.sliding_window``, which states what each means)."""

    slid_out: Literal["dropped", "ring"] = "dropped"
    window_of: Literal["last_token", "next_token"] = "last_token"  # dropped: whose window keeps a block
    release: Literal["eager", "at_next_allocation"] = "eager"  # dropped: when a slid-out block is released


@attrs.frozen
class Conventions:
    """Everything an implementation declares about itself; the defaults are the reference's."""

    pool: PoolConventions = PoolConventions()
    manager: ManagerConventions = ManagerConventions()
    radix: RadixConventions = RadixConventions()
    window: WindowConventions = WindowConventions()
    store: StoreConventions = StoreConventions()
    trusts_caller: bool = False


REFERENCE = Conventions()
"""What the reference implementation declares: the default of every field."""
