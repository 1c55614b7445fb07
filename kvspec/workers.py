"""Judging a verdict's machines in worker processes (``kvspec check --jobs N``, ``run_conformance(jobs=N)``).

Rules:

* Each machine is judged on its own, as a run of its own, sent back as data (``rounds.Judged``);
  the verdict folds those runs in the machines' order, whichever finished
  first.  In one process or in many the same runs are folded the same way, so
  a derandomized verdict (``ci``) is the same whatever the number of workers:
  every process loads every kvspec module before it draws anything
  (``loading.import_every_module``), which makes its examples a fact of the
  source.
* A worker is a fresh interpreter (``spawn``): nothing of the parent's engine
  threads or state is forked into it.  It loads the implementation itself,
  from ``module:factory``, or unpickles the factory it was given; one that
  cannot be sent or loaded is the adapter's error, in one line.
* Ctrl-C is the parent's: workers ignore it, and the parent stops them all at
  once and keeps what finished (``Results.interrupted``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING

import attrs

from kvspec.properties.loading import AdapterError, UsageError, import_every_module, resolve
from kvspec.properties.profiles import hypothesis_files_in_cache

if TYPE_CHECKING:  # the runner's types; at run time the runner hands its functions in
    from kvspec.properties.running import ConformanceTest
    from kvspec.rounds import Judged
    from kvspec.spec.implementation import Implementation

    JudgeMachine = Callable[[Implementation, str, ConformanceTest, str], Judged]


@attrs.frozen
class Plan:
    """What a verdict judges: its implementation, how it was given, its profile, its machines, its workers."""

    path: str
    factory: str | Callable[[], Implementation] | Implementation
    profile: str
    machines: Sequence[ConformanceTest]
    workers: int


@attrs.define
class Results:
    """What the machines that finished judged, by their place in the plan."""

    results: dict[int, Judged] = attrs.field(factory=dict)
    interrupted: bool = False
    interrupted_at: int | None = None  # the machine Ctrl-C stopped, where it is known


def how_many(jobs: int, factory: object, machines: int) -> int:
    """The workers a verdict of ``machines`` machines uses: ``jobs``, never more than its machines; a factory
    object asked to go to workers must survive pickling."""
    if jobs > 1 and machines > 1 and not isinstance(factory, str) and pickling_error(factory):
        raise AdapterError(
            f"{factory!r} cannot be sent to worker processes ({pickling_error(factory)}): give it as "
            "'module:factory', or judge it in this process (jobs=1)"
        )
    return max(1, min(jobs, machines))


def pickling_error(factory: object) -> str:
    try:
        pickle.dumps(factory)
    except Exception as error:  # noqa: BLE001 -- why it cannot be pickled is the message
        return f"{type(error).__name__}: {error}"
    return ""


def judge(plan: Plan, judge_machine: JudgeMachine, progress: Callable[[str], None] | None) -> Results:
    """Judge every machine of ``plan``; Ctrl-C keeps what finished, and the machine it stopped, if one.

    Progress: in this process, each machine as it starts (``[2/26] block manager``); in workers, each as it
    finishes, with why it ended."""
    judged = Results()
    say = progress or (lambda line: None)
    try:
        for index, outcome in judge_each(plan, judge_machine, say):
            if isinstance(outcome, Failed) and outcome.kind == "interrupted":
                judged.interrupted, judged.interrupted_at = True, index
                break
            if isinstance(outcome, Failed):
                raise outcome.error()
            judged.results[index] = outcome
            if plan.workers > 1:
                say(f"[{len(judged.results)}/{len(plan.machines)}] {outcome.machine.machine}: {outcome.machine.ended}")
    except KeyboardInterrupt:
        judged.interrupted = True
    return judged


def judge_each(
    plan: Plan, judge_machine: JudgeMachine, say: Callable[[str], None]
) -> Iterator[tuple[int, Judged | Failed]]:
    """Each machine's run, as it finishes: in this process, one after the other, or in ``plan.workers``."""
    if plan.workers == 1:
        _, implementation = loaded(plan)
        for index, declaration in enumerate(plan.machines):
            try:
                say(f"[{index + 1}/{len(plan.machines)}] {declaration.title}")
                yield index, judge_machine(implementation, plan.path, declaration, plan.profile)
            except KeyboardInterrupt:
                yield index, Failed("interrupted", "")
                return
        return
    ours = set(multiprocessing.active_children())
    executor = ProcessPoolExecutor(
        plan.workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=start_worker,
        initargs=(os.getpid(),),
    )
    say(f"judging {len(plan.machines)} machines in {plan.workers} worker processes")
    try:
        tasks = {
            executor.submit(judge_in_worker, (plan, judge_machine, index)): index for index in range(len(plan.machines))
        }
        for task in as_completed(tasks):
            try:
                yield task.result()
            except BrokenProcessPool:
                title = plan.machines[tasks[task]].title
                raise AdapterError(
                    f"{plan.path}: a worker process died while judging machine {title!r}: the implementation ended "
                    "its interpreter (a crash in native code, os._exit)"
                ) from None
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        for worker in set(multiprocessing.active_children()) - ours:  # a machine may run for minutes yet
            worker.terminate()


def start_worker(parent: int) -> None:
    """A worker leaves Ctrl-C to the parent, and dies with it: a verdict killed (not interrupted) leaves no worker
    judging on (Linux: the parent's death signals it; elsewhere the pool's own shutdown is all there is)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1  # noqa: N806 -- the constant's name in <sys/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was asked for
            os._exit(1)


@attrs.frozen
class Failed:
    """What went wrong in a worker, sent back to be raised in the parent."""

    kind: str  # "adapter", "usage", "crash", or "interrupted" (the implementation raised KeyboardInterrupt)
    message: str

    def error(self) -> Exception:
        if self.kind == "adapter":
            return AdapterError(self.message)
        if self.kind == "usage":
            return UsageError(self.message)
        return RuntimeError(f"kvspec's worker process failed:\n{self.message}")


_LOADED: dict[str, tuple[str, Implementation]] = {}  # a worker's implementation, loaded at its first task


def loaded(plan: Plan) -> tuple[str, Implementation]:
    """The implementation of ``plan``, loaded once per process: every module first, as the parent did."""
    if plan.path not in _LOADED:
        import_every_module()
        _LOADED[plan.path] = resolve(plan.factory)
    return _LOADED[plan.path]


def judge_in_worker(task: tuple[Plan, JudgeMachine, int]) -> tuple[int, Judged | Failed]:
    """A worker's task: one machine of the plan, judged; its errors sent back, never raised here."""
    plan, judge_machine, index = task
    declaration = plan.machines[index]
    try:
        with contextlib.redirect_stdout(sys.stderr), hypothesis_files_in_cache():
            _, implementation = loaded(plan)
            return index, judge_machine(implementation, plan.path, declaration, plan.profile)
    except KeyboardInterrupt:  # raised by the implementation itself: Ctrl-C is ignored here
        return index, Failed("interrupted", "")
    except AdapterError as error:
        return index, Failed("adapter", str(error))
    except UsageError as error:
        return index, Failed("usage", str(error))
    except Exception:  # noqa: BLE001 -- kvspec's own failure, shown whole in the parent
        return index, Failed("crash", traceback.format_exc())
