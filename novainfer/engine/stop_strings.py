"""Stop-string matching on growing text, and how much of it to hold back.

Both helpers assume non-empty stop strings; :class:`OutputTextState` checks
that when a request comes in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """Where a stop string occurs in the text."""

    start: int
    stop: str

    @property
    def end(self) -> int:
        return self.start + len(self.stop)


def find_stop(text: str, stops: Sequence[str], search_start: int = 0) -> StopMatch | None:
    """Returns the first occurrence of any stop string starting at or after ``search_start``.

    The earliest start wins. Among stop strings starting at the same place the
    shortest wins, because it is the one that a token-by-token search would
    have completed first.
    """
    best: StopMatch | None = None
    for stop in stops:
        start = text.find(stop, search_start)
        if start == -1:
            continue
        if best is None or (start, len(stop)) < (best.start, len(best.stop)):
            best = StopMatch(start, stop)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    That suffix may still become a stop string once more text arrives, so it
    must not be streamed yet.
    """
    best = 0
    for stop in stops:
        # A proper prefix is shorter than the stop string, and only suffixes
        # longer than the best so far are worth checking.
        max_len = min(len(stop) - 1, len(text))
        if max_len <= best:
            continue
        # Candidate suffixes begin with the stop string's first character;
        # the leftmost candidate that matches is the longest.
        pos = text.find(stop[0], len(text) - max_len)
        while pos != -1 and len(text) - pos > best:
            if stop.startswith(text[pos:]):
                best = len(text) - pos
                break
            pos = text.find(stop[0], pos + 1)
    return best
