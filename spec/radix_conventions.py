"""Layer 3, radix form: the radix cache under declared conventions -- SGLang's choices as marked replacements.

``kvspec.spec.radix_cache`` is the chapter under the reference's conventions.
This module models a radix cache under any conventions it declares
(``spec.conventions.RadixConventions``): each public transition is the
chapter's, unless a declared convention changes it -- then it is the
replacement below, marked with the convention it models.  Machines and the
page manager (``spec.radix_pages``) drive this module; for the reference's
conventions it is exactly the chapter.

Nodes.  Two of SGLang's choices speak of *nodes*, a compressed tree's runs
of tokens, so under them (only) the model keeps ``NodeRadix.node_of``: each
cached prefix's node, named by the node's last prefix.  A node ends where an
insert's new tokens end and where a walk (a match's or an insert's) ends
inside it, which splits it; a lock by key splits it too; eviction never
merges.  So a branch point always ends a node.

* ``eviction_granularity="whole_leaves"`` -- ``evict`` takes whole
  unprotected leaf *nodes*, least recently used first, each from its deepest
  token up, until at least ``min(num_tokens, evictable)`` tokens are gone
  (SGLang's ``evict``: ``free_segment(x.value)`` of each popped leaf).
* ``recency="per_node"`` -- a walk marks every node it visits, *whole*,
  before it splits the last one where the walk ends: a partial match marks
  the node's unmatched tail too (``_match_prefix_helper`` and
  ``_insert_helper`` set ``last_access_time`` on each child they visit
  before they compare its key).  An insert's new leaf is newer than the walk
  (a ``TreeNode`` is stamped when it is made, after the walk).
* ``lock_by="handle"`` -- SGLang's scheduler locks the node ``match_prefix``
  returned: ``lock(key)`` is a match of ``key`` -- marking and splitting as
  any match does -- then a lock on the node its longest cached prefix ends
  at; ``inc_lock_ref`` itself neither marks nor splits.  ``unlock(key)``
  releases the node where the key's longest cached prefix ends now, with no
  mark; it must hold a lock.  A key with no cached prefix names the root,
  where both do nothing.

What is not modelled, and why: the upper part a split cuts off is a new
``TreeNode`` in SGLang (``_split_node``), stamped a moment after the walk
that split it.  No eviction order can tell that stamp from the walk's: the
upper part lies on the walk's own path, below nodes that walk stamped and
above the tail it stamped, and is a leaf only once that tail is gone -- and
in SGLang only a walk splits.  So the model stamps it with its walk.  The
order it does model -- a new leaf after the walk, the walk's nodes together
-- is SGLang's code run on a clock that ticks between the walk's
``time.monotonic()`` and the new ``TreeNode``'s; on a clock too coarse to
tick (``TreeNode.__lt__`` then finds neither first) SGLang's heap may take
either leaf first, and the verdict files that as a convention finding: the
order of two unlocked leaves, never a safety rule (the zoo's legal variant
``breaks_recency_ties_the_other_way`` is such a cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from kvspec.spec import radix_cache as chapter
from kvspec.spec.conventions import REFERENCE, RadixConventions
from kvspec.spec.prefix_cache import ExtraKey
from kvspec.spec.radix_cache import Key, Radix, RadixState


@attrs.frozen
class NodeRadix(Radix):
    """The chapter's trie, with the node of each cached prefix: its last prefix."""

    node_of: Mapping[Key, Key] = attrs.field(factory=dict)


def new_radix(conventions: RadixConventions = REFERENCE.radix) -> Radix:
    """The model of a cache that declares ``conventions``: with nodes if a convention speaks of them."""
    if conventions.eviction_granularity == "whole_leaves" or conventions.recency == "per_node":
        return NodeRadix(values={}, last_use={}, locks={}, clock=0, conventions=conventions)
    return chapter.new_radix(conventions)


def abstract(radix: Radix) -> RadixState:
    return chapter.abstract(radix)


# -- nodes -----------------------------------------------------------------------


def members(radix: NodeRadix, end: Key) -> list[Key]:
    """The cached prefixes of the node that ends at ``end``, shallowest first."""
    return [end[:i] for i in range(1, len(end) + 1) if radix.node_of[end[:i]] == end]


