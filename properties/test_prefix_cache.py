"""Layer 3 conformance: the prefix-caching manager against ``kvspec.spec.prefix_cache``'s model.

The machine drives add (with extra keys) / append / fork / free / lookup /
evict, valid and invalid, serves whole requests the way an engine does
(look the prompt up, admit it, decode, finish), and probes the hash chain
with one-token and extra-key changes.  Prompts start with a cut of one of
three fixed documents (two share their first block and a token) and end with
new tokens, mostly from a three-letter alphabet and sometimes at the edges of
the id range (``properties.alphabets``), so hits, partial hits and duplicate
blocks are common; sequence ids come from a few fixed slots.  Extra keys are
None, an earlier key (so it hits), a near miss of an earlier key (so a
careless encoding collides) or a new rich key.

The search revisits: it keeps every write refused for want of room, with the
prompt's cached blocks as they were then, and retries one -- in its slot, with
its prompt and key -- before and after admissions (which may take those blocks
out of the free queue), after frees and after evictions, preferring one whose
cached blocks have changed since; it re-admits an earlier request's prompt and
key in the same slot or another, and replays an earlier prompt after evicting
cached blocks.

Where the manager offers ``rollback``, decode steps are as often as not
speculative (``kvspec.spec.speculative``): draft tokens appended, registered
as they fill blocks, sometimes hit by a request admitted before their
verification, the rejected ones rolled back -- often into a block the draft
filled -- and the target's token appended.

``DeferredCommitMachine`` runs the same rules on a manager that registers
blocks only when the forward has run (``commit="after_forward"``): requests
commit after each forward, and some are aborted -- freed -- before theirs.  The machine learns the relation between the implementation's hashes
and the spec's ideal keys as it sees them, requires it to stay a bijection,
and compares states through it.  Every pool and manager invariant is checked
as well.  What a safety rule compares the implementation with -- the tokens a
sequence must read back, the prompt a hit must match -- is the caller's
ledger of what it wrote to each sequence (``written``), which follows what
the implementation carried out, never the model.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvspec.impl.broken import prefix_cache as broken_prefix_cache
from kvspec.properties.alphabets import EDGE_TOKENS, RICH_KEYS, TOKEN_WRAPS, near_misses
from kvspec.properties.harness import LockstepMachine
from kvspec.properties.loading import load_implementation
from kvspec.properties.running import conformance_test, run_machine
from kvspec.properties.test_block_manager import TARGET_TOKEN, draft_room, draft_sizes, rejections, rollback_event
from kvspec.spec import block_manager, block_pool, speculative
from kvspec.spec import prefix_cache as model
from kvspec.spec.block_manager import blocks_for
from kvspec.spec.conventions import Conventions, PoolConventions
from kvspec.spec.errors import InvalidOperation, KVSpecError, OutOfBlocks
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import invariant_result_matches_spec
from kvspec.spec.prefix_cache import max_hit_blocks

TOKENS = st.one_of(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), EDGE_TOKENS)
NOT_EXTRA_KEYS = st.sampled_from([1.5, ["list"], frozenset({1}), True])
NOT_TOKENS = st.sampled_from([-1, 1.5, True, "7", None])
SEQS = st.integers(0, 3)  # the slots that sequences live in
REQUEST = 4  # the id a whole request is served under (serve_request frees it before returning)
CachedBlocks = tuple[tuple[int, bool], ...]  # each cached block of a prompt, in order, with whether it is free


class Refusal(NamedTuple):
    """A write refused: the call, and for an admission the blocks cached for its prompt then."""

    operation: str
    seq: int
    args: tuple[object, ...]
    cached: CachedBlocks | None


def well_formed(tokens: list[int], extra_key: model.ExtraKey) -> bool:
    """Whether the caller wrote token ids under an extra key that is data: what ``block_hashes`` hashes."""
    try:
        block_manager.check_tokens(tokens, allow_empty=True)
        model.check_extra_key(extra_key)
    except InvalidOperation:
        return False
    return True


def documents(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Three fixed texts prompts start from: the first two share one block and a token, the third nothing."""
    first = tuple(i % 3 for i in range(3 * block_size + 1))
    second = first[: block_size + 1] + tuple((t + 1) % 3 for t in first[block_size + 1 :])
    third = tuple(2 - t for t in first)
    return first, second, third


