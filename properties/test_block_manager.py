"""Layer 2 conformance: the block manager against ``kvspec.spec.block_manager``'s model.

The machine runs two managers, a "GPU" and a "CPU" one with pools of their
own, and drives add / append / fork / free / read and group moves between
them (swap), valid and invalid, on tiny pools where exhaustion and
copy-on-write are common and on a realistic one.  Every pool invariant is
checked too, with the table entries as the holders of each block.  The
caller keeps a ledger of each manager (``held``): the sequences it holds
there and the tokens it wrote into each, following what the manager carried
out -- the safety rules read it and the manager's own snapshot, never the
model.  A sequence on which an out-of-contract call was carried out stays
held, its tokens no longer vouched for.  The
search revisits: a write refused for want of blocks is retried after a free,
and an earlier prompt is admitted again under a freed sequence id (its slot)
or a new one.  Where the implementation offers ``rollback``, sequences
decode speculatively (``kvspec.spec.speculative``): draft tokens appended, the
rejected ones rolled back -- often into a block that was full, shared by a
fork -- and the target's token appended.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, consumes, initialize, invariant, multiple, precondition, rule

from kvspec.conformance import run_conformance
from kvspec.impl.block_manager import CopyingForkBlockManager
from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import conformance_test
from kvspec.properties.subjects import Answer, Subject
from kvspec.spec import block_manager as model
from kvspec.spec import block_pool, speculative, swap
from kvspec.spec.block_manager import ManagerState, SeqId, WritePlan
from kvspec.spec.components import Offer, every_operation
from kvspec.spec.conventions import Conventions, ManagerConventions
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.implementation import Implementation
from kvspec.spec.invariants import invariant_result_matches_spec

TOKENS = st.integers(0, 9)
NOT_TOKENS = st.sampled_from([-1, 1.5, True, "7", None])
MALFORMED: st.SearchStrategy[list[Any]] = st.one_of(
    st.just([]), st.lists(st.one_of(TOKENS, NOT_TOKENS), min_size=1, max_size=3)
)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=10, unique=True)  # distinct tokens make misplaced data visible
LONG_PROMPTS = st.lists(TOKENS, min_size=4, max_size=10, unique=True)  # a full block at least, at any block size
APPENDS = st.lists(TOKENS, max_size=6, unique=True)
DEVICES = st.sampled_from(["gpu", "gpu", "cpu"])
OPERATIONS = st.sampled_from(["append", "fork", "free", "read", "rollback"])
NOT_COUNTS = st.sampled_from([-1, 1.5, True, None])
TARGET_TOKEN = 10  # what the target decodes after the accepted drafts: no draft token (at most 10, distinct)


def vouched(tokens: object) -> tuple[int, ...] | None:
    """The tokens as the caller wrote them, if they are token ids; None if it cannot say what was written."""
    try:
        return model.check_tokens(tokens, allow_empty=True)
    except InvalidOperation:
        return None


def extended(held: tuple[int, ...] | None, tokens: object) -> tuple[int, ...] | None:
    """A sequence's tokens once ``tokens`` were appended."""
    more = vouched(tokens)
    return None if held is None or more is None else held + more


def rolled_back(held: tuple[int, ...] | None, n: object) -> tuple[int, ...] | None:
    """A sequence's tokens once its last ``n`` were rolled back; None for a rollback out of contract."""
    if held is None or not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(held):
        return None
    return held[: len(held) - n]


def draft_room(manager: model.Manager, seq: SeqId) -> int:
    """How many draft tokens ``seq`` can take now, as an engine caps its draft: the slots left in its last block
    (in a copy, if that block is shared or registered) and every free block's."""
    size, held, pool = manager.block_size, len(manager.tokens[seq]), manager.pool
    free, offset = len(pool.lru), held % size
    if not offset:
        return free * size
    last = manager.tables[seq][-1]
    copies = int(pool.refcounts[last] > 1 or pool.block_hashes[last] is not None)
    return 0 if free < copies else size - offset + (free - copies) * size


