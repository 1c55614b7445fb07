"""Layer 4, admission as engines run it: cache hits, requests not ready, priorities and grants.

``kvspec.spec.scheduler`` states the rules and runs them; this module states
what must hold of them, where the scheduler meets the prefix cache and where
it meets the world outside memory.

Rules (from ``kvspec.spec.scheduler``):

* **Hits are probed at every attempt.**  A waiting request's hit length is
  what the cache holds *now*: between two attempts the cache may have lost
  blocks (evicted to make room) or gained them (another request finished).
  A hit lowers the request's demand once; a hit block sitting in the free
  queue is counted there as free, and admission takes it out of the queue, so
  it counts as demand again (``scheduler.prefill_demand``).
* **Not ready is not blocked.**  A request waiting on remote KV, a grammar or
  an adapter slot is passed over by admission and keeps its place: the ready
  requests behind it are admitted as if it were not there, and when it
  becomes ready (``mark_ready``) it goes before every later arrival.
* **Grants go with the group.**  Each step grants every running group its
  decode tokens, in arrival order; a group that does not fit preempts the
  lowest-ranked running group -- under the priority policy one that may have
  arrived first and hold its grant already.  The victim gives its grant
  back: its KV is being freed or moved, and a grant it keeps runs the model
  over blocks that are no longer its own.

Invariants (tier in brackets):

* ``invariant_hits_probed_at_admission`` [safety] -- each admission reports the
  tokens the cache held for its prompt at that moment, as the spec's cache does.
* ``invariant_watermark_kept`` [safety] -- after an admission onto a busy GPU,
  ``watermark`` blocks are still free.
* ``invariant_not_ready_never_admitted`` [safety] -- a request not ready never
  holds blocks.
* ``invariant_admission_stops_only_when_short`` [convention] -- admission stops
  only at a ready request that does not fit, or one preempted in this step.
* ``invariant_preempted_keeps_no_grant`` [safety] -- no request is both
  preempted and granted tokens in one step.
* ``invariant_victims_rank_below_survivors`` [convention] -- every victim ranks
  below every request that kept its grant.
"""

from __future__ import annotations

from kvspec.spec.invariants import invariant
from kvspec.spec.scheduler import (
    DEVICE_OF,
    Group,
    SchedulerState,
    StepReport,
    admissible,
    group_blocks,
    rank,
)


@invariant(
    "the cache changes between attempts: a hit length remembered from an earlier probe counts blocks since "
    "evicted, or recomputes blocks since cached",
    "safety",
)
def invariant_hits_probed_at_admission(expected: StepReport, actual: StepReport) -> str | None:
    """``expected`` is the spec's report of the step, ``actual`` the implementation's."""
    if dict(expected.cached_tokens) != dict(actual.cached_tokens):
        return (
            f"admissions took {dict(actual.cached_tokens)} tokens from the cache, "
            f"it held {dict(expected.cached_tokens)} for them when they were admitted"
        )
    return None


@invariant(
    "the watermark is room kept for the running requests' next tokens: admitting into it preempts someone at "
    "the very next step (a hit counted in both demand and supply does exactly that)",
    "safety",
)
def invariant_watermark_kept(after: SchedulerState, report: StepReport) -> str | None:
    admitted = set(report.admitted)
    busy_before = any(g.location == "running" and g.request.request_id not in admitted for g in after.groups)
    free = after.gpu.pool.num_free
    if admitted and (busy_before or len(admitted) > 1) and free < after.config.watermark:
        return (
            f"admitted {list(report.admitted)} and left {free} blocks free, the watermark is {after.config.watermark}"
        )
    return None


@invariant(
    "a request not ready has no remote KV, grammar or adapter yet: running it computes from what is not there",
    "safety",
)
def invariant_not_ready_never_admitted(state: SchedulerState) -> str | None:
    for group in state.groups:
        if not group.ready and group.location != "waiting":
            return f"request {group.request.request_id!r} is {group.location} before it is ready"
    return None


def upper_demand(state: SchedulerState, group: Group) -> int:
    """Blocks resuming ``group`` takes at most: a swapped group's, or a prefill's as if nothing were cached."""
    device = DEVICE_OF.get(group.location)
    if device == "cpu":
        return len({b for seq in group.seqs for b in state.cpu.tables.get(seq, ())})
    request = group.request
    return group_blocks(len(request.prompt), group.generated, request.n, state.gpu.block_size)


@invariant(
    "admission stops at the first ready request that does not fit: stopping earlier -- at a request not ready, "
    "say -- idles memory and stalls every request behind it",
    "convention",
)
def invariant_admission_stops_only_when_short(after: SchedulerState, report: StepReport) -> str | None:
    policy = after.config.policy
    queue = sorted((g for g in after.groups if g.location != "running" and g.ready), key=lambda g: rank(g, policy))
    if not queue or any(rid == queue[0].request.request_id for rid, _ in report.preempted):
        return None
    first = queue[0]
    need, free = upper_demand(after, first), after.gpu.pool.num_free
    idle = not any(g.location == "running" for g in after.groups)
    if admissible(need, free, after.config.watermark, idle):
        return f"request {first.request.request_id!r} needs at most {need} blocks, {free} are free, yet it waits"
    return None


@invariant(
    "a preempted request's KV is being freed or moved: a grant it keeps runs the model over blocks no longer its own",
    "safety",
)
def invariant_preempted_keeps_no_grant(report: StepReport) -> str | None:
    kept = sorted({rid for rid, _ in report.preempted} & {rid for rid, _ in report.granted})
    if kept:
        return f"requests {kept} were preempted and keep their grants in the same step"
    return None


@invariant(
    "the policy decides who gives way: preempting a request that ranks above one kept serves the wrong one first",
    "convention",
)
def invariant_victims_rank_below_survivors(before: SchedulerState, report: StepReport) -> str | None:
    ranks = {g.request.request_id: rank(g, before.config.policy) for g in before.groups}
    granted = [rid for rid, _ in report.granted]
    for victim, _ in report.preempted:
        above = [rid for rid in granted if ranks[rid] > ranks[victim]]
        if above:
            return f"preempted request {victim!r} (rank {ranks[victim]}) and kept {above[0]!r} (rank {ranks[above[0]]})"
    return None