class PrefixCacheMachine(LockstepMachine):
    uses = frozenset({"block_pool", "prefix_caching_manager"})
    judges = ("prefix_cache", "speculative", "block_manager", "block_pool", "invariants")
    capacities = st.integers(2, 6)
    block_sizes = st.integers(1, 3)
    commit_point: model.Commit = "on_fill"

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        capacity = data.draw(self.capacities, label="capacity")
        block_size = data.draw(self.block_sizes, label="block size")
        policy = data.draw(st.sampled_from(self.conventions.pool.policies), label="policy")
        self.record(
            f"manager = prefix_caching_manager(capacity={capacity}, block_size={block_size}, policy={policy!r})"
        )
        pool = block_pool.new_pool(capacity, policy, self.conventions.pool)
        spec = model.new_caching_manager(block_size, pool, self.commit_point)
        deferred = {"commit": self.commit_point} if self.deferred else {}  # only this machine needs the option
        impl = self.implementation.prefix_caching_manager(
            self.implementation.block_pool(capacity, policy), block_size, **deferred
        )
        self.manager = self.subject("manager", model, spec, impl)
        self.block_size = block_size
        # the caller's ledger: the tokens it wrote to each sequence it holds, and the sequence's extra key
        self.written: dict[int, list[int]] = {}
        self.extra_keys: dict[int, model.ExtraKey] = {}
        self.pairs: set[tuple[object, model.IdealKey]] = set()
        texts = documents(block_size)
        self.prompts = st.builds(
            lambda text, cut, new: list(text[:cut]) + new or [0],
            st.sampled_from(texts),
            st.integers(0, len(texts[0])),
            st.lists(TOKENS, max_size=block_size + 1),
        )
        self.new_tokens = st.lists(TOKENS, max_size=block_size + 2)
        self.turns = st.lists(TOKENS, min_size=1, max_size=2 * block_size)
        self.keys: list[model.ExtraKey] = []  # every extra key drawn so far
        self.admitted: list[tuple[int, list[int], model.ExtraKey, int]] = []  # (slot, prompt, key, evictions then)
        self.refusals: list[Refusal] = []  # every write refused and not retried yet
        self.evictions = 0  # cached blocks forgotten so far, by evict or by allocation
        # under load from the start: requests fill the slots until one is refused for want of room, and waits
        # for it (swarm testing turns every rule that admits off in about a quarter of the examples)
        for seq in range(data.draw(st.just(REQUEST) | st.integers(0, REQUEST), label="requests at the start")):
            _, prompt, extra_key = self.request(data)
            if not self.admit(seq, prompt, extra_key):
                self.make_room(data)
                break

    def extra_key(self, data: st.DataObject) -> model.ExtraKey:
        """None, an earlier key (a hit), a near miss of one (a collision, if the encoding is careless), or a new one."""
        choices: list[st.SearchStrategy[Any]] = [st.none(), RICH_KEYS]
        if self.keys:
            earlier = st.sampled_from(self.keys)
            choices += [earlier, earlier, earlier.flatmap(lambda key: st.sampled_from(near_misses(key)))]
        key = data.draw(st.one_of(choices), label="extra key")
        self.keys.append(key)
        return key

    # -- learning the hash <-> ideal key relation ------------------------------------

    def learn(self, tokens: tuple[int, ...], extra_key: model.ExtraKey) -> tuple[object, ...]:
        hashes = self.manager.impl.block_hashes(tokens, extra_key)
        keys = model.ideal_keys(tokens, self.block_size, extra_key)
        self.check(invariant_result_matches_spec, len(keys), len(hashes))
        new = set(zip(hashes, keys, strict=True)) - self.pairs
        if new:
            self.pairs |= new
            self.check(model.invariant_hash_iff_prefix, self.pairs)
        return hashes

    # -- the caller's ledger: what the implementation carried out ------------------------

    def carried_out(self, operation: str, seq: int, *args: Any) -> None:
        """Record a call the implementation carried out: what the caller has written to which sequence."""
        if operation == "add_sequence":
            self.written[seq], self.extra_keys[seq] = list(args[0]), args[1]
        elif operation == "append":
            self.written.setdefault(seq, []).extend(args[0])
        elif operation == "rollback" and seq in self.written:
            del self.written[seq][len(self.written[seq]) - args[0] :]
        elif operation == "fork":
            self.written[args[0]] = list(self.written.get(seq, []))
            self.extra_keys[args[0]] = self.extra_keys.get(seq)
        elif operation == "free":
            self.written.pop(seq, None)
            self.extra_keys.pop(seq, None)

    def call(self, operation: str, seq: int, *args: Any) -> bool:
        """A call the ledger follows; whether the implementation carried it out."""
        if self.manager(operation, seq, *args) is None:
            return False
        self.carried_out(operation, seq, *args)
        return True

    # -- operations ----------------------------------------------------------------

    def write(self, operation: str, seq: int, *args: object) -> bool:
        before = self.manager.snapshot()
        answer = self.manager(operation, seq, *args, judged_by=None)  # plans are judged piece by piece below
        if answer is None:
            if self.refused_for_room(operation, seq, args):  # the ones a scheduler retries
                self.refusals.append(Refusal(operation, seq, args, self.cached_blocks(operation, args)))
            return False
        self.carried_out(operation, seq, *args)
        plan = answer.actual
        after = self.manager.snapshot()
        size = self.block_size
        tokens, extra_key = self.written[seq], self.extra_keys.get(seq)
        if not well_formed(tokens, extra_key):
            return True  # an out-of-contract write carried out: its finding is the contract's, nothing to hash
        hashes = self.learn(tuple(tokens), extra_key)
        hits: tuple[int, ...] = ()
        if operation == "add_sequence":
            self.check(model.invariant_hits_stop_at_first_miss, before.pool, hashes, plan.cached_tokens, size)
            hits = after.tables.get(seq, ())[: plan.cached_tokens // size]
            self.check(model.invariant_hit_is_exact_prefix, before.pool, after.contents, hits, tokens, size)
        self.check(block_manager.invariant_copy_on_write_exact, answer.expected.copies, plan.copies)
        self.check(invariant_result_matches_spec, answer.expected.cached_tokens, plan.cached_tokens, against_model=True)
        allocated = [
            b for b, r in enumerate(before.pool.refcounts) if r == 0 < after.pool.refcounts[b] and b not in hits
        ]
        allocated += [copy for _, copy in plan.copies]
        self.check(model.invariant_evicts_only_what_is_needed, before.pool, after.pool, allocated)
        forgotten = sum(
            1 for b, h in enumerate(before.pool.block_hashes) if h not in (None, after.pool.block_hashes[b])
        )
        self.evictions += forgotten
        if forgotten:
            event("a write evicted cached blocks")
        event("prefix hit" if plan.cached_tokens else "no hit")
        return True

    @rule(seq=SEQS, data=st.data(), same_slot=st.booleans())
    def add_sequence(self, seq: int, data: st.DataObject, same_slot: bool) -> None:
        """A new request in ``seq``, or an earlier one again: in the slot it had (if ``same_slot``) or in ``seq``,
        freed first, as an engine reuses a finished request's slot.  If it does not fit, room is made and a
        refused write retried (``make_room``); if it does, a refused write is retried as often as not."""
        self.maybe_retry(data)
        earlier, prompt, extra_key = self.request(data)
        if earlier is not None:
            seq = earlier if same_slot and earlier != REQUEST else seq
            if seq in self.written:
                self.call("free", seq)
        if not self.admit(seq, prompt, extra_key, earlier):
            self.make_room(data)
        else:
            self.maybe_retry(data, "then a refused write again")

    def make_room(self, data: st.DataObject) -> None:
        """What an engine does while a request waits for room: running requests finish, often all of them
        (their blocks join the free queue, cached); as often as not, the cache is trimmed, or reset; often
        another request is served first, taking blocks from the free queue -- each may change the blocks cached
        for the waiting prompt.  Then the waiting request, refused last, is retried, as the head of the waiting
        queue is at the next step."""
        waiting = self.refusals[-1] if self.refusals else None
        running = sorted(self.written)
        finishing = st.just(running) | st.lists(st.sampled_from(running), unique=True) if running else st.just([])
        for seq in data.draw(finishing, label="requests that finish"):
            self.call("free", seq)
        if data.draw(st.booleans(), label="the cache is trimmed"):
            everything = self.manager.model.manager.pool.capacity  # vLLM's reset_prefix_cache
            self.evict(data.draw(st.integers(1, 3) | st.just(everything), label="blocks trimmed"))
        if data.draw(st.sampled_from([True, True, False]), label="another request is served first"):
            _, prompt, extra_key = self.request(data)
            self.serve(data, prompt, extra_key, None)
        if waiting in self.refusals:
            self.retry(waiting)

    @rule(seq=SEQS, data=st.data())
    def append(self, seq: int, data: st.DataObject) -> None:
        """A decode step; then, as often as not, the scheduler retries a write it was refused."""
        self.decode(seq, data, "tokens")
        self.maybe_retry(data, "then a refused write again")

    def decode(self, seq: int, data: st.DataObject, label: str) -> None:
        """A decode step of ``seq``: two in three speculative, if it is running and rollback is offered."""
        running = seq in self.written and self.offers("prefix_caching_manager", speculative.ROLLBACK)
        if running and data.draw(st.sampled_from([True, True, False]), label="speculative"):
            self.decode_speculatively(seq, data)
        else:
            self.write("append", seq, data.draw(self.new_tokens, label=label))

    @rule(data=st.data())
    def serve_request(self, data: st.DataObject) -> None:
        """A whole request, new or earlier: look up, admit, decode, finish -- its full blocks stay cached."""
        self.maybe_retry(data)
        earlier, prompt, extra_key = self.request(data)
        if not self.serve(data, prompt, extra_key, earlier):
            self.make_room(data)
        else:
            self.maybe_retry(data, "then a refused write again")

    def serve(self, data: st.DataObject, prompt: list[int], extra_key: model.ExtraKey, earlier: int | None) -> bool:
        """Admit, forward (commit), decode, forward (commit), finish; whether it was admitted."""
        admitted = self.admit(REQUEST, prompt, extra_key, earlier)
        self.forward(REQUEST)
        self.decode(REQUEST, data, "decoded")
        self.forward(REQUEST)
        self.call("free", REQUEST)
        return admitted

    # -- speculative decoding ------------------------------------------------------------

    @precondition(lambda self: self.offers("prefix_caching_manager", speculative.ROLLBACK))
    @rule(seq=SEQS, data=st.data())
    def speculate(self, seq: int, data: st.DataObject) -> None:
        """A speculative decode step of ``seq`` if it is running with room for a draft, else of the running request
        with the most room (an engine drafts for the requests it can); with none running, ``seq``'s is refused."""
        manager = self.manager.model.manager
        running = sorted(manager.tables, key=lambda s: draft_room(manager, s))
        if running and (seq not in manager.tables or not draft_room(manager, seq)):
            seq = running[-1]
        self.decode_speculatively(seq, data)

    def decode_speculatively(self, seq: int, data: st.DataObject) -> None:
        """Draft tokens appended (registered as they fill blocks, under on_fill), the last j <= k rejected and
        rolled back -- as often as not into a block the draft filled -- then the target's token appended and
        the forward committed.  As often as not, between the draft and its verification another request is
        admitted whose prompt is the drafted sequence's tokens and more: it hits the blocks the draft filled,
        so the rollback reaches into a full block that is registered and shared."""
        manager = self.manager.model.manager
        room = min(draft_room(manager, seq), 2 * self.block_size + 1) if seq in manager.tokens else 1
        if room == 0:
            event("speculate: no room for a draft")
            return
        size = data.draw(draft_sizes(len(manager.tokens.get(seq, ())), room, self.block_size), label="draft size")
        if not self.write("append", seq, data.draw(st.lists(TOKENS, min_size=size, max_size=size), label="draft")):
            return
        if data.draw(st.booleans(), label="a request hits the draft before its verification"):
            self.hit_draft(seq)
        held = len(self.written[seq])
        rejected = data.draw(rejections(held, size, self.block_size), label="rejected")
        before = self.manager.snapshot()
        pending = self.manager.model.pending.get(seq, ())
        if self.call("rollback", seq, rejected):
            after = self.manager.snapshot()
            if self.manager.model.pending.get(seq, ()) != pending:
                event("speculate: rolled back into a pending block")
            self.check(speculative.invariant_rollback_keeps_prefix, before, after, seq, rejected)
            event(rollback_event(before, after, seq))
            if self.write("append", seq, [TARGET_TOKEN]):
                self.check(speculative.invariant_no_write_into_cached_or_shared_block, after, self.manager.snapshot())
        self.forward(seq)

    def hit_draft(self, seq: int) -> None:
        """Admit, in a free slot if there is one, a request whose prompt is ``seq``'s tokens and one more."""
        free = [slot for slot in range(REQUEST) if slot not in self.written]
        if free:
            self.admit(free[0], [*self.written[seq], TARGET_TOKEN], self.extra_keys.get(seq))

    # -- deferred commit ---------------------------------------------------------------

    @property
    def deferred(self) -> bool:
        return self.commit_point == "after_forward"

    def forward(self, seq: int) -> None:
        """The forward over ``seq`` ran: under deferred commit its filled blocks are registered now."""
        if self.deferred:
            pending = bool(self.manager.model.pending.get(seq))
            if self.manager("commit", seq) is not None and pending:
                event("commit registered blocks after the forward")

    @precondition(lambda self: self.deferred)
    @rule(seq=SEQS)
    def commit(self, seq: int) -> None:
        self.forward(seq)

    @precondition(lambda self: self.deferred)
    @rule(data=st.data())
    def abort_request(self, data: st.DataObject) -> None:
        """A request aborted before its forward: admitted, then freed with its blocks still pending."""
        earlier, prompt, extra_key = self.request(data)
        self.admit(REQUEST, prompt, extra_key, earlier)
        if self.manager.model.pending.get(REQUEST):
            event("abort before commit")
        self.call("free", REQUEST)
        if data.draw(st.booleans(), label="the next request in its slot"):  # its blocks, handed out again
            _, prompt, extra_key = self.request(data)
            self.serve(data, prompt, extra_key, None)

    # -- revisiting: the same request again ------------------------------------------

    def request(self, data: st.DataObject) -> tuple[int | None, list[int], model.ExtraKey]:
        """(None, a new prompt, a key), or -- as often, once there is one -- an earlier admission's
        (slot, prompt, key): it meets a cache that has changed since, evicted perhaps.  A new prompt is as
        often the next turn of an earlier conversation (its prompt and more, its key): it hits the earlier
        blocks and needs more, so a full pool refuses it with a cached prefix."""
        if bool(self.admitted) and data.draw(st.booleans(), label="an earlier request"):
            slot, prompt, extra_key, evictions = data.draw(st.sampled_from(self.admitted), label="earlier request")
            if not data.draw(st.booleans(), label="its next turn"):
                if evictions < self.evictions:
                    event("revisit: replayed a prompt after eviction")
                return slot, prompt, extra_key
            return None, prompt + data.draw(self.turns, label="next turn"), extra_key
        return None, data.draw(self.prompts, label="prompt"), self.extra_key(data)

    def admit(self, seq: int, prompt: list[int], extra_key: model.ExtraKey, earlier: int | None = None) -> bool:
        """What a scheduler does: ask what is cached (changing nothing), then add the sequence."""
        if earlier is not None:
            event(f"revisit: re-admitted an earlier prompt in {'the same' if seq == earlier else 'another'} slot")
        self.query_cached_prefix(prompt, extra_key)
        if not self.write("add_sequence", seq, prompt, extra_key):
            return False
        self.admitted.append((seq, prompt, extra_key, self.evictions))
        return True

    def maybe_retry(self, data: st.DataObject, label: str = "a refused write again first") -> None:
        """A scheduler retries its refused requests as it takes new ones -- as often as not."""
        if bool(self.refusals) and data.draw(st.booleans(), label=label):
            self.retry_rejected(data)

    def refused_for_room(self, operation: str, seq: int, args: tuple[object, ...]) -> bool:
        """Whether the model refuses this write for want of room (not as out of contract), and an admission's
        prompt would fit the empty pool (one that never fits, an engine refuses for good)."""
        pool = self.manager.model.manager.pool
        if operation == "add_sequence" and blocks_for(len(args[0]), self.block_size) > pool.capacity:  # type: ignore[arg-type]
            return False
        try:
            getattr(model, operation)(self.manager.model, seq, *args)
        except OutOfBlocks:
            return True
        except KVSpecError:
            return False
        return False

    def cached_blocks(self, operation: str, args: tuple[object, ...]) -> CachedBlocks | None:
        """For an admission, the cached blocks it would share now (its prompt's run of hits, its last block
        aside), each with whether it is free; None for another write, or a malformed one."""
        if operation != "add_sequence":
            return None
        try:
            hits = model.cached_prefix(self.manager.model, *args)  # type: ignore[arg-type]
        except KVSpecError:
            return None
        refcounts = self.manager.model.manager.pool.refcounts
        shared = hits[: max_hit_blocks(len(args[0]), self.block_size)]  # type: ignore[arg-type]
        return tuple((block, refcounts[block] == 0) for block in shared)

    def changed_since(self, refusal: Refusal) -> bool:
        """Whether the refused admission's cached blocks were evicted, or taken from the free queue, since."""
        return refusal.cached is not None and refusal.cached != self.cached_blocks(refusal.operation, refusal.args)

    @precondition(lambda self: self.refusals)
    @rule(data=st.data())
    def retry_rejected(self, data: st.DataObject) -> None:
        """A refused write again as it was -- in its slot (finished first, if another request holds it now), with
        its prompt and key -- as often one whose cached blocks have changed since, if there is one."""
        changed = [refusal for refusal in self.refusals if self.changed_since(refusal)]
        choices = st.sampled_from(self.refusals)
        self.retry(data.draw(st.sampled_from(changed) | choices if changed else choices, label="refused write"))

    def retry(self, refusal: Refusal) -> None:
        self.refusals.remove(refusal)
        event("revisit: retried a rejected call")
        if refusal.operation != "add_sequence":
            self.write(refusal.operation, refusal.seq, *refusal.args)
            return
        if self.changed_since(refusal):
            event("revisit: retried a refused admission after its cached blocks changed")
        if refusal.seq in self.written:
            self.call("free", refusal.seq)
        self.admit(refusal.seq, *refusal.args)  # type: ignore[arg-type]

    @rule(seq=SEQS, append=st.booleans(), data=st.data())
    def malformed(self, seq: int, append: bool, data: st.DataObject) -> None:
        """An add or append with tokens that are not token ids, or an extra key that is not hashable data."""
        tokens = data.draw(st.lists(st.one_of(TOKENS, NOT_TOKENS), max_size=3), label="tokens")
        if append:
            self.write("append", seq, tokens)
            return
        extra_key = data.draw(st.one_of(NOT_EXTRA_KEYS, st.just(None)), label="extra key")
        self.write("add_sequence", seq, tokens, extra_key)

    @precondition(lambda self: self.offers("prefix_caching_manager", block_manager.FORK))
    @rule(parent=SEQS, child=SEQS)
    def fork(self, parent: int, child: int) -> None:
        self.call("fork", parent, child)

    @rule(seq=SEQS, data=st.data())
    def free(self, seq: int, data: st.DataObject) -> None:
        """Finish a request; then, as often as not, the scheduler retries a write it was refused."""
        if self.call("free", seq):
            self.maybe_retry(data, "then a refused write again")

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        """A scheduler's probe; then, as often as not, a refused write again."""
        _, prompt, extra_key = self.request(data)
        self.query_cached_prefix(prompt, extra_key)
        self.maybe_retry(data, "then a refused write again")

    def query_cached_prefix(self, tokens: list[int], extra_key: model.ExtraKey) -> None:
        """What a scheduler asks before admitting (vLLM's get_computed_blocks): it must change nothing."""
        before = self.manager.snapshot()
        answer = self.manager("cached_prefix", tokens, extra_key, judged_by=None)
        if answer is None:
            return
        size = self.block_size
        hashes = self.learn(tuple(tokens), extra_key)
        self.check(model.invariant_hits_stop_at_first_miss, before.pool, hashes, len(answer.actual) * size, size)
        self.check(model.invariant_hit_is_exact_prefix, before.pool, before.contents, answer.actual, tokens, size)
        free_queue = model.abstract(self.manager.model).pool.free_queue  # a lookup is not a use: no block moves
        self.check(block_pool.invariant_eviction_order, free_queue, self.manager.snapshot().pool.free_queue)

    @rule(n=st.integers(-1, 3), data=st.data())
    def evict_and_replay(self, n: int, data: st.DataObject) -> None:
        """Evict cached blocks; then, as often, a refused write again, and serve an earlier request again: a
        shorter hit, or none."""
        self.evict(n)
        self.maybe_retry(data, "then a refused write again")
        if bool(self.admitted) and data.draw(st.booleans(), label="replay an earlier request"):
            earlier, prompt, extra_key, _ = data.draw(st.sampled_from(self.admitted), label="earlier request")
            event("revisit: replayed a prompt after eviction")
            self.serve(data, prompt, extra_key, earlier)

    def evict(self, n: int) -> None:
        before = self.manager.snapshot()
        answer = self.manager("evict", n, judged_by=block_pool.invariant_eviction_order)
        if answer is not None:
            self.evictions += len(answer.actual)
            event("evicted cached blocks" if answer.actual else "nothing to evict")
            after = self.manager.snapshot().pool
            self.check(block_pool.invariant_in_use_never_reclaimed, before.pool, after, answer.actual)

    @rule(data=st.data(), delta=st.sampled_from([1, 1, *TOKEN_WRAPS]))
    def probe_hash_chain(self, data: st.DataObject, delta: int) -> None:
        """Lecture exercise 10: one changed token re-hashes its block and every later one; so does another extra
        key.  The token changes by one or by a wrap of a narrow encoding; the other key is often a near miss."""
        size = self.block_size
        tokens = data.draw(st.lists(TOKENS, min_size=size, max_size=4 * size), label="tokens")
        position = data.draw(st.integers(0, len(tokens) - 1), label="position")
        extra_key = self.extra_key(data)
        other_key = data.draw(st.one_of(st.sampled_from(near_misses(extra_key)), RICH_KEYS), label="other key")
        changed = list(tokens)
        changed[position] = tokens[position] + delta
        self.record(f"manager.block_hashes({tokens}) vs token {position} -> {changed[position]}, vs {other_key!r}")
        original = self.learn(tuple(tokens), extra_key)
        altered = self.learn(tuple(changed), extra_key)
        self.check(model.invariant_hash_change_propagates, original, altered, position // size)
        self.learn(tuple(tokens), other_key)

    # -- after every step ----------------------------------------------------------

    @invariant()
    def matches_spec(self) -> None:
        state = self.manager.snapshot()
        expected = model.abstract(self.manager.model)
        self.check_group(block_manager.STATE, state)
        rename = {block_hash: key for block_hash, key in self.pairs}
        self.check(model.invariant_cached_block_holds_its_prefix, model.rename_hashes(state, rename))
        self.check(block_pool.invariant_eviction_order, expected.pool.free_queue, state.pool.free_queue)
        for seq, tokens in self.written.items():
            self.check(model.invariant_reuse_preserves_read_back, seq, self.manager.impl.read(seq), tokens)
        self.check(block_manager.invariant_manager_refines_spec, model.rename_hashes(state, rename), expected)

    def teardown(self) -> None:
        if hasattr(self, "manager"):
            cached = sum(1 for h in self.manager.model.manager.pool.block_hashes if h is not None)
            event(f"cached blocks at the end: {min(cached, 4)}{'+' if cached >= 4 else ''}")
        super().teardown()


class RealisticPrefixCacheMachine(PrefixCacheMachine):
    """The same rules with blocks of 16 tokens in a pool of 128, where scale bugs live."""

    capacities = st.just(128)
    block_sizes = st.just(16)


class DeferredCommitMachine(PrefixCacheMachine):
    """The same rules, blocks registered only after the forward, with aborts in between."""

    commit_point: model.Commit = "after_forward"
    requires = {"prefix_caching_manager": frozenset({model.DEFERRED_COMMIT})}


TestPrefixCache = conformance_test(PrefixCacheMachine, "prefix cache")
TestDeferredCommit = conformance_test(DeferredCommitMachine, "prefix cache (deferred commit)")
TestRealisticPrefixCache = conformance_test(RealisticPrefixCacheMachine, "prefix cache (realistic)", examples=0.2)


def test_shared_system_prompt_hits_whole_blocks(kv_implementation: Implementation) -> None:
    """Two requests sharing 9 tokens with B = 4: the second reuses 2 full blocks and computes the rest."""
    manager = kv_implementation.prefix_caching_manager(kv_implementation.block_pool(8, "lru"), 4)
    first, second = list(range(9)) + [20, 21, 22], list(range(9)) + [30, 31, 32]
    manager.add_sequence(0, first)
    plan = manager.add_sequence(1, second)
    shared = set(manager.block_table(0)) & set(manager.block_table(1))
    assert (plan.cached_tokens, len(shared)) == (8, 2)
    assert manager.block_table(1)[:2] == manager.block_table(0)[:2]
    assert manager.read(1) == tuple(second)


def test_extra_key_separates_equal_prompts(kv_implementation: Implementation) -> None:
    manager = kv_implementation.prefix_caching_manager(kv_implementation.block_pool(8, "lru"), 4)
    manager.add_sequence(0, list(range(9)), extra_key="adapter-a")
    assert manager.add_sequence(1, list(range(9)), extra_key="adapter-b").cached_tokens == 0
    assert manager.add_sequence(2, list(range(9)), extra_key="adapter-a").cached_tokens == 8


def over_a_pool_keeping_duplicate_hashes() -> Implementation:
    """The zoo's pool that keeps duplicate hashes under the reference managers, declaring it (as vLLM's pool does)."""
    member = load_implementation(f"{broken_prefix_cache.__name__}:keeps_duplicate_hashes")
    return attrs.evolve(member, conventions=Conventions(pool=PoolConventions(duplicate_hash="keep")))


@pytest.mark.parametrize("machine", [PrefixCacheMachine, DeferredCommitMachine])
def test_the_reference_managers_conform_over_a_pool_keeping_duplicate_hashes(machine: type[LockstepMachine]) -> None:
    """A block the pool caches but ``lookup`` does not name (a duplicate, registered second) is cached all the
    same: a commit skips it, and a rollback into it copies it before the next write."""
    outcome = run_machine(machine, over_a_pool_keeping_duplicate_hashes())
    assert not outcome.findings, "\n".join(
        f"{f.tier}: {f.detail}\n    " + "\n    ".join(f.steps) for f in outcome.findings
    )
    assert outcome.statistics.operations["rollback"], "no example rolled back"