def draft_sizes(held: int, room: int, block_size: int) -> st.SearchStrategy[int]:
    """How many tokens the draft model proposes for a sequence of ``held`` tokens with ``room`` for them: as often
    as not just enough to fill its last block, or to fill a block and go past it -- so that a rollback can reach
    into a block the draft filled -- else any number."""
    to_fill = -held % block_size or block_size
    fills = [st.just(size) for size in (to_fill, to_fill + 1) if size <= room]
    return st.one_of(*fills, st.integers(1, room))


def rejections(held: int, drafted: int, block_size: int) -> st.SearchStrategy[int]:
    """How many of the ``drafted`` last of ``held`` tokens verification rejects: any number, or as often one that
    reaches back across the last block boundary into the block before, which the draft had filled."""
    last = held % block_size or block_size  # the tokens in the last block
    if drafted <= last or block_size == 1:
        return st.integers(1, drafted) | st.integers(0, drafted)
    return st.integers(last + 1, min(drafted, last + block_size - 1)) | st.integers(0, drafted)


def rollback_event(before: ManagerState, after: ManagerState, seq: SeqId) -> str:
    """Where a rollback left the sequence's end: across a block boundary or not, and in what kind of block."""
    size, table, kept = after.block_size, after.tables[seq], len(after.tokens[seq])
    where = "across a block boundary" if len(table) < len(before.tables[seq]) else "inside its last block"
    if kept == len(before.tokens[seq]):
        return "speculate: every draft token accepted"
    if kept % size == 0:
        return f"speculate: rolled back {where}, to a block's end"
    if len(before.tokens[seq]) < len(table) * size:
        return f"speculate: rolled back {where}, into a partial block"
    kinds = [
        kind
        for kind, holds in (
            ("registered", before.pool.block_hashes[table[-1]] is not None),
            ("shared", before.pool.refcounts[table[-1]] > 1),
        )
        if holds
    ]
    return f"speculate: rolled back {where}, into a full {' '.join(kinds) or 'private'} block"


