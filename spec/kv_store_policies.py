"""Layer 7's eviction policies: the order in which one tier of one node gives up its copies (``spec.kv_store``).

Rules:

* ``lru`` -- the least recently used copy first.  A *use* is a put that
  writes or touches the copy, or a hit; moving between tiers is not a use.
* ``lfu`` -- the copy used the fewest times first, ties in LRU order.
* ``arc`` -- adaptive replacement (Megiddo and Modha, FAST '03), as vLLM's CPU
  offloading runs it.  A tier keeps its copies in two lists in LRU order:
  *recent* (T1: stored and not used since) and *frequent* (T2: used again
  after they were stored; a use moves a recent copy there).  It also keeps two
  *ghost* lists of keys that recently left it as victims (B1 from recent, B2
  from frequent, each at most the tier's capacity, the oldest dropped) and a
  target size ``p`` for the recent list, starting at 0.

  - A copy entering the tier under a ghost key adapts ``p`` before room is
    made for it: a B1 ghost raises it by max(1, |B2| / |B1|) (at most the
    capacity), a B2 ghost lowers it by max(1, |B1| / |B2|) (at least 0); the
    ghost moves to the young end of its list, and leaves it once the copy is in.
  - The victim is the first evictable copy of the recent list when that list
    holds at least int(p) copies, else of the frequent list, else of the recent
    list; its key becomes a ghost of the list it left.

* A snapshot lists a tier's keys in *eviction order*: the order successive
  victims would be taken in if every copy were evictable.  Which copies are
  evictable (not pinned, leased or pending) is the store's business: a policy
  only skips the ones it is told to.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import attrs

from kvspec.spec.conventions import StorePolicy

STORE_POLICIES: tuple[StorePolicy, ...] = ("lru", "lfu", "arc")
Key = Hashable


class Used(Protocol):
    """What a policy reads of a copy."""

    @property
    def uses(self) -> int: ...
    @property
    def last_use(self) -> int: ...
    @property
    def frequent(self) -> bool: ...


Entries = Sequence[tuple[Key, Used]]


@attrs.frozen
class Ghosts:
    """An ARC tier's memory of what left it: the ghost lists, oldest first, and the target size of T1."""

    recent: tuple[Key, ...] = ()
    frequent: tuple[Key, ...] = ()
    target: float = 0.0


@attrs.frozen
class ArcLists:
    """An ARC tier as a snapshot shows it."""

    recent: tuple[Key, ...]
    frequent: tuple[Key, ...]
    recent_ghosts: tuple[Key, ...]
    frequent_ghosts: tuple[Key, ...]
    target: float


def by_recency(entries: Entries) -> list[Key]:
    return [key for key, _ in sorted(entries, key=lambda entry: entry[1].last_use)]


def arc_lists(entries: Entries, ghosts: Ghosts) -> ArcLists:
    recent = by_recency([(key, used) for key, used in entries if not used.frequent])
    frequent = by_recency([(key, used) for key, used in entries if used.frequent])
    return ArcLists(tuple(recent), tuple(frequent), ghosts.recent, ghosts.frequent, ghosts.target)


def eviction_order(policy: StorePolicy, entries: Entries, ghosts: Ghosts) -> tuple[Key, ...]:
    """The tier's keys, the first victim at the head."""
    if policy == "lru":
        return tuple(by_recency(entries))
    if policy == "lfu":
        return tuple(key for key, _ in sorted(entries, key=lambda entry: (entry[1].uses, entry[1].last_use)))
    lists = arc_lists(entries, ghosts)
    recent, frequent, order = list(lists.recent), list(lists.frequent), []
    while recent or frequent:
        if not frequent or (recent and len(recent) >= int(ghosts.target)):
            order.append(recent.pop(0))
        else:
            order.append(frequent.pop(0))
    return tuple(order)


def victim(policy: StorePolicy, entries: Entries, ghosts: Ghosts, evictable: Callable[[Key], bool]) -> Key | None:
    """The copy the policy gives up next among the evictable ones; None when there is none."""

    def first(keys: Sequence[Key]) -> Key | None:
        return next((key for key in keys if evictable(key)), None)

    if policy != "arc":
        return first(eviction_order(policy, entries, ghosts))
    lists = arc_lists(entries, ghosts)
    chosen = first(lists.recent) if len(lists.recent) >= int(ghosts.target) else None
    for candidates in (lists.frequent, lists.recent):
        chosen = first(candidates) if chosen is None else chosen
    return chosen


def arc_enter(ghosts: Ghosts, key: Key, capacity: int) -> Ghosts:
    """A copy enters the tier under ``key``: a ghost hit adapts the target (the ghost stays until ``arc_admit``)."""
    if key in ghosts.recent:
        delta = max(1.0, len(ghosts.frequent) / len(ghosts.recent))
        return Ghosts(young(ghosts.recent, key), ghosts.frequent, min(ghosts.target + delta, float(capacity)))
    if key in ghosts.frequent:
        delta = max(1.0, len(ghosts.recent) / len(ghosts.frequent))
        return Ghosts(ghosts.recent, young(ghosts.frequent, key), max(ghosts.target - delta, 0.0))
    return ghosts


def arc_admit(ghosts: Ghosts, key: Key) -> Ghosts:
    """The copy is in: its key is no ghost any more."""
    return attrs.evolve(ghosts, recent=without(ghosts.recent, key), frequent=without(ghosts.frequent, key))


def arc_leave(ghosts: Ghosts, key: Key, frequent: bool, capacity: int) -> Ghosts:
    """A victim left the list it was in: its key joins that list's ghosts, each ghost list kept to ``capacity``."""
    recent_ghosts, frequent_ghosts = ghosts.recent, ghosts.frequent
    if frequent:
        frequent_ghosts = young(frequent_ghosts, key)
    else:
        recent_ghosts = young(recent_ghosts, key)
    return attrs.evolve(ghosts, recent=recent_ghosts[-capacity:], frequent=frequent_ghosts[-capacity:])


def young(keys: tuple[Key, ...], key: Key) -> tuple[Key, ...]:
    """``keys`` with ``key`` at the young end."""
    return (*without(keys, key), key)


def without(keys: tuple[Key, ...], key: Key) -> tuple[Key, ...]:
    return tuple(k for k in keys if k != key)
