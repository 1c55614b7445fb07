"""Layer 4 in vLLM v1's shape, the spec's scheduler: one step as a pure transition, pass by pass.

Theory of operation: ``Model`` is the spec's token-budget scheduler over the spec's prefix-caching
manager (``kvspec.spec.prefix_cache``); ``arrive``, ``abort`` and ``step`` are pure transitions
returning a new ``Model`` (``step`` with its ``BudgetReport``), and a machine compares
``abstract(model)`` with an implementation's ``snapshot()``.  ``step`` carries a ``Served`` record
through its passes -- the running pass (``_serve_running``, preempting through ``_allocate``), the
waiting pass (``_admit_waiting``) and the forward (``_forward``) -- each returning a new one.  The
rules it follows are ``kvspec.spec.scheduler_v1``'s; what it replaces of the layer's model
(``kvspec.spec.admission.step`` and its phases) is all of the step: there is no decode phase
apart from prefill, and no swap.  A trial admission of all of a request's tokens
(``reserve_full_sequence``) is a transition whose result is dropped: the model changes only by
what it keeps.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvspec.spec import prefix_cache
from kvspec.spec.admission import check_request
from kvspec.spec.errors import InvalidOperation, OutOfBlocks
from kvspec.spec.prefix_cache import CachingManager, max_hit_blocks
from kvspec.spec.scheduler import Request, RequestId, rank
from kvspec.spec.scheduler_v1 import (
    BudgetConfig,
    BudgetReport,
    BudgetState,
    Entry,
    check_config,
    check_fits_alone,
    group,
)


@attrs.frozen
class Model:
    config: BudgetConfig
    steps: int
    arrived: tuple[RequestId, ...]
    entries: Mapping[RequestId, Entry]  # unfinished, in arrival order
    running: tuple[RequestId, ...]
    waiting: tuple[RequestId, ...]
    finished: tuple[RequestId, ...]
    memory: CachingManager


def new_model(memory: CachingManager, config: BudgetConfig) -> Model:
    return Model(check_config(config), 0, (), {}, (), (), (), memory)


def abstract(model: Model) -> BudgetState:
    return BudgetState(
        config=model.config,
        steps=model.steps,
        arrived=model.arrived,
        entries=tuple(model.entries.values()),
        running=model.running,
        waiting=model.waiting,
        finished=model.finished,
        memory=prefix_cache.abstract(model.memory),
    )


def arrive(model: Model, request: Request) -> Model:
    request = check_request(request, model.arrived)
    if request.n != 1 or not request.ready:
        raise InvalidOperation(f"request {request.request_id!r}: v1 takes one sample of a ready request")
    manager = model.memory.manager
    check_fits_alone(request, model.config, manager.pool.capacity, manager.block_size)
    entry = Entry(request, arrival=len(model.arrived))
    return _enqueue(
        attrs.evolve(
            model, arrived=model.arrived + (request.request_id,), entries={**model.entries, entry.request_id: entry}
        ),
        entry,
        front=False,
    )


def abort(model: Model, request_id: RequestId) -> Model:
    if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id not in model.entries:
        raise InvalidOperation(f"request {request_id!r} is not unfinished (never arrived, finished or aborted)")
    return _drop(model, model.entries[request_id])


def step(model: Model) -> tuple[Model, BudgetReport]:
    """Serve the running requests (preempting as needed), admit if nobody was preempted, run the forward."""
    served = Served(model, model.config.token_budget, BudgetReport())
    served = _serve_running(served)
    if not served.report.preempted:
        served = _admit_waiting(served)
    model, report = _forward(served)
    report = attrs.evolve(report, preempted=tuple(sorted(report.preempted)))
    return attrs.evolve(model, steps=model.steps + 1), report


@attrs.frozen
class Served:
    """A step between its passes: the model so far, the budget left, what was done."""

    model: Model
    budget: int
    report: BudgetReport


def _serve_running(served: Served) -> Served:
    visited: set[RequestId] = set()
    while served.budget > 0:
        rid = next((r for r in served.model.running if r not in visited), None)
        if rid is None:
            return served
        visited.add(rid)
        entry = served.model.entries[rid]
        share = min(len(entry.tokens()) - entry.computed, served.budget)
        served, fitted = _allocate(served, entry, share)
        if fitted:
            report = attrs.evolve(served.report, served=served.report.served + ((rid, share),))
            served = attrs.evolve(served, budget=served.budget - share, report=report)
        elif served.model.config.policy == "fcfs":
            return served
    return served


def _allocate(served: Served, entry: Entry, share: int) -> tuple[Served, bool]:
    """Slots for ``share`` more tokens of a running request, preempting the lowest-ranked while they do not fit."""
    chunk = entry.tokens()[entry.computed : entry.computed + share]
    while True:
        try:
            memory, _ = prefix_cache.append(served.model.memory, entry.seq, chunk)
        except OutOfBlocks:
            victim = _victim(served.model)
            served = _preempt(served, victim)
            if victim == entry.request_id:
                return served, False
            continue
        return attrs.evolve(served, model=attrs.evolve(served.model, memory=memory)), True


def _victim(model: Model) -> RequestId:
    if model.config.policy == "fcfs":
        return model.running[-1]
    return max(model.running, key=lambda rid: rank(group(model.entries[rid]), "priority"))


def _preempt(served: Served, victim: RequestId) -> Served:
    """Free the victim, send it back to the queue with nothing computed; it gives back a share already served."""
    model = served.model
    entry = model.entries[victim]
    memory = prefix_cache.free(model.memory, entry.seq)
    waiting = attrs.evolve(entry, place="waiting", computed=0, preemptions=entry.preemptions + 1)
    model = attrs.evolve(
        model,
        memory=memory,
        running=tuple(r for r in model.running if r != victim),
        entries={**model.entries, victim: waiting},
    )
    given_back = dict(served.report.served).get(victim, 0)
    report = attrs.evolve(
        served.report,
        served=tuple(pair for pair in served.report.served if pair[0] != victim),
        preempted=served.report.preempted + (victim,),
    )
    return Served(_enqueue(model, waiting, front=True), served.budget + given_back, report)


def _enqueue(model: Model, entry: Entry, front: bool) -> Model:
    """Into the waiting queue: at the head (a victim) or the tail (an arrival); by rank under ``priority``."""
    rid = entry.request_id
    if model.config.policy == "priority":
        queue = sorted((*model.waiting, rid), key=lambda r: rank(group(model.entries[r]), "priority"))
        return attrs.evolve(model, waiting=tuple(queue))
    return attrs.evolve(model, waiting=(rid, *model.waiting) if front else (*model.waiting, rid))


def _admit_waiting(served: Served) -> Served:
    config, size = served.model.config, served.model.memory.manager.block_size
    while served.budget > 0 and served.model.waiting and len(served.model.running) < config.max_running:
        model = served.model
        entry = model.entries[model.waiting[0]]
        tokens = entry.tokens()
        hits = len(prefix_cache.cached_prefix(model.memory, tokens)[: max_hit_blocks(len(tokens), size)]) * size
        if not config.chunked_prefill and len(tokens) - hits > served.budget:
            return served
        share = min(len(tokens) - hits, served.budget)
        try:
            if config.reserve_full_sequence:
                prefix_cache.add_sequence(model.memory, entry.seq, tokens)  # a trial: does all of it fit?
            memory, plan = prefix_cache.add_sequence(model.memory, entry.seq, tokens[: hits + share])
        except OutOfBlocks:
            return served
        admitted = attrs.evolve(entry, place="running", computed=plan.cached_tokens)
        model = attrs.evolve(
            model,
            memory=memory,
            entries={**model.entries, entry.request_id: admitted},
            running=model.running + (entry.request_id,),
            waiting=model.waiting[1:],
        )
        report = served.report
        report = attrs.evolve(
            report,
            served=report.served + ((entry.request_id, share),),
            admitted=report.admitted + (entry.request_id,),
            cached_tokens=report.cached_tokens + ((entry.request_id, plan.cached_tokens),),
        )
        served = Served(model, served.budget - share, report)
    return served


def _forward(served: Served) -> tuple[Model, BudgetReport]:
    """Every share's KV is computed; a request that caught up samples one token, and may finish."""
    model, report = served.model, served.report
    for rid, share in report.served:
        entry = model.entries[rid]
        entry = attrs.evolve(entry, computed=entry.computed + share)
        if entry.computed == len(entry.tokens()):
            entry = attrs.evolve(entry, generated=entry.generated + 1)
        model = attrs.evolve(model, entries={**model.entries, rid: entry})
        if entry.generated == entry.request.max_new_tokens:
            model = attrs.evolve(_drop(model, entry), finished=model.finished + (rid,))
            report = attrs.evolve(report, finished=report.finished + (rid,))
    return model, report


def _drop(model: Model, entry: Entry) -> Model:
    """The request leaves: its blocks freed if it holds any."""
    rid = entry.request_id
    memory = prefix_cache.free(model.memory, entry.seq) if entry.place == "running" else model.memory
    return attrs.evolve(
        model,
        memory=memory,
        entries={r: e for r, e in model.entries.items() if r != rid},
        running=tuple(r for r in model.running if r != rid),
        waiting=tuple(r for r in model.waiting if r != rid),
    )