class BlockManagerMachine(LockstepMachine):
    uses = frozenset({"block_pool", "block_manager"})
    judges = ("block_manager", "speculative", "block_pool", "invariants")
    seqs = Bundle("seqs")
    freed = Bundle("freed")
    gpu_sizes = st.integers(1, 8)
    block_sizes = st.integers(1, 4)

    @initialize(data=st.data(), cpu_blocks=st.integers(1, 6))
    def start(self, data: st.DataObject, cpu_blocks: int) -> None:
        gpu_blocks = data.draw(self.gpu_sizes, label="gpu_blocks")
        block_size = data.draw(self.block_sizes, label="block_size")
        policy = data.draw(st.sampled_from(self.conventions.pool.policies), label="policy")
        self.record(
            f"gpu, cpu = managers(gpu_blocks={gpu_blocks}, cpu_blocks={cpu_blocks}, block_size={block_size}, policy={policy!r})"
        )
        impl = self.implementation
        self.devices = {
            device: self.subject(
                device,
                (model, speculative, swap),
                model.new_manager(
                    block_pool.new_pool(blocks, policy, self.conventions.pool), block_size, self.conventions.manager
                ),
                impl.block_manager(impl.block_pool(blocks, policy), block_size),
                refinement=(model.invariant_manager_refines_spec, model.abstract),
            )
            for device, blocks in (("gpu", gpu_blocks), ("cpu", cpu_blocks))
        }
        # The caller's ledger of each device: the sequences it holds there, with the tokens it wrote (None: unknown)
        self.held: dict[str, dict[int, tuple[int, ...] | None]] = {device: {} for device in self.devices}
        self.next_id = 0
        self.block_size = block_size
        self.prompts: list[list[int]] = []  # every prompt admitted
        self.freed_ids: list[int] = []
        self.refused: tuple[str, str, int, list] | None = None  # (device, operation, seq, tokens) refused last

    def fresh_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def device_of(self, seq: int) -> Subject:
        """The device whose ledger holds ``seq`` (the GPU, if none does)."""
        return self.devices[next((device for device, held in self.held.items() if seq in held), "gpu")]

    def call(self, device: Subject, operation: str, *args: Any, **how: Any) -> Answer | None:
        """``operation`` on ``device``; what it carried out, the caller's ledger follows."""
        answer = device(operation, *args, **how)
        if answer is not None:
            self.follow(device, operation, args)
        return answer

    def follow(self, device: Subject, operation: str, args: tuple[Any, ...]) -> None:
        """The ledger of ``device`` once it carried out ``operation(*args)``: from the call's own arguments.  A
        second admission of a sequence held, or a write, fork or rollback the caller cannot account for, leaves
        the sequence held with its tokens unknown."""
        held = self.held[device.name]
        match operation, args:
            case "add_sequence", (seq, prompt):
                held[seq] = None if seq in held else vouched(prompt)
            case "append", (seq, tokens):
                held[seq] = extended(held[seq], tokens) if seq in held else None
            case "fork", (parent, child):
                held[child] = None if child in held else held.get(parent)
            case "rollback", (seq, n) if seq in held:
                held[seq] = rolled_back(held[seq], n)
            case "free", (seq,):
                held.pop(seq, None)
            case "move_sequences", (target, group):
                arriving = self.held[target.name]
                for seq in group:
                    tokens = held.pop(seq, None)
                    arriving[seq] = None if seq in arriving else tokens

    def write(self, device: Subject, operation: str, seq: int, tokens: list) -> WritePlan | None:
        """A write, its copies judged before the rest of its plan: a copy too few or too many is what it shows."""
        answer = self.call(device, operation, seq, tokens, judged_by=None)
        if answer is None:
            self.refused = (device.name, operation, seq, tokens)
            return None
        expected, actual = answer.expected, answer.actual
        self.check(model.invariant_copy_on_write_exact, expected.copies, actual.copies, against_model=True)
        self.check(invariant_result_matches_spec, expected, actual, against_model=True)
        event("copy-on-write happened" if actual.copies else "write without copy")
        return actual

    def add(self, device: str, prompt: list[int], seq: int | None = None) -> int | None:
        seq = self.fresh_id() if seq is None else seq
        if self.write(self.devices[device], "add_sequence", seq, prompt) is None:
            return None
        self.prompts.append(prompt)
        return seq

    def retry_refused(self) -> int | None:
        """The last refused write again, as it was; the sequence it added, if any."""
        assert self.refused is not None
        device, operation, seq, tokens = self.refused
        self.refused = None
        event("revisit: retried a rejected call")
        if operation == "add_sequence":
            return self.add(device, tokens, seq)
        self.write(self.devices[device], operation, seq, tokens)
        return None

    def extend(self, seq: int, tokens: list[int]) -> WritePlan | None:
        return self.write(self.device_of(seq), "append", seq, tokens)

    def fork_of(self, parent: int) -> tuple[int, int] | None:
        """Fork ``parent``: the child, and the blocks the fork allocated (the copy a declared convention makes)."""
        device, child = self.device_of(parent), self.fresh_id()
        before = device.snapshot()
        if self.call(device, "fork", parent, child) is None:
            return None
        after = device.snapshot()
        self.check(model.invariant_fork_allocates_nothing, before, after, parent, child, self.conventions.manager)
        return child, before.pool.num_free - after.pool.num_free

    @rule(target=seqs, device=DEVICES, prompt=PROMPTS, data=st.data())
    def add_sequence(self, device: str, prompt: list[int], data: st.DataObject):
        """A new prompt, or an earlier one again (``revisit``); then, as often as not, its first decode step."""
        added = [s for s in [self.add(device, prompt)] if s is not None]
        for seq in added:
            self.maybe_speculate(seq, data)
        return multiple(*self.revisit(data, device), *added)

    def revisit(self, data: st.DataObject, device: str) -> list[int]:
        """Drawn inside every rule that adds sequences, so that swarm testing never turns it off: as often as
        not, the write refused last again, as a scheduler retries its waiting request; as often, an earlier
        prompt again, under a freed id (the slot it had) or a new one.  The sequences it added."""
        added = []
        if self.refused is not None and data.draw(st.booleans(), label="retry the refused write first"):
            added.append(self.retry_refused())
        if bool(self.prompts) and data.draw(st.booleans(), label="an earlier prompt"):
            prompt = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
            vacant = [s for s in self.freed_ids if all(s not in d.model.tables for d in self.devices.values())]
            seq = None
            if bool(vacant) and data.draw(st.booleans(), label="in a freed slot"):
                seq = data.draw(st.sampled_from(vacant), label="freed slot")
            event(f"revisit: re-admitted an earlier prompt in {'the same' if seq is not None else 'another'} slot")
            added.append(self.add(device, prompt, seq))
        return [seq for seq in added if seq is not None]

    @rule(seq=seqs, tokens=APPENDS, data=st.data())
    def append(self, seq: int, tokens: list[int], data: st.DataObject) -> None:
        """A decode step; where rollback is offered, as often as not a speculative one."""
        if not self.maybe_speculate(seq, data):
            self.extend(seq, tokens)

    def maybe_speculate(self, seq: int, data: st.DataObject) -> bool:
        """Two times in three where rollback is offered, a speculative decode step of ``seq``; whether it was one."""
        offered = self.offers("block_manager", speculative.ROLLBACK)
        speculate = offered and data.draw(st.sampled_from([True, True, False]), label="speculative")
        if speculate:
            self.decode_speculatively(seq, data)
        return speculate

    @precondition(lambda self: self.offers("block_manager", model.FORK))
    @rule(target=seqs, parent=seqs, data=st.data())
    def fork(self, parent: int, data: st.DataObject):
        revisited = self.revisit(data, self.device_of(parent).name)
        forked = self.fork_of(parent)
        if forked is not None:
            self.maybe_speculate(forked[0], data)
        return multiple(*revisited, *([] if forked is None else [forked[0]]))

    @precondition(lambda self: self.offers("block_manager", model.FORK))
    @rule(target=seqs, prompt=st.one_of(PROMPTS, LONG_PROMPTS), n=st.integers(2, 4), data=st.data())
    def parallel_sampling(self, prompt: list[int], n: int, data: st.DataObject):
        """Lecture exercise 4: a prompt, n - 1 forks of it, then each of the n samples writes a token.  Its copies
        are those the writes made and the blocks the forks allocated (under ``fork_partial_block="copy"``)."""
        revisited = self.revisit(data, "gpu")
        parent = self.add("gpu", prompt)
        samples = [parent] if parent is not None else []
        copies = 0
        while parent is not None and len(samples) < n and (forked := self.fork_of(parent)) is not None:
            self.managers_match_spec()
            samples.append(forked[0])
            copies += forked[1]
        plans = []
        for i, sample in enumerate(samples):
            self.managers_match_spec()
            plans.append(self.extend(sample, [10 + i]))
        written = [plan for plan in plans if plan is not None]
        if len(samples) == n and len(written) == n:
            copies += sum(len(plan.copies) for plan in written)
            self.check(model.invariant_parallel_sampling_copies, n, len(prompt), self.block_size, copies)
        return multiple(*revisited, *samples)

    @rule(target=freed, seq=consumes(seqs))
    def free(self, seq: int):
        if self.call(self.device_of(seq), "free", seq) is None:
            return multiple()
        self.freed_ids.append(seq)
        return seq

    @rule(seq=seqs)
    def read(self, seq: int) -> None:
        self.device_of(seq)("read", seq)

    @precondition(lambda self: self.offers("block_manager", swap.SWAP))
    @rule(group=st.lists(seqs, unique=True, min_size=1, max_size=3))
    def move_group(self, group: list[int]) -> None:
        source = self.device_of(group[0])
        target = self.devices["cpu" if source.name == "gpu" else "gpu"]
        if self.call(source, "move_sequences", target, group) is not None:
            event(f"moved a group of {len(group)} to the {target.name}")

    @precondition(lambda self: self.offers("block_manager", speculative.ROLLBACK))
    @rule(seq=seqs, data=st.data())
    def speculate(self, seq: int, data: st.DataObject) -> None:
        """A speculative decode step of ``seq``, or as often of a running sequence with room for a draft (an
        engine drafts for the requests it can)."""
        roomy = sorted(s for d, held in self.held.items() for s in held if self.draft_room_of(s, self.devices[d]))
        if bool(roomy) and data.draw(st.booleans(), label="a sequence with room for a draft"):
            seq = data.draw(st.sampled_from(roomy), label="sequence with room")
        self.decode_speculatively(seq, data)

    def draft_room_of(self, seq: int, device: Subject) -> int:
        """The draft tokens ``seq`` can take now; none if it is not live there."""
        return draft_room(device.model, seq) if seq in device.model.tokens else 0

    def decode_speculatively(self, seq: int, data: st.DataObject) -> None:
        """Speculative decoding: k draft tokens appended, the last j <= k rejected by the target model and rolled
        back -- as often as not into a block the draft had filled -- then the target's own token appended."""
        device = self.device_of(seq)
        live = seq in device.model.tokens  # a sequence another rule freed is refused its draft
        room = min(self.draft_room_of(seq, device) if live else 1, 2 * self.block_size + 1, TARGET_TOKEN)
        if room == 0:
            event("speculate: no room for a draft")
            return
        size = data.draw(draft_sizes(len(device.model.tokens.get(seq, ())), room, self.block_size), label="draft size")
        draft = data.draw(st.lists(TOKENS, min_size=size, max_size=size, unique=True), label="draft tokens")
        if self.extend(seq, draft) is None:
            return
        length = len(device.snapshot().tokens.get(seq, ()))  # the model's may have parted from the manager's
        rejected = data.draw(rejections(length, len(draft), self.block_size), label="rejected")
        before = device.snapshot()
        if self.call(device, "rollback", seq, rejected) is None:
            return
        after = device.snapshot()
        self.check(speculative.invariant_rollback_keeps_prefix, before, after, seq, rejected)
        event(rollback_event(before, after, seq))
        if self.extend(seq, [TARGET_TOKEN]) is not None:
            self.check(speculative.invariant_no_write_into_cached_or_shared_block, after, device.snapshot())

    @rule(seq=seqs, prompt=st.one_of(PROMPTS, MALFORMED), malformed=MALFORMED, count=NOT_COUNTS)
    def invalid_write(self, seq: int, prompt: list, malformed: list, count: object) -> None:
        """A prompt for a live id, a malformed prompt for a new id, or malformed tokens to append; a rollback of
        more tokens than the sequence holds, or of a count that is not one."""
        device = self.device_of(seq)
        self.write(device, "add_sequence", seq, prompt)
        self.write(device, "add_sequence", self.fresh_id(), malformed)
        if malformed:
            self.write(device, "append", seq, malformed)
        if self.offers("block_manager", speculative.ROLLBACK) and seq in device.model.tokens:
            self.call(device, "rollback", seq, len(device.model.tokens[seq]) + 1)
            self.call(device, "rollback", seq, count)

    @rule(seq=freed, operation=OPERATIONS, device=DEVICES)
    def use_after_free(self, seq: int, operation: str, device: str) -> None:
        optional = {"fork": model.FORK, "rollback": speculative.ROLLBACK}
        if operation in optional and not self.offers("block_manager", optional[operation]):
            operation = "read"
        arguments = {"append": (seq, [1]), "fork": (seq, -1), "free": (seq,), "read": (seq,), "rollback": (seq, 0)}
        self.call(self.devices[device], operation, *arguments[operation], note="freed")

    @invariant()
    def managers_match_spec(self) -> None:
        for device in self.devices.values():
            state = device.snapshot()
            self.check_group(model.STATE, state, self.held[device.name])
            self.check(model.invariant_manager_refines_spec, state, model.abstract(device.model))


class RealisticBlockManagerMachine(BlockManagerMachine):
    """The same rules with a realistic GPU pool and block size."""

    gpu_sizes = st.just(512)
    block_sizes = st.just(16)


TestBlockManager = conformance_test(BlockManagerMachine, "block manager")
TestRealisticBlockManager = conformance_test(
    RealisticBlockManagerMachine, "block manager (512 blocks of 16)", examples=0.2
)


def copying_fork_reference() -> Implementation:
    """The reference's fork that copies the partial last block at once (``fork_partial_block="copy"``, HF's)."""
    return Implementation(
        name="reference, fork copying the partial block",
        block_manager=Offer(CopyingForkBlockManager, every_operation("block_manager")),
        conventions=Conventions(manager=ManagerConventions(fork_partial_block="copy")),
    )


def test_the_reference_copying_at_fork_conforms() -> None:
    verdict = run_conformance(copying_fork_reference, titled=["block manager"], profile="ci")
    assert verdict.conforms, str(verdict)
