"""Every broken scheduler of the zoo is caught, each by the invariant named here."""

from __future__ import annotations

import pytest

from kvspec.properties.meta.teeth import assert_caught
from kvspec.properties.test_scheduler import DeadlockFreedomMachine, SchedulerMachine, SwapSchedulerMachine

ZOO = {
    "kvspec.impl.broken.scheduler:preempts_oldest": (SchedulerMachine, "invariant_oldest_never_preempted"),
    "kvspec.impl.broken.scheduler:swaps_part_of_group": (SwapSchedulerMachine, "invariant_group_on_one_device"),
    "kvspec.impl.broken.scheduler:forgets_to_free_on_recompute": (
        SchedulerMachine,
        "invariant_no_leak_across_preemption",
    ),
    "kvspec.impl.broken.scheduler:admits_out_of_order": (SchedulerMachine, "invariant_admission_in_arrival_order"),
    "kvspec.impl.broken.scheduler:waits_forever_on_too_large": (SchedulerMachine, "invariant_verdict_matches_spec"),
    "kvspec.impl.broken.scheduler:never_preempts": (DeadlockFreedomMachine, "invariant_finishes_within_bound"),
}


@pytest.mark.parametrize("factory", sorted(ZOO))
def test_broken_scheduler_is_caught(factory: str) -> None:
    machine, invariant = ZOO[factory]
    assert_caught(machine, factory, invariant)
