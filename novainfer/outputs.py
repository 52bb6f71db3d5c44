"""What the engine returns for a request, in vLLM's shape."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(Sequence):
    """A sequence's logprobs, one ``{token_id: Logprob}`` per position, kept in flat lists.

    Reads like ``list[dict[int, Logprob]]`` (each position's dict is built when indexed), but
    appending a position creates no container objects: ints, floats and strings are not tracked by
    the cyclic garbage collector, while a dict of ``Logprob`` per token of every running request
    made its passes cost more than the decode step they ran in.

    ``texts_of`` gives the tokens' texts (``Logprob.decoded_token``) when a position is read: the
    alternatives of every position are mostly tokens seen nowhere else, and decoding each when it
    arrives cost more than the step that produced it.
    """

    __slots__ = ("_starts", "_token_ids", "_logprobs", "_ranks", "_texts_of")

    def __init__(self, texts_of: Callable[[Sequence[int]], list[str]] | None = None) -> None:
        self._starts = [0]  # position i holds entries _starts[i]:_starts[i + 1]
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._ranks: list[int] = []
        self._texts_of = texts_of

    def append_position(self, token_ids: list[int], logprobs: list[float], rank: int) -> None:
        """Adds a position: the sampled token (its ``rank`` in the distribution) first, then the
        top alternatives by rank (1, 2, ...); the sampled token is not repeated among them."""
        # Whole-list extends rather than a loop over the entries: this runs for every running request
        # in every step that asks for logprobs.
        self._token_ids += token_ids
        self._logprobs += logprobs
        self._ranks.append(rank)
        self._ranks += range(1, len(token_ids))
        sampled = token_ids[0]
        if token_ids.count(sampled) > 1:  # also among the alternatives: listed once, first
            repeat = len(self._token_ids) - len(token_ids) + token_ids.index(sampled, 1)
            del self._token_ids[repeat], self._logprobs[repeat], self._ranks[repeat]
        self._starts.append(len(self._token_ids))

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
        return {token_id: Logprob(self._logprobs[i], self._ranks[i], text)
                for i, token_id, text in zip(range(start, end), ids, texts)}

    def _slice(self, start: int, stop: int, step: int) -> FlatLogprobs:
        if step != 1:
            raise ValueError(f"FlatLogprobs slices take step 1, got {step}")
        part = FlatLogprobs(self._texts_of)
        stop = max(start, stop)
        lo, hi = self._starts[start], self._starts[stop]
        part._starts = [s - lo for s in self._starts[start:stop + 1]]
        part._token_ids = self._token_ids[lo:hi]
        part._logprobs = self._logprobs[lo:hi]
        part._ranks = self._ranks[lo:hi]
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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
