"""Layer 3, radix form over pages: SGLang's page manager against ``kvspec.spec.radix_pages``'s model.

Requests live their whole life in this machine: they arrive in a queue,
are admitted in order while pages suffice (matching their prompt in the
tree, locking it, evicting for the rest), decode a token per step, and
leave -- by finishing at their last token or early (a stop string), by
preemption (caching what they computed, or dropping it as SGLang's
``retract_decode`` does) back to the head of the queue, or by abort.  A
decode that finds no page preempts the latest admitted request.  Prompts are
cuts of three documents, so admissions hit, and a preempted request's
re-admission often hits its own pages; the engine trims its cache at times
(``evict``) and drains to quiescence.  The scheduler of ``spec.scheduler``
runs over block managers with fork and swap, which a radix page manager does
not offer; this machine drives the page manager's request lifecycle itself.

After every operation the model's state is the implementation's and every
rule of ``radix_pages.STATE`` holds; each eviction's slots are whole pages;
each refused admission or decode is checked against the manager's own state
before it.  The caller goes on as the manager answers: which requests run and
what tokens each has (``tokens``) is its own ledger, kept from the calls the
manager carried out.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event, target
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from kvspec.conformance import run_conformance
from kvspec.impl.radix_pages import LastFreedFirstPageManager, RadixPageManager
from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.properties.subjects import Answer
from kvspec.spec import radix_cache
from kvspec.spec import radix_pages as model
from kvspec.spec.conventions import Conventions, RadixConventions
from kvspec.spec.implementation import Implementation

TOKENS = st.integers(0, 9)
INCIDENTS = ("none", "none", "stop string", "preempt", "trim")


def documents(page_size: int) -> tuple[tuple[int, ...], ...]:
    """Three texts prompts are cut from: the first two share their first page, the third nothing."""
    first = tuple((3 * i + 1) % 10 for i in range(3 * page_size + 1))
    second = first[:page_size] + tuple((t + 5) % 10 for t in first[page_size:])
    return first, second, tuple(9 - t for t in first)


class RadixPagesMachine(LockstepMachine):
    uses = frozenset({"radix_page_manager"})
    judges = ("radix_pages", "radix_cache", "invariants")

    @initialize(page_size=st.sampled_from([2, 4, 3]), num_pages=st.integers(5, 10))
    def start(self, page_size: int, num_pages: int) -> None:
        self.record(f"pages = radix_page_manager(num_pages={num_pages}, page_size={page_size})")
        spec = model.new_pages(num_pages, page_size, self.conventions.radix)
        self.pages = self.subject("pages", model, spec, self.implementation.radix_page_manager(num_pages, page_size))
        self.state = self.pages.snapshot()  # the manager's own, after its last call
        self.page_size, self.slots = page_size, num_pages * page_size
        self.texts = documents(page_size)
        self.queue: list[tuple[int, tuple[int, ...], int]] = []  # (id, tokens, tokens left to generate)
        self.running: dict[int, int] = {}  # id -> tokens left to generate, in admission order
        self.tokens: dict[int, tuple[int, ...]] = {}  # id -> the tokens the caller has given each running request
        self.prompts: list[tuple[tuple[int, ...], int]] = []  # each prompt admitted, with the evictions then
        self.next_id = 0
        self.evicted = 0  # tokens evicted by the engine's trims so far
        self.quiescent = 0  # times no request ran while the cache held tokens
        self.probed_the_brim = False
        self.sent = False  # whether the last call reached the manager (``call``)

    # -- requests ----------------------------------------------------------------------

    def draw_prompt(self, data: st.DataObject) -> tuple[int, ...]:
        if bool(self.prompts) and data.draw(st.booleans(), label="an earlier prompt"):
            prompt, evicted_then = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
            event("revisit: an earlier prompt again")
            if evicted_then < self.evicted:
                event("revisit: replayed a prompt after eviction")
            return prompt
        text = data.draw(st.sampled_from(self.texts), label="document")
        kept = data.draw(st.one_of(st.just(len(text)), st.integers(1, len(text))), label="kept")
        return text[:kept] + tuple(data.draw(st.lists(TOKENS, max_size=self.page_size), label="tail"))

    @rule(data=st.data(), arrivals=st.integers(1, 2), then_steps=st.integers(0, 3))
    def arrive(self, data: st.DataObject, arrivals: int, then_steps: int) -> None:
        for _ in range(arrivals):
            self.next_id += 1
            prompt = self.draw_prompt(data)
            drawn = data.draw(st.integers(1, 2 * self.page_size), label="max_new_tokens")
            longest = min(drawn, self.slots - len(prompt))  # a request fits the pool alone
            self.queue.append((self.next_id, prompt, longest))
        self.step(data, then_steps)

    @rule(data=st.data(), count=st.integers(1, 4))
    def step_rule(self, data: st.DataObject, count: int) -> None:
        self.step(data, count)

    def step(self, data: st.DataObject, count: int) -> None:
        """``count`` iterations: admit from the queue in order while pages suffice, decode every request, and
        (drawn) an incident: a stop string, a preemption by the scheduler, the engine trimming its cache.

        The incidents ride on the step, which runs in nearly every example (swarm testing turns off a rule
        of their own in many)."""
        if not self.probed_the_brim and data.draw(st.integers(0, 3), label="admit at the brim") > 0:
            self.at_the_brim(data)  # three times in four (zero, the shrinker's choice, is no) until it has run
        for _ in range(count):
            while self.queue:
                rid, tokens, left = self.queue[0]
                answer = self.admit(rid, tokens)
                if answer is None or answer.actual is None:
                    break  # the manager makes it wait
                self.queue.pop(0)
                self.running[rid] = left
                self.prompts.append((tokens, self.evicted))
                event(f"admission hit {answer.actual // self.page_size} pages")
            for rid in list(self.running):
                if rid in self.running:
                    self.decode(data, rid)
            incident = data.draw(st.sampled_from(INCIDENTS), label="incident")
            if incident == "trim":
                self.evict(data.draw(st.integers(0, 3 * self.page_size), label="tokens to trim"))
            elif incident != "none" and self.running:
                rid = data.draw(st.sampled_from(list(self.running)), label="request")
                if incident == "stop string":
                    self.leave(rid, keep=True, why="finished early")
                else:
                    self.preempt(rid, data.draw(st.booleans(), label="cache what it computed"), why="by the scheduler")

    def at_the_brim(self, data: st.DataObject) -> None:
        """Once an example, with unlocked pages in the tree (a document served and cached first if
        there are none): a prompt the tree does not hold, one page longer than the free and evictable pages,
        which must wait, then one exactly as long, which must be admitted by evicting (where a manager that
        counts free pages alone refuses falsely); each admitted leaves at once, cached."""
        self.probed_the_brim = True
        if self.free_or_evictable() == len(self.state.free):
            self.serve(data.draw(st.sampled_from(self.texts), label="served first"), why="served first")
        p = self.page_size
        firsts = {key[0] for key in self.state.cache.values}
        fresh = next((t for t in range(10) if radix_cache.name_tokens((t,) * p, p)[0] not in firsts), None)
        if fresh is not None:
            available = self.free_or_evictable()
            for pages in (available + 1, available):
                self.serve((fresh,) * (pages * p), why="served at the brim")

    def serve(self, tokens: tuple[int, ...], why: str) -> None:
        """A request admitted past the queue that leaves at once, its pages cached."""
        rid = self.next_id = self.next_id + 1
        answer = self.admit(rid, tokens)
        if answer is not None and answer.actual is not None:
            self.running[rid] = 0
            self.leave(rid, keep=True, why=why)

    def free_or_evictable(self) -> int:
        """The pages a request that matches nothing could have."""
        return model.room(self.state, -1, ())[1]

    def admit(self, rid: int, tokens: tuple[int, ...]) -> Answer | None:
        """Admit; a refusal is checked against the manager's own state before it: too few pages free or
        evictable, and nothing left behind (a decode's refusal is checked in ``decode``)."""
        before = self.state
        answer = self.call("admit", rid, tokens)
        needed, room = model.room(before, rid, tokens)
        if answer is not None and answer.actual is not None:
            self.tokens[rid] = tokens
        if answer is not None and answer.actual is None:  # refused (None is a call out of contract, or spared)
            self.check(model.invariant_pages_refused_only_when_short, before, rid, tokens)
            self.check(model.invariant_pages_refusal_leaves_nothing, before, self.state)
            event("admission waits: too few free and evictable pages")
            if room > len(before.free):
                event("admission refused with evictable pages")
        elif needed > len(before.free):
            event("admission evicted pages to fit")
        return answer

    def decode(self, data: st.DataObject, rid: int) -> None:
        """One token; with no page for it, the latest admitted request is preempted (perhaps this one) and it tries again."""
        while rid in self.running:
            before, token = self.state, (7 * rid + 3 * len(self.tokens[rid])) % 10
            if self.call("decode", rid, token) is not None:
                self.tokens[rid] += (token,)
                self.running[rid] -= 1
                if self.running[rid] == 0:
                    self.leave(rid, keep=True, why="finished")
                return
            if not self.sent:
                return  # not sent (see ``call``): no page was refused
            if rid in before.requests:  # refused by a manager that runs it: it had to find no page
                self.check(model.invariant_pages_refused_only_when_short, before, rid, (token,))
            latest = list(self.running)[-1]
            keep = data.draw(st.booleans(), label="cache what it computed")
            if not self.preempt(latest, keep, why="decode out of pages"):
                return  # the preemption was refused: this step's finding, and no page will come

    def preempt(self, rid: int, keep: bool, why: str) -> bool:
        tokens, left = self.tokens[rid], self.running[rid]
        if not self.leave(rid, keep, why=f"preempted ({why}), {'cached' if keep else 'dropped'}"):
            return False
        self.queue.insert(0, (rid, tokens, left))
        return True

    def leave(self, rid: int, keep: bool, why: str) -> bool:
        if self.call("release", rid, keep) is None:
            return False
        del self.running[rid], self.tokens[rid]
        event(why)
        if not self.running and self.state.cache.values:
            self.quiescent += 1
            event("quiescent with a cache")
        return True

    def evict(self, num_tokens: int) -> None:
        """The engine trims its cache (for other memory, or ``flush_cache``)."""
        answer = self.call("evict", num_tokens)
        if answer is not None:
            self.check(model.invariant_pages_evicted_whole, answer.actual, self.page_size)
            self.evicted += len(answer.actual)
            event("cache trimmed" if answer.actual else "cache trim found nothing evictable")

    # -- abort, drain, calls out of contract ---------------------------------------------

    @rule(index=st.integers(0, 5))
    def abort(self, index: int) -> None:
        """A running request (its pages dropped), a queued one (nothing to release), or an unknown id."""
        ids = list(self.running) + [rid for rid, _, _ in self.queue]
        rid = ids[index] if index < len(ids) else self.next_id + 1 + index
        if rid in self.running:
            self.leave(rid, keep=False, why="aborted while running")
        elif any(queued == rid for queued, _, _ in self.queue):
            self.queue = [entry for entry in self.queue if entry[0] != rid]
            event("aborted while queued")
        else:
            self.call("release", rid, False)

    @rule(keep=st.booleans())
    def drain(self, keep: bool) -> None:
        """Every running request leaves (a server drains): the pages manager must come to rest."""
        for rid in list(self.running):
            self.leave(rid, keep, why="drained")

    @rule(call=st.sampled_from(["admit running", "decode unknown", "evict negative", "keep not a bool", "empty"]))
    def out_of_contract(self, call: str) -> None:
        if call == "admit running" and not self.running:
            return
        running = next(iter(self.running), self.next_id + 1)
        arguments: dict[str, tuple[str, tuple[Any, ...]]] = {
            "admit running": ("admit", (running, (1, 2))),
            "decode unknown": ("decode", (self.next_id + 1, 0)),
            "evict negative": ("evict", (-1,)),
            "keep not a bool": ("release", (running, "yes")),
            "empty": ("admit", (self.next_id + 1, ())),
        }
        operation, args = arguments[call]
        self.call(operation, *args)

    def call(self, operation: str, *args: Any) -> Answer | None:
        """``operation`` on both sides, then every rule over the state: after each call, not each rule, so that
        a state a step passes through (no request running, between a finish and an admission) is checked.
        ``self.sent`` says whether the call reached the manager: one the model holds out of contract is not sent
        to a manager that trusts its caller (and once the model has parted from the manager, it may hold so a
        call on a request the manager runs), so an answer of None is the manager's refusal only if it was sent."""
        steps = type(self).statistics.steps
        answer = self.pages(operation, *args)
        self.sent = type(self).statistics.steps > steps
        impl = self.pages.impl
        self.state = state = impl.snapshot()
        self.check_group(model.STATE, state, impl.evictable_size(), impl.protected_size(), impl.available_size())
        self.check(model.invariant_pages_refine_spec, state, model.abstract(self.pages.model))
        return answer

    def teardown(self) -> None:
        if hasattr(self, "pages"):
            target(float(self.quiescent), label="quiescent with a cache")
        super().teardown()


TestRadixPages = conformance_test(RadixPagesMachine, "radix pages (SGLang's page manager)")


def last_freed_first_reference() -> Implementation:
    """The reference page manager handing out the page freed last first (``page_reuse="last_freed_first"``,
    SGLang's paged allocator)."""
    return Implementation(
        name="reference, the page freed last reused first",
        radix_page_manager=LastFreedFirstPageManager,
        conventions=Conventions(radix=RadixConventions(page_reuse="last_freed_first")),
    )


def test_the_reference_reusing_the_last_freed_page_conforms() -> None:
    verdict = run_conformance(last_freed_first_reference, titled=["radix pages"], profile="ci")
    assert verdict.conforms, str(verdict)


def test_the_leaf_evicted_last_is_reused_first() -> None:
    """Two cached prompts evicted, the older first: a new request is given the page of the one evicted last under
    ``last_freed_first`` (under ``lowest_first``, the lowest page), in the model and the reference alike."""
    calls: list[tuple[Any, ...]] = [
        ("admit", 1, (1, 2)),
        ("admit", 2, (3, 4)),
        ("release", 1, True),
        ("release", 2, True),
        ("evict", 4),
        ("admit", 3, (5, 6)),
    ]
    choices: list[tuple[type[RadixPageManager], RadixConventions, tuple[int, ...]]] = [
        (RadixPageManager, RadixConventions(page_reuse="lowest_first"), (0, 1)),
        (LastFreedFirstPageManager, RadixConventions(page_reuse="last_freed_first"), (2, 3)),
    ]
    for manager, declared, slots in choices:
        pages, spec = manager(4, 2), model.new_pages(4, 2, declared)
        for operation, *args in calls:
            getattr(pages, operation)(*args)
            result = getattr(model, operation)(spec, *args)
            spec = result[0] if isinstance(result, tuple) else result
        assert pages.snapshot() == model.abstract(spec)
        assert pages.snapshot().requests[3].slots == slots
