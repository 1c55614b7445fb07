"""The transcript of an example: the same calls must be answered the same.

A binding keeps, for every history of calls and answers its examples made, the
answer the implementation gave next.  An implementation that answers the same
calls differently in two examples of one run answers by something other than
the calls -- a background thread, the clock, a global -- so no finding on it
can be replayed: that is its finding (``AnsweredDifferently``), never a flaky
test of Hypothesis's.
"""

from __future__ import annotations

import re

ADDRESS = re.compile(r"0x[0-9a-fA-F]+")  # an object's address in its repr: never part of what it answered


class AnsweredDifferently(AssertionError):
    """The implementation answered the same calls differently in two examples of one run: its answers depend on
    something other than the calls (time, a thread, a global), so no finding on it can be replayed."""

    def __init__(self, call: str, first: str, second: str, steps: tuple[str, ...]) -> None:
        once, again = around_the_difference(first, second)
        super().__init__(f"{call} answered {once} after these calls once, and {again} after the same calls again")
        self.call, self.first, self.second, self.steps = call, first, second, steps


def around_the_difference(first: str, second: str, context: int = 60) -> tuple[str, str]:
    """Two long answers shown where they start to differ."""
    differing = (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    start = next(differing, min(len(first), len(second)))
    cut = max(0, start - context // 2)

    def shown(text: str) -> str:
        head, tail = ("..." if cut else ""), ("..." if len(text) > cut + context else "")
        return head + text[cut : cut + context] + tail

    return shown(first), shown(second)


class Transcript:
    """One example's calls and answers, held against every earlier example of the same binding."""

    def __init__(self, answers: dict[int, str]) -> None:
        self._answers = answers  # the binding's: the answer given after each history of calls
        self._history = 0  # the calls made and answered so far in this example, hashed

    def called(self, call: str) -> None:
        self._history = hash((self._history, call))

    def answered(self, call: str, answer: object, error: BaseException | None, steps: list[str]) -> None:
        """Note what ``call`` answered after the calls before it (``steps``); raise ``AnsweredDifferently`` where
        another example answered the same history otherwise."""
        told = f"raised {type(error).__name__}" if error is not None else repr(answer)
        if "0x" in told:  # an address, maybe: the regular expression only where it can match
            told = ADDRESS.sub("0x?", told)
        first = self._answers.setdefault(self._history, told)
        if first != told:
            raise AnsweredDifferently(call, first, told, tuple(steps))
        self._history = hash((self._history, told))
