"""Layer 2 conformance: the block manager against ``kvspec.spec.block_manager``'s model.

The machine runs two managers, a "GPU" and a "CPU" one with pools of their
own, and drives add / append / fork / free / read and group moves between
them (swap), valid and invalid, on tiny pools where exhaustion and
copy-on-write are common and on a realistic one.  Every pool invariant is
checked too, with the table entries as the holders of each block.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, consumes, initialize, invariant, multiple, rule

from kvspec.properties.harness import LockstepMachine, conformance_test
from kvspec.spec import block_manager as model
from kvspec.spec import block_pool
from kvspec.spec.block_manager import WritePlan
from kvspec.spec.block_pool import POLICIES

TOKENS = st.integers(0, 9)
NOT_TOKENS = st.sampled_from([-1, 1.5, True, "7", None])
MALFORMED = st.one_of(st.just([]), st.lists(st.one_of(TOKENS, NOT_TOKENS), min_size=1, max_size=3))
PROMPTS = st.lists(TOKENS, min_size=1, max_size=10, unique=True)  # distinct tokens make misplaced data visible
APPENDS = st.lists(TOKENS, max_size=6, unique=True)
DEVICES = st.sampled_from(["gpu", "gpu", "cpu"])
OPERATIONS = st.sampled_from(["append", "fork", "free", "read"])


class BlockManagerMachine(LockstepMachine):
    seqs = Bundle("seqs")
    freed = Bundle("freed")
    gpu_sizes = st.integers(1, 8)
    block_sizes = st.integers(1, 4)

    @initialize(data=st.data(), cpu_blocks=st.integers(1, 6), policy=st.sampled_from(POLICIES))
    def start(self, data: st.DataObject, cpu_blocks: int, policy: str) -> None:
        gpu_blocks = data.draw(self.gpu_sizes, label="gpu_blocks")
        block_size = data.draw(self.block_sizes, label="block_size")
        self.record(
            f"gpu, cpu = managers(gpu_blocks={gpu_blocks}, cpu_blocks={cpu_blocks}, block_size={block_size}, policy={policy!r})"
        )
        self.models = {
            device: model.new_manager(block_size, block_pool.new_pool(blocks, policy))
            for device, blocks in (("gpu", gpu_blocks), ("cpu", cpu_blocks))
        }
        self.managers = {
            device: self.implementation.block_manager(self.implementation.block_pool(blocks, policy), block_size)
            for device, blocks in (("gpu", gpu_blocks), ("cpu", cpu_blocks))
        }
        self.where: dict[int, str] = {}  # live sequence -> the device that holds it
        self.next_id = 0
        self.block_size = block_size

    def fresh_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def write(self, label: str, device: str, spec_call, impl_call) -> WritePlan | None:
        result = self.lockstep(label, spec_call, impl_call, self.managers[device].snapshot)
        if result is None:
            return None
        (self.models[device], expected), actual = result
        self.check("invariant_copy_on_write_exact", expected.copies, actual.copies)
        self.check("invariant_result_matches_spec", expected, actual)
        event("copy-on-write happened" if actual.copies else "write without copy")
        return actual

    def add(self, device: str, prompt: list[int]) -> int | None:
        seq, m = self.fresh_id(), self.managers[device]
        added = self.write(
            f"{device}.add_sequence({seq}, {prompt})",
            device,
            lambda: model.add_sequence(self.models[device], seq, prompt),
            lambda: m.add_sequence(seq, prompt),
        )
        if added is None:
            return None
        self.where[seq] = device
        return seq

    def extend(self, seq: int, tokens: list[int]) -> WritePlan | None:
        device = self.where.get(seq, "gpu")
        m = self.managers[device]
        return self.write(
            f"{device}.append({seq}, {tokens})",
            device,
            lambda: model.append(self.models[device], seq, tokens),
            lambda: m.append(seq, tokens),
        )

    def fork_of(self, parent: int) -> int | None:
        device, child = self.where.get(parent, "gpu"), self.fresh_id()
        m = self.managers[device]
        before = m.snapshot()
        result = self.lockstep(
            f"{device}.fork({parent}, {child})",
            lambda: model.fork(self.models[device], parent, child),
            lambda: m.fork(parent, child),
            m.snapshot,
        )
        if result is None:
            return None
        self.models[device] = result[0]
        self.check("invariant_fork_allocates_nothing", before, m.snapshot(), parent, child)
        self.where[child] = device
        return child

    @rule(target=seqs, device=DEVICES, prompt=PROMPTS)
    def add_sequence(self, device: str, prompt: list[int]):
        seq = self.add(device, prompt)
        return multiple() if seq is None else seq

    @rule(seq=seqs, tokens=APPENDS)
    def append(self, seq: int, tokens: list[int]) -> None:
        self.extend(seq, tokens)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent: int):
        child = self.fork_of(parent)
        return multiple() if child is None else child

    @rule(target=seqs, prompt=PROMPTS, n=st.integers(2, 4))
    def parallel_sampling(self, prompt: list[int], n: int):
        """Lecture exercise 4: a prompt, n - 1 forks of it, then each of the n samples writes a token."""
        parent = self.add("gpu", prompt)
        samples = [parent] if parent is not None else []
        while samples and len(samples) < n and (child := self.fork_of(parent)) is not None:
            self.managers_match_spec()
            samples.append(child)
        plans = []
        for i, sample in enumerate(samples):
            self.managers_match_spec()
            plans.append(self.extend(sample, [10 + i]))
        if len(samples) == n and None not in plans:
            copies = sum(len(plan.copies) for plan in plans)
            self.check("invariant_parallel_sampling_copies", n, len(prompt), self.block_size, copies)
        return multiple(*samples)

    @rule(target=freed, seq=consumes(seqs))
    def free(self, seq: int):
        device = self.where.pop(seq)
        m = self.managers[device]
        result = self.lockstep(
            f"{device}.free({seq})", lambda: model.free(self.models[device], seq), lambda: m.free(seq), m.snapshot
        )
        if result is None:
            return multiple()
        self.models[device] = result[0]
        return seq

    @rule(seq=seqs)
    def read(self, seq: int) -> None:
        device = self.where.get(seq, "gpu")
        m = self.managers[device]
        result = self.lockstep(
            f"{device}.read({seq})", lambda: model.read(self.models[device], seq), lambda: m.read(seq), m.snapshot
        )
        if result is not None:
            self.check("invariant_result_matches_spec", *result)

    @rule(group=st.lists(seqs, unique=True, min_size=1, max_size=3))
    def move_group(self, group: list[int]) -> None:
        src = self.where.get(group[0], "gpu")
        dst = "cpu" if src == "gpu" else "gpu"
        source, target_manager = self.managers[src], self.managers[dst]

        def both_snapshots() -> tuple[object, object]:
            return source.snapshot(), target_manager.snapshot()

        result = self.lockstep(
            f"{src}.move_sequences({dst}, {group})",
            lambda: model.move_sequences(self.models[src], self.models[dst], group),
            lambda: source.move_sequences(target_manager, group),
            both_snapshots,
        )
        if result is not None:
            (self.models[src], self.models[dst], expected), actual = result
            self.check("invariant_result_matches_spec", expected, actual)
            self.where.update(dict.fromkeys(group, dst))
            event(f"moved a group of {len(group)} to the {dst}")

    @rule(seq=seqs, prompt=st.one_of(PROMPTS, MALFORMED), malformed=MALFORMED)
    def invalid_write(self, seq: int, prompt: list, malformed: list) -> None:
        """A prompt for a live id, a malformed prompt for a new id, or malformed tokens to append."""
        device = self.where[seq]
        m, new = self.managers[device], self.fresh_id()
        self.write(
            f"{device}.add_sequence({seq}, {prompt!r})",
            device,
            lambda: model.add_sequence(self.models[device], seq, prompt),
            lambda: m.add_sequence(seq, prompt),
        )
        self.write(
            f"{device}.add_sequence({new}, {malformed!r})",
            device,
            lambda: model.add_sequence(self.models[device], new, malformed),
            lambda: m.add_sequence(new, malformed),
        )
        if malformed:
            self.write(
                f"{device}.append({seq}, {malformed!r})",
                device,
                lambda: model.append(self.models[device], seq, malformed),
                lambda: m.append(seq, malformed),
            )

    @rule(seq=freed, operation=OPERATIONS, device=DEVICES)
    def use_after_free(self, seq: int, operation: str, device: str) -> None:
        m, spec = self.managers[device], self.models[device]
        calls = {
            "append": (lambda: model.append(spec, seq, [1]), lambda: m.append(seq, [1])),
            "fork": (lambda: model.fork(spec, seq, -1), lambda: m.fork(seq, -1)),
            "free": (lambda: model.free(spec, seq), lambda: m.free(seq)),
            "read": (lambda: model.read(spec, seq), lambda: m.read(seq)),
        }
        self.lockstep(f"{device}.{operation}({seq})  # freed", *calls[operation], m.snapshot)

    @invariant()
    def managers_match_spec(self) -> None:
        if not hasattr(self, "managers"):
            return
        for device, manager in self.managers.items():
            state = manager.snapshot()
            holders = model.holders(state.tables)
            self.check("invariant_read_back_exact", state)
            self.check("invariant_waste_bounded", state)
            self.check("invariant_table_length_exact", state)
            self.check("invariant_free_queue_exact", state.pool)
            self.check("invariant_capacity_conserved", state.pool)
            self.check("invariant_no_leak", state.pool, holders)
            self.check("invariant_refcount_matches_holders", state.pool, holders)
            self.check("invariant_hash_map_consistent", state.pool)
            self.check("invariant_manager_refines_spec", state, model.abstract(self.models[device]))


class RealisticBlockManagerMachine(BlockManagerMachine):
    """The same rules with a realistic GPU pool and block size."""

    gpu_sizes = st.just(512)
    block_sizes = st.just(16)


TestBlockManager = conformance_test(BlockManagerMachine)
TestRealisticBlockManager = conformance_test(RealisticBlockManagerMachine, examples=0.2)
