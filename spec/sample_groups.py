"""Layer 4, sequence groups whose samples finish at different times (parallel sampling, vLLM §4.4).

Rules (the records, the model and the phases are ``kvspec.spec.scheduler``'s, ``kvspec.spec.preemption``'s and
``kvspec.spec.admission``'s; this module states what they do with a group of ``n`` samples that finish apart):

* A request's samples share its prompt: its full prompt blocks are forked
  into every sample (reference count ``n``), and each sample writes its own
  tokens after them.  Sample ``s`` samples its stop token after
  ``request.output_length(s)`` tokens (``Request.stops``; ``max_new_tokens``
  for every sample when there are none) -- a stand-in for the model's stop
  token, known to the decode that samples it and to nobody before.
* **A sample that finishes frees its sequence at once.**  Its private blocks
  go back to the pool; the prompt blocks it shares lose one holder and stay
  with the others.  The group's other samples keep decoding, one token each
  per step (the step's grant for the group is its number of unfinished
  samples), and the group finishes with its last sample.
* **What is preempted and restored is what is still running.**  A partly
  finished group is swapped out and in, or dropped and prefilled again, as
  its unfinished samples only (``Group.seqs``): recompute forks the prompt
  into them alone and writes each one's sampled tokens again.  A finished
  sample's output is the user's already: it is never resumed.
* Admission still refuses a request whose every sample at ``max_new_tokens``
  exceeds the GPU: no engine knows its stops in advance.  Deadlock freedom
  is unchanged (``kvspec.spec.preemption``): a group's samples finish by
  ``max_new_tokens``.

Theory.  A group's live samples all have the same length (they decode in
lockstep), so the blocks it takes are ``group_blocks`` with its live samples
for ``n``: a swap moves exactly its live samples' distinct blocks, and a
recompute prefills exactly their tokens.  The invariants below, beside the
preemption chapter's (``invariant_group_on_one_device``: every unfinished
sample is on the group's device; ``invariant_recompute_restores_tokens`` and
``invariant_swap_restores_contents``: each reads back its own tokens), say
that a re-admitted partly finished group restores exactly its unfinished
samples' tokens and nothing of the others.

Invariants (tier in brackets):

* ``invariant_finished_sample_holds_nothing`` [safety] -- a sample that
  reached its output length has no sequence on either device.
"""

from __future__ import annotations

from kvspec.spec.invariants import invariant
from kvspec.spec.scheduler import SchedulerState, devices


@invariant(
    "a finished sample's output is the user's: blocks it still holds serve nobody, are swapped and recomputed "
    "with its group, and a sample resumed past its stop token writes output after the end",
    "safety",
)
def invariant_finished_sample_holds_nothing(state: SchedulerState) -> str | None:
    for group in state.groups:
        finished = [(group.request.request_id, s) for s in range(group.request.n) if s not in group.live]
        for name, manager in devices(state).items():
            held = [seq for seq in finished if seq in manager.tables]
            if held:
                return f"request {group.request.request_id!r}'s samples {held} finished, yet {name} holds them"
    return None
