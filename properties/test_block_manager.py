"""Layer 2 conformance: the block manager against ``kvspec.spec.block_manager``'s model.

The machine runs two managers, a "GPU" and a "CPU" one with pools of their
own, and drives add / append / fork / free / read and group moves between
them (swap), valid and invalid, on tiny pools where exhaustion and
copy-on-write are common and on a realistic one.  Every pool invariant is
checked too, with the table entries as the holders of each block.  The
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

from kvspec.properties.harness import LockstepMachine, Subject, conformance_test
from kvspec.spec import block_manager as model
from kvspec.spec import block_pool, speculative
from kvspec.spec.block_manager import ManagerState, SeqId, WritePlan

TOKENS = st.integers(0, 9)
NOT_TOKENS = st.sampled_from([-1, 1.5, True, "7", None])
MALFORMED: st.SearchStrategy[list[Any]] = st.one_of(
    st.just([]), st.lists(st.one_of(TOKENS, NOT_TOKENS), min_size=1, max_size=3)
)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=10, unique=True)  # distinct tokens make misplaced data visible
APPENDS = st.lists(TOKENS, max_size=6, unique=True)
DEVICES = st.sampled_from(["gpu", "gpu", "cpu"])
OPERATIONS = st.sampled_from(["append", "fork", "free", "read", "rollback"])
NOT_COUNTS = st.sampled_from([-1, 1.5, True, None])
TARGET_TOKEN = 10  # what the target decodes after the accepted drafts: no draft token (at most 10, distinct)


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
                (model, speculative),
                model.new_manager(block_pool.new_pool(blocks, policy, self.conventions.pool), block_size),
                impl.block_manager(impl.block_pool(blocks, policy), block_size),
            )
            for device, blocks in (("gpu", gpu_blocks), ("cpu", cpu_blocks))
        }
        self.where: dict[int, str] = {}  # live sequence -> the device that holds it
        self.next_id = 0
        self.block_size = block_size
        self.prompts: list[list[int]] = []  # every prompt admitted
        self.freed_ids: list[int] = []
        self.refused: tuple[str, str, int, list] | None = None  # (device, operation, seq, tokens) refused last

    def fresh_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def device_of(self, seq: int) -> Subject:
        return self.devices[self.where.get(seq, "gpu")]

    def write(self, device: Subject, operation: str, seq: int, tokens: list) -> WritePlan | None:
        answer = device(operation, seq, tokens)
        if answer is None:
            self.refused = (device.name, operation, seq, tokens)
            return None
        self.check(model.invariant_copy_on_write_exact, answer.expected.copies, answer.actual.copies)
        event("copy-on-write happened" if answer.actual.copies else "write without copy")
        return answer.actual

    def add(self, device: str, prompt: list[int], seq: int | None = None) -> int | None:
        seq = self.fresh_id() if seq is None else seq
        if self.write(self.devices[device], "add_sequence", seq, prompt) is None:
            return None
        self.where[seq] = device
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

    def fork_of(self, parent: int) -> int | None:
        device, child = self.device_of(parent), self.fresh_id()
        before = device.snapshot()
        if device("fork", parent, child) is None:
            return None
        self.check(model.invariant_fork_allocates_nothing, before, device.snapshot(), parent, child)
        self.where[child] = device.name
        return child

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
        offered = self.offers("block_manager", "rollback")
        speculate = offered and data.draw(st.sampled_from([True, True, False]), label="speculative")
        if speculate:
            self.decode_speculatively(seq, data)
        return speculate

    @precondition(lambda self: self.offers("block_manager", "fork"))
    @rule(target=seqs, parent=seqs, data=st.data())
    def fork(self, parent: int, data: st.DataObject):
        revisited = self.revisit(data, self.where.get(parent, "gpu"))
        child = self.fork_of(parent)
        if child is not None:
            self.maybe_speculate(child, data)
        return multiple(*revisited, *([] if child is None else [child]))

    @precondition(lambda self: self.offers("block_manager", "fork"))
    @rule(target=seqs, prompt=PROMPTS, n=st.integers(2, 4), data=st.data())
    def parallel_sampling(self, prompt: list[int], n: int, data: st.DataObject):
        """Lecture exercise 4: a prompt, n - 1 forks of it, then each of the n samples writes a token."""
        revisited = self.revisit(data, "gpu")
        parent = self.add("gpu", prompt)
        samples = [parent] if parent is not None else []
        while parent is not None and len(samples) < n and (child := self.fork_of(parent)) is not None:
            self.managers_match_spec()
            samples.append(child)
        plans = []
        for i, sample in enumerate(samples):
            self.managers_match_spec()
            plans.append(self.extend(sample, [10 + i]))
        written = [plan for plan in plans if plan is not None]
        if len(samples) == n and len(written) == n:
            copies = sum(len(plan.copies) for plan in written)
            self.check(model.invariant_parallel_sampling_copies, n, len(prompt), self.block_size, copies)
        return multiple(*revisited, *samples)

    @rule(target=freed, seq=consumes(seqs))
    def free(self, seq: int):
        device = self.device_of(seq)
        self.where.pop(seq, None)
        if device("free", seq) is None:
            return multiple()
        self.freed_ids.append(seq)
        return seq

    @rule(seq=seqs)
    def read(self, seq: int) -> None:
        self.device_of(seq)("read", seq)

    @precondition(lambda self: self.offers("block_manager", "swap"))
    @rule(group=st.lists(seqs, unique=True, min_size=1, max_size=3))
    def move_group(self, group: list[int]) -> None:
        source = self.device_of(group[0])
        target = self.devices["cpu" if source.name == "gpu" else "gpu"]
        if source("move_sequences", target, group) is not None:
            self.where.update(dict.fromkeys(group, target.name))
            event(f"moved a group of {len(group)} to the {target.name}")

    @precondition(lambda self: self.offers("block_manager", "rollback"))
    @rule(seq=seqs, data=st.data())
    def speculate(self, seq: int, data: st.DataObject) -> None:
        """A speculative decode step of ``seq``, or as often of a running sequence with room for a draft (an
        engine drafts for the requests it can)."""
        roomy = sorted(s for s, d in self.where.items() if self.draft_room_of(s, self.devices[d]))
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
        held = len(device.model.tokens[seq])
        rejected = data.draw(rejections(held, len(draft), self.block_size), label="rejected")
        before = device.snapshot()
        if device("rollback", seq, rejected) is None:
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
        if self.offers("block_manager", "rollback") and seq in device.model.tokens:
            device("rollback", seq, len(device.model.tokens[seq]) + 1)
            device("rollback", seq, count)

    @rule(seq=freed, operation=OPERATIONS, device=DEVICES)
    def use_after_free(self, seq: int, operation: str, device: str) -> None:
        if operation in ("fork", "rollback") and not self.offers("block_manager", operation):
            operation = "read"
        arguments = {"append": (seq, [1]), "fork": (seq, -1), "free": (seq,), "read": (seq,), "rollback": (seq, 0)}
        self.devices[device](operation, *arguments[operation], note="freed")

    @invariant()
    def managers_match_spec(self) -> None:
        for device in self.devices.values():
            state = device.snapshot()
            self.check_group(model.STATE, state)
            self.check(model.invariant_manager_refines_spec, state, model.abstract(device.model))


class RealisticBlockManagerMachine(BlockManagerMachine):
    """The same rules with a realistic GPU pool and block size."""

    gpu_sizes = st.just(512)
    block_sizes = st.just(16)


TestBlockManager = conformance_test(BlockManagerMachine)
TestRealisticBlockManager = conformance_test(RealisticBlockManagerMachine, examples=0.2)
