"""Stop-string matching on growing text, and how much of it to hold back.

:class:`StopMatcher` is an Aho-Corasick automaton over a request's stop strings: it reads each new
character once, whatever the number of stop strings, so a step costs O(new text) (plus the
matches found) instead of O(stop strings x text). Its state after the text read so far is the
longest suffix of that text that begins some stop string, which is also what must be held back
from streaming. Stop strings must be non-empty; :class:`OutputTextState` checks that when a
request comes in.
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


class StopMatcher:
    """An Aho-Corasick automaton over the stop strings; ``state`` is where the text read so far left it."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._stop_at: list[str | None] = [None]  # the stop string that ends at this node, if any
        for stop in self.stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._stop_at.append(None)
                node = nxt
            self._stop_at[node] = stop
        self._fail = [0] * len(self._goto)
        # The nearest node on the fail chain (excluding the node itself) where a stop string ends.
        self._out = [-1] * len(self._goto)
        queue = list(self._goto[0].values())
        for node in queue:  # breadth first: a node's fail target is always shallower, hence done
            for ch, child in self._goto[node].items():
                fail = self._fail[node]
                while fail and ch not in self._goto[fail]:
                    fail = self._fail[fail]
                target = self._goto[fail].get(ch, 0)
                self._fail[child] = target if target != child else 0
                self._out[child] = target if self._stop_at[target] is not None else self._out[target]
                queue.append(child)
        self.state = 0

    def _step(self, state: int, ch: str) -> int:
        goto, fail = self._goto, self._fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)

    def feed(self, text: str, offset: int, min_start: int = 0) -> StopMatch | None:
        """Reads ``text`` (which starts at ``offset`` in the whole text) from the current state.

        Returns the match that starts earliest (at or after ``min_start``) among those ending in
        ``text``; among matches starting at the same place the shortest wins, because it is the
        one that a token-by-token search would have completed first. After a match the state is
        meaningless (the text is cut there).
        """
        best: StopMatch | None = None
        state = self.state
        for i, ch in enumerate(text):
            end = offset + i + 1
            if best is not None and end - self.max_len > best.start:
                break  # every later match starts after the best one
            state = self._step(state, ch)
            node = state if self._stop_at[state] is not None else self._out[state]
            while node > 0:
                stop = self._stop_at[node]
                start = end - len(stop)
                if start >= min_start and (best is None or (start, len(stop)) < (best.start, len(best.stop))):
                    best = StopMatch(start, stop)
                node = self._out[node]
        self.state = state
        return best

    def partial_len(self) -> int:
        """Length of the longest suffix of the text read that is a proper prefix of a stop string."""
        state = self.state
        while state and not self._goto[state]:  # a leaf is a whole stop string, not a proper prefix
            state = self._fail[state]
        return self._depth[state]


def find_stop(text: str, stops: Sequence[str], search_start: int = 0) -> StopMatch | None:
    """Returns the first occurrence of any stop string starting at or after ``search_start``
    (earliest start first, then shortest)."""
    return StopMatcher(stops).feed(text, 0, search_start)


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    That suffix may still become a stop string once more text arrives, so it must not be
    streamed yet.
    """
    matcher = StopMatcher(stops)
    matcher.feed(text, 0, len(text) + 1)  # no match can start past the end: just move the state
    return matcher.partial_len()
