"""What the engine returns for a request, in vLLM's shape."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import msgspec
import numpy as np


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class StepLogprobs(msgspec.Struct, array_like=True, gc=False):
    """The logprobs of a step's positions, one row per position: how they travel from the model
    runner to the output processor, three byte strings per step whatever the number of requests
    (read back as numpy arrays without a conversion per entry); each request's output refers to its
    rows as ``(block, first row)`` (a request's rows are consecutive).

    Row ``r`` of :meth:`arrays` holds ``width`` token ids (int64) and logprobs (float32): the sampled
    token, then the step's top ``width - 1`` alternatives by rank (which may repeat the sampled
    token; a request that asked for fewer reads fewer); ``ranks[r]`` (int64) is the sampled token's
    rank. Build one with :meth:`of`.
    """

    width: int
    token_ids: bytes
    logprobs: bytes
    ranks: bytes

    @classmethod
    def of(cls, width: int, token_ids: Any, logprobs: Any, ranks: Any) -> StepLogprobs:
        """A block from array-likes: ``token_ids`` and ``logprobs`` with ``width`` entries per row
        (flat or [rows, width]), ``ranks`` one per row."""
        return cls(width, np.ascontiguousarray(token_ids, dtype=np.int64).tobytes(),
                   np.ascontiguousarray(logprobs, dtype=np.float32).tobytes(),
                   np.ascontiguousarray(ranks, dtype=np.int64).tobytes())

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids [rows, width], logprobs [rows, width], ranks [rows]), read-only views of the bytes."""
        return (np.frombuffer(self.token_ids, np.int64).reshape(-1, self.width),
                np.frombuffer(self.logprobs, np.float32).reshape(-1, self.width), np.frombuffer(self.ranks, np.int64))

    def rows(self, first_row: int, count: int, width: int | None = None) -> StepLogprobs:
        """A block of its own holding ``count`` rows from ``first_row``, cut to ``width`` entries each."""
        keep = self.width if width is None else min(width, self.width)
        ids, values, ranks = self.arrays()
        rows = slice(first_row, first_row + count)
        return StepLogprobs.of(keep, ids[rows, :keep], values[rows, :keep], ranks[rows])


def join_rows(first: tuple[StepLogprobs, int, int], then: tuple[StepLogprobs, int, int]) -> StepLogprobs:
    """One block of the rows ``(block, first row, count)`` of ``first`` followed by those of ``then``,
    at the narrower of their widths (both hold every entry their request reads)."""
    width = min(first[0].width, then[0].width)
    parts = [block.rows(row, count, width).arrays() for block, row, count in (first, then)]
    return StepLogprobs.of(width, *(np.concatenate(column) for column in zip(*parts)))


# A sequence's rows of logprobs: (token ids [n, width], logprobs [n, width], ranks [n]).
_Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]