def split(radix: NodeRadix, at: Key) -> NodeRadix:
    """A node ends at ``at`` (a cached prefix, or the root): one that ends further down is cut there."""
    if not at or radix.node_of[at] == at:
        return radix
    upper = [prefix for prefix in members(radix, radix.node_of[at]) if len(prefix) <= len(at)]
    return attrs.evolve(radix, node_of={**radix.node_of, **dict.fromkeys(upper, at)})


def walked(radix: NodeRadix, named: Key, length: int) -> NodeRadix:
    """Modified walk (``per_node``: every node visited, whole, marked; then) split where the walk ends."""
    used = chapter.path(named, length)
    if radix.conventions.recency == "per_node":
        used = [prefix for end in dict.fromkeys(radix.node_of[p] for p in used) for prefix in members(radix, end)]
    return split(chapter.mark(radix, used), named[:length])


# -- the transitions, modified where a declared convention says ----------------------


def match_prefix(radix: Radix, key: Sequence[int], extra_key: ExtraKey = None) -> tuple[Radix, tuple[int, ...]]:
    """Modified under nodes: ``walked`` marks and splits."""
    if not isinstance(radix, NodeRadix):
        return chapter.match_prefix(radix, key, extra_key)
    named = chapter.key_of(radix, key, extra_key, cut=True)
    length = chapter.cached_length(radix, named)
    return walked(radix, named, length), tuple(radix.values[prefix] for prefix in chapter.path(named, length))


def insert(radix: Radix, key: Sequence[int], values: Sequence[int], extra_key: ExtraKey = None) -> tuple[Radix, int]:
    """Modified under nodes: ``walked`` marks and splits; the new tokens are a new leaf node."""
    if not isinstance(radix, NodeRadix):
        return chapter.insert(radix, key, values, extra_key)
    named, stored = chapter.checked_insert(radix, key, values, extra_key)
    present = chapter.cached_length(radix, named)
    radix = walked(radix, named, present)
    if present == len(named):
        return radix, present
    grown = chapter.add(radix, named, stored, present)
    new_leaf = dict.fromkeys(chapter.path(named, len(named))[present:], named)
    return attrs.evolve(grown, node_of={**radix.node_of, **new_leaf}), present


def lock(radix: Radix, key: Sequence[int], extra_key: ExtraKey = None) -> Radix:
    """Modified (``lock_by="handle"``): a match, then a lock on the node it returned; under nodes a lock by key
    ends a node at the key."""
    if radix.conventions.lock_by == "handle":
        radix, values = match_prefix(radix, key, extra_key)
        end = chapter.key_of(radix, key, extra_key, cut=True)[: len(values)]
        return chapter.add_lock(radix, end) if end else radix
    radix = chapter.lock(radix, key, extra_key)
    return split(radix, chapter.key_of(radix, key, extra_key, cut=False)) if isinstance(radix, NodeRadix) else radix


def unlock(radix: Radix, key: Sequence[int], extra_key: ExtraKey = None) -> Radix:
    """Modified (``lock_by="handle"``): the node where the key's longest cached prefix ends, with no mark."""
    if radix.conventions.lock_by != "handle":
        return chapter.unlock(radix, key, extra_key)
    named = chapter.key_of(radix, key, extra_key, cut=True)
    end = named[: chapter.cached_length(radix, named)]
    return chapter.remove_lock(radix, end, key) if end else radix


def evict(radix: Radix, num_tokens: int) -> tuple[Radix, tuple[int, ...]]:
    """Modified under nodes: ``evict_from_node`` is the step."""
    if not isinstance(radix, NodeRadix):
        return chapter.evict(radix, num_tokens)
    return chapter.evict_by(radix, num_tokens, evict_from_node)


def evict_from_node(radix: NodeRadix) -> tuple[NodeRadix, tuple[int, ...]] | None:
    """The least recently used leaf node goes whole (``whole_leaves``), or its last page does; the node of what
    is left of it ends a page earlier."""
    leaves = chapter.evictable_leaves(radix)
    if not leaves:
        return None
    leaf = leaves[0]
    if radix.conventions.eviction_granularity == "whole_leaves":
        gone = tuple(members(radix, leaf)[::-1])
    else:
        gone = chapter.leaf_page(radix, leaf)
    rest = [prefix for prefix in members(radix, leaf) if prefix not in gone]
    node_of = {k: end for k, end in radix.node_of.items() if k not in gone} | dict.fromkeys(rest, leaf[: -len(gone)])
    return chapter.without(attrs.evolve(radix, node_of=node_of), gone)
