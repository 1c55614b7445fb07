"""Buffer ownership: the caller owns every list it hands over and every list it is handed back.

As an engine that recycles its token buffers and table rows each step does,
a machine (``recycles_buffers``, on by default in every profile) hands the
implementation its list arguments in buffers of its own; right after the call
each buffer is overwritten (every item ``OVERWRITTEN``) and kept for the next
call's list, so one list object carries request after request.  A list the
implementation answers is copied for the caller, watched until the step after
it ends (it must not change under the caller: ``invariant_answer_not_changed_later``)
and then overwritten and reused too.  An implementation that keeps an alias of
either -- or remembers anything by a buffer's identity -- reads another
request's data.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event

OVERWRITTEN = -1  # what the caller writes over a list it has handed over: no token, block or id
Answered = tuple[list[Any], list[Any], str, int]  # a list answered, the caller's copy, the call, the step's calls


class CallerBuffers:
    """The lists one example's caller hands over and is handed back; ``recycles`` off, lists pass as they are."""

    def __init__(self, recycles: bool) -> None:
        self.recycles = recycles
        self.answers: list[Answered] = []  # answered lists still watched
        self._free: list[list[Any]] = []  # lists handed over and overwritten, to carry the next call's
        self._released_at: int | None = None  # calls recorded when the last step ended
        self._recycling_noted = False  # the event of a recycled buffer is recorded once an example

    def lend(self, value: Any, lent: list[list[Any]]) -> Any:
        """``value`` as the implementation gets it: each list (in lists and tuples too) in a reused buffer."""
        if not self.recycles or not isinstance(value, list | tuple):
            return value
        items: list[Any] | tuple[Any, ...] = value
        if any(issubclass(kind, list | tuple) for kind in set(map(type, value))):
            items = [self.lend(item, lent) for item in value]
        if isinstance(value, tuple):
            return tuple(items)
        if self._free and not self._recycling_noted:  # an event is a fact of the example: once is enough
            self._recycling_noted = True
            event("caller recycled a list it had handed over")
        buffer = self._free.pop() if self._free else []
        buffer[:] = items
        lent.append(buffer)
        return buffer

    def overwrite(self, lent: list[list[Any]]) -> None:
        """The caller reuses what it handed over: every item overwritten, each buffer kept for the next call."""
        for buffer in lent:
            buffer[:] = [OVERWRITTEN] * len(buffer)
        self._free += reversed(lent)

    def take_back(self, answer: Any, call: str, calls: int) -> Any:
        """The caller's copy of an answered list; the list itself is watched until the next step ends."""
        if not self.recycles or type(answer) is not list:
            return answer
        self.answers.append((answer, list(answer), call, calls))
        return list(answer)

    def release(self, calls: int) -> None:
        """A step is over (``calls`` made so far): the lists answered before it become buffers of the next calls."""
        if self._released_at is not None:
            released = self._released_at
            for answered, _, _, at in self.answers:
                if at <= released:
                    answered[:] = [OVERWRITTEN] * len(answered)
                    self._free.append(answered)
            self.answers = [entry for entry in self.answers if entry[3] > released]
        self._released_at = calls