class LogprobsWindow:
    """The rows of recent steps' blocks, in buffers of one width, until the sequences that own them
    copy them out: each step adds its block with one copy, each of its requests notes a row
    number, and a sequence copies all its waiting rows with one gather per column when it is read
    or when the window fills (``MAX_BLOCKS`` steps). Per request and step that is an append, where
    copying each position's entries out of its block cost more host time than the step's sampling.
    """

    MAX_BLOCKS = 64

    def __init__(self) -> None:
        self._width = 0
        self._num_rows = 0
        self._num_blocks = 0
        self._buffers: _Chunk = (np.empty((0, 0), np.int64), np.empty((0, 0), np.float32), np.empty(0, np.int64))
        self._waiting: list[FlatLogprobs] = []  # sequences with rows here (a sequence may appear twice)

    def add(self, block: StepLogprobs) -> int:
        """Takes a step's block; returns the window's row number of its first row."""
        if block.width != self._width or self._num_blocks >= self.MAX_BLOCKS:
            self.flush()
            self._width = block.width
        ids, values, ranks = block.arrays()
        first, end = self._num_rows, self._num_rows + len(ranks)
        if end > len(self._buffers[2]) or self._buffers[0].shape[1] != self._width:
            self._grow(end)
        for buffer, column in zip(self._buffers, (ids, values, ranks)):
            buffer[first:end] = column
        self._num_rows, self._num_blocks = end, self._num_blocks + 1
        return first

    @property
    def width(self) -> int:
        """The entries per row of the blocks it holds now."""
        return self._width

    def wait_for(self, flat: FlatLogprobs) -> None:
        """Notes that ``flat`` has rows here, to copy before the window empties."""
        self._waiting.append(flat)

    def gather(self, rows: list[int], width: int) -> _Chunk:
        """Copies of ``rows`` (window row numbers), cut to ``width`` entries each."""
        ids, values, ranks = self._buffers
        if len(rows) == 1:  # a streamed request reads its one new row every step: no index array
            row = slice(rows[0], rows[0] + 1)
            return ids[row, :width].copy(), values[row, :width].copy(), ranks[row].copy()
        index = np.array(rows)
        return ids[index, :width], values[index, :width], ranks[index]

    def flush(self) -> None:
        """Every waiting sequence copies its rows out, from one gather per column for all of them
        (a gather per sequence and column cost more than the rest of the window's work); the
        window empties."""
        waiting, self._waiting = self._waiting, []
        pending: list[tuple[FlatLogprobs, int, int]] = []
        rows: list[int] = []
        for flat in waiting:
            if flat._waiting_rows:  # a sequence listed twice has none left the second time
                flat_rows, width = flat._take_waiting()
                pending.append((flat, len(flat_rows), width))
                rows += flat_rows
        if pending:
            index = np.array(rows)
            ids, values, ranks = (buffer[index] for buffer in self._buffers)
            end = 0
            for flat, count, width in pending:
                start, end = end, end + count
                # Copies: a view would keep every other sequence's rows of this flush alive.
                flat._add_chunk((ids[start:end, :width].copy(), values[start:end, :width].copy(),
                                 ranks[start:end].copy()))
        self._num_rows = self._num_blocks = 0

    def _grow(self, num_rows: int) -> None:
        """Buffers of the current width for ``num_rows`` rows, holding the rows so far."""
        capacity = max(num_rows, 2 * len(self._buffers[2]), 1024)
        grown = (np.empty((capacity, self._width), np.int64), np.empty((capacity, self._width), np.float32),
                 np.empty(capacity, np.int64))
        if self._num_rows:  # rows are only held at the width they came in (a new width flushes first)
            for new, old in zip(grown, self._buffers):
                new[:self._num_rows] = old[:self._num_rows]
        self._buffers = grown


