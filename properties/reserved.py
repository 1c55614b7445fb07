"""The names a machine may not define: the harness's own, and Hypothesis's.

A machine that defines one -- a rule named ``record``, ``check``, ``subject`` -- would replace what the
harness calls, and its verdict would be the machine's mistake, not the implementation's.  ``bind`` refuses
such a machine in one line, before anything runs.  A machine sets only the declarations the harness reads
(``OVERRIDABLE``), and keeps its own state in names of its own.
"""

from __future__ import annotations

OVERRIDABLE = frozenset({"uses", "requires", "judges", "recycles_buffers", "teardown"})  # a machine's to set


def names(harness: type) -> frozenset[str]:
    """The names of ``harness`` (the lockstep machine's base) and of Hypothesis's machine: not a machine's."""
    return frozenset(name for name in dir(harness) if not name.startswith("__")) | {"implementation", "statistics"}


def check_names(machine: type, harness: type) -> None:
    """Refuse a machine that defines a name the ``harness`` reserves, before anything runs."""
    own = {name for klass in machine.__mro__ if is_written(klass, harness) for name in vars(klass)}
    clashes = sorted(own & (names(harness) - OVERRIDABLE))
    if clashes:
        raise TypeError(
            f"{machine.__qualname__} defines {', '.join(clashes)}: reserved by LockstepMachine or Hypothesis, rename it"
        )


def is_written(klass: type, harness: type) -> bool:
    """A machine class a person wrote: below ``harness``, not a class ``bind`` made."""
    return issubclass(klass, harness) and klass is not harness and not vars(klass).get("_bound")
