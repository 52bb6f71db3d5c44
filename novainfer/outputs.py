"""What the engine returns for a request, in vLLM's shape."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import msgspec


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class StepLogprobs(msgspec.Struct, array_like=True, gc=False):
    """The logprobs of a step's positions, as columns: how they travel from the model runner to the
    output processor, a few lists per step whatever the number of requests; each request's output
    refers to its rows as ``(block, first row)`` (a request's rows are consecutive).

    Row ``r`` has ``width`` entries of ``token_ids`` and ``logprobs`` from ``r * width``: the
    sampled token, then the step's top ``width - 1`` alternatives by rank (which may repeat the
    sampled token; a request that asked for fewer reads fewer); ``ranks[r]`` is the sampled token's
    rank.
    """

    width: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    def sampled_logprobs(self, first_row: int, count: int) -> list[float]:
        """The sampled tokens' own logprobs at rows ``first_row`` ... ``first_row + count - 1``."""
        width = self.width
        return self.logprobs[first_row * width:(first_row + count) * width:width]

    def rows(self, first_row: int, count: int, width: int | None = None) -> StepLogprobs:
        """A block of its own holding ``count`` rows from ``first_row``, cut to ``width`` entries each."""
        keep = self.width if width is None else min(width, self.width)
        starts = range(first_row * self.width, (first_row + count) * self.width, self.width)
        return StepLogprobs(keep, [t for start in starts for t in self.token_ids[start:start + keep]],
                            [v for start in starts for v in self.logprobs[start:start + keep]],
                            self.ranks[first_row:first_row + count])


def join_rows(first: tuple[StepLogprobs, int, int], then: tuple[StepLogprobs, int, int]) -> StepLogprobs:
    """One block of the rows ``(block, first row, count)`` of ``first`` followed by those of ``then``,
    at the narrower of their widths (both hold every entry their request reads)."""
    width = min(first[0].width, then[0].width)
    a, b = first[0].rows(first[1], first[2], width), then[0].rows(then[1], then[2], width)
    return StepLogprobs(width, a.token_ids + b.token_ids, a.logprobs + b.logprobs, a.ranks + b.ranks)


class FlatLogprobs(Sequence):
    """A sequence's logprobs, one ``{token_id: Logprob}`` per position, kept in flat lists.

    Reads like ``list[dict[int, Logprob]]`` (each position's dict is built when indexed), but
    adding positions creates no container objects: ints, floats and strings are not tracked by the
    cyclic garbage collector, while a dict of ``Logprob`` per token of every running request made
    its passes cost more than the decode step they ran in. A step's positions are added from the
    step's block in a few list operations, however many they are; they are copied (a reference to
    the block would keep every other request's rows of it alive as long as this sequence runs).
    Positions are stored as they come (the sampled token, then at most ``max_alternatives``
    alternatives by rank); reading one lists the sampled token once, first, and gives each
    alternative its rank.

    ``texts_of`` gives the tokens' texts (``Logprob.decoded_token``) when a position is read: the
    alternatives of every position are mostly tokens seen nowhere else, and decoding each when it
    arrives cost more than the step that produced it.
    """

    __slots__ = ("_starts", "_token_ids", "_logprobs", "_ranks", "_width", "_texts_of")

    def __init__(self, texts_of: Callable[[Sequence[int]], list[str]] | None = None,
                 max_alternatives: int | None = None) -> None:
        self._starts = [0]  # position i holds entries _starts[i]:_starts[i + 1]
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._ranks: list[int] = []  # per position: the sampled token's rank
        self._width = None if max_alternatives is None else max_alternatives + 1
        self._texts_of = texts_of

    def add_rows(self, block: StepLogprobs, first_row: int, count: int) -> None:
        """Adds ``count`` positions: rows ``first_row`` ... of ``block``."""
        width = block.width
        if self._width is not None and self._width < width:
            block, first_row, width = block.rows(first_row, count, self._width), 0, self._width
        begin, end = first_row * width, (first_row + count) * width
        offset = len(self._token_ids)
        self._token_ids += block.token_ids[begin:end]
        self._logprobs += block.logprobs[begin:end]
        self._ranks += block.ranks[first_row:first_row + count]
        self._starts += range(offset + width, offset + end - begin + 1, width)

    def append_position(self, token_ids: list[int], logprobs: list[float], rank: int) -> None:
        """Adds a position: the sampled token (its ``rank`` in the distribution) first, then the
        top alternatives by rank (1, 2, ...)."""
        self.add_rows(StepLogprobs(len(token_ids), token_ids, logprobs, [rank]), 0, 1)

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob]: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._slice(*index.indices(len(self)))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"position {index} out of range for {len(self)} positions")
        start, end = self._starts[index], self._starts[index + 1]
        ids = self._token_ids[start:end]
        texts = self._texts_of(ids) if self._texts_of is not None else [None] * len(ids)
        entry = {ids[0]: Logprob(self._logprobs[start], self._ranks[index], texts[0])}
        for rank in range(1, end - start):  # the sampled token keeps its own entry
            entry.setdefault(ids[rank], Logprob(self._logprobs[start + rank], rank, texts[rank]))
        return entry

    def _slice(self, start: int, stop: int, step: int) -> FlatLogprobs:
        if step != 1:
            raise ValueError(f"FlatLogprobs slices take step 1, got {step}")
        part = FlatLogprobs(self._texts_of)
        part._width = self._width
        stop = max(start, stop)
        lo, hi = self._starts[start], self._starts[stop]
        part._starts = [s - lo for s in self._starts[start:stop + 1]]
        part._token_ids = self._token_ids[lo:hi]
        part._logprobs = self._logprobs[lo:hi]
        part._ranks = self._ranks[start:stop]
        return part

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Sequence[dict[int, Logprob]] | None = None  # a FlatLogprobs from the engine
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # What is new since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def snapshot(self) -> RequestMetrics:
        """A copy, for an output to keep the times as they were when it was made (one per request
        per step: ``dataclasses.replace`` costs several times this)."""
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time,
                              self.last_token_time, self.finished_time)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