class FlatLogprobs(Sequence):
    """A sequence's logprobs, one ``{token_id: Logprob}`` per position, kept in numpy chunks.

    Reads like ``list[dict[int, Logprob]]`` (each position's dict is built when indexed), but
    holds a few arrays however long it grows: a dict of ``Logprob`` per token of every running
    request made the garbage collector's passes cost more than the decode step they ran in. Rows
    come from step blocks, directly (:meth:`add_rows`) or through a :class:`LogprobsWindow`
    (:meth:`add_window_rows`), whose rows wait there until this sequence is read; they are copied
    either way (a reference to a block would keep every other request's rows of it alive). Positions
    are stored as they come (the sampled token, then at most ``max_alternatives`` alternatives by
    rank); reading one lists the sampled token once, first, and gives each alternative its rank.

    ``texts_of`` gives the tokens' texts (``Logprob.decoded_token``) when a position is read: the
    alternatives of every position are mostly tokens seen nowhere else, and decoding each when it
    arrives cost more than the step that produced it.
    """

    __slots__ = ("_chunks", "_ends", "_width", "_texts_of", "_window", "_waiting_rows", "_sampled_sum", "_taken_sum")

    def __init__(self, texts_of: Callable[[Sequence[int]], list[str]] | None = None,
                 max_alternatives: int | None = None) -> None:
        self._chunks: list[_Chunk] = []
        self._ends: list[int] = []  # positions up to the end of each chunk
        self._width = None if max_alternatives is None else max_alternatives + 1
        self._texts_of = texts_of
        self._window: LogprobsWindow | None = None
        self._waiting_rows: list[int] = []  # this sequence's rows in its window, in order
        self._sampled_sum = 0.0  # the sampled tokens' logprobs over the positions held
        self._taken_sum = 0.0  # the same over the positions :meth:`take` moved out

    def add_rows(self, block: StepLogprobs, first_row: int, count: int) -> None:
        """Adds ``count`` positions: rows ``first_row`` ... of ``block``."""
        self.copy_waiting_rows()
        ids, values, ranks = block.arrays()
        width = block.width if self._width is None else min(self._width, block.width)
        rows = slice(first_row, first_row + count)
        self._add_chunk((ids[rows, :width].copy(), values[rows, :width].copy(), ranks[rows].copy()))

    def add_window_rows(self, window: LogprobsWindow, first_row: int, count: int) -> None:
        """Adds ``count`` positions: rows ``first_row`` ... of ``window``, copied when this sequence
        is read or the window flushes."""
        if not self._waiting_rows:
            self._window = window
            window.wait_for(self)
        if count == 1:
            self._waiting_rows.append(first_row)
        else:
            self._waiting_rows += range(first_row, first_row + count)

    def copy_waiting_rows(self) -> None:
        """Copies the rows waiting in the window into this sequence."""
        if self._waiting_rows:
            self._add_chunk(self._gather_waiting())

    def _take_waiting(self) -> tuple[list[int], int]:
        """Its rows waiting in its window and the entries it keeps of each; none wait after."""
        rows, window = self._waiting_rows, self._window
        self._waiting_rows, self._window = [], None
        return rows, min(self._width or window.width, window.width)

    def _gather_waiting(self) -> _Chunk:
        window = self._window
        return window.gather(*self._take_waiting())

    def _add_chunk(self, chunk: _Chunk) -> None:
        total = self._sampled_sum
        for value in chunk[1][:, 0].tolist():  # in order, one by one: the same sum however rows were chunked
            total += value
        self._sampled_sum = total
        self._chunks.append(chunk)
        self._ends.append((self._ends[-1] if self._ends else 0) + len(chunk[2]))

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the sampled tokens' logprobs over every position added, taken ones included
        (CompletionOutput's)."""
        self.copy_waiting_rows()
        return self._taken_sum + self._sampled_sum

    def take(self) -> FlatLogprobs:
        """Moves the positions held into a new sequence, which it returns (a streamed request's
        new positions, once per output: what is reported is not kept)."""
        part = FlatLogprobs(self._texts_of)
        part._width = self._width
        if self._chunks:  # positions copied in already (a streamed sequence has none): they come first
            part._chunks, part._ends, part._sampled_sum = self._chunks, self._ends, self._sampled_sum
            self._chunks, self._ends, self._sampled_sum = [], [], 0.0
        if self._waiting_rows:
            part._add_chunk(self._gather_waiting())
        self._taken_sum += part._sampled_sum
        return part

    def append_position(self, token_ids: list[int], logprobs: list[float], rank: int) -> None:
        """Adds a position: the sampled token (its ``rank`` in the distribution) first, then the
        top alternatives by rank (1, 2, ...)."""
        self.add_rows(StepLogprobs.of(len(token_ids), token_ids, logprobs, [rank]), 0, 1)

    def __len__(self) -> int:
        self.copy_waiting_rows()
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob]: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._slice(*index.indices(len(self)))
        length = len(self)
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError(f"position {index} out of range for {length} positions")
        chunk = bisect.bisect_right(self._ends, index)
        ids, values, ranks = self._chunks[chunk]
        row = index - (self._ends[chunk - 1] if chunk else 0)
        ids, values = ids[row].tolist(), values[row].tolist()
        texts = self._texts_of(ids) if self._texts_of is not None else [None] * len(ids)
        entry = {ids[0]: Logprob(values[0], int(ranks[row]), texts[0])}
        for rank in range(1, len(ids)):  # the sampled token keeps its own entry
            entry.setdefault(ids[rank], Logprob(values[rank], rank, texts[rank]))
        return entry

    def _slice(self, start: int, stop: int, step: int) -> FlatLogprobs:
        if step != 1:
            raise ValueError(f"FlatLogprobs slices take step 1, got {step}")
        part = FlatLogprobs(self._texts_of)
        part._width = self._width
        if start == 0 and stop >= len(self):  # the whole sequence: its chunks (never changed) and sum
            part._chunks, part._ends, part._sampled_sum = list(self._chunks), list(self._ends), self._sampled_sum
            return part
        for chunk in range(bisect.bisect_right(self._ends, start), len(self._chunks)):
            begin = self._ends[chunk - 1] if chunk else 0
            if begin >= stop:
                break
            lo, hi = max(start, begin) - begin, min(stop, self._ends[chunk]) - begin
            part._add_chunk(tuple(column[lo:hi] for column in self._chunks[chunk]))
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
