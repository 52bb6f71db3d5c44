"""N-gram (prompt lookup) proposals: continue a request the way its own text continued before.

For each request, the longest suffix of its tokens (``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens) that also occurs earlier in its prompt or output is looked up, and
the tokens that followed its most recent earlier occurrence are proposed, ``num_speculative_tokens``
of them. Editing, summarization and code often copy their input, and greedy outputs that cycle
repeat themselves, so such proposals are often accepted.

Where the continuation runs into the request's newest token, the copy goes on overlapping itself,
as an LZ77 back-reference does: the occurrence lies d tokens before the suffix, so the proposal
repeats the last d tokens with period d (token i of the proposal is the token at ``start + i % d``,
``start`` being where the continuation begins). An output cycling with period p thus proposes k
tokens rather than min(k, p).

The search runs over the whole batch at once as array operations, with no loop over requests or
tokens: one comparison per suffix position, each over every request's whole history. The host
keeps each request's tokens in a row of a persistent table (:class:`NgramProposer`) and writes
only its new tokens into it after each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from novainfer.spec_decode.config import SpeculativeConfig


@dataclass
class Proposals:
    """Draft tokens per request: row b proposes ``token_ids[b, :num_tokens[b]]`` (the rest is -1)."""

    token_ids: np.ndarray  # [B, k] int64
    num_tokens: np.ndarray  # [B] int64: k, or 0 where no suffix occurred earlier


def propose_ngram(token_ids: np.ndarray, num_tokens: np.ndarray, min_n: int, max_n: int, k: int) -> Proposals:
    """Proposals for a batch whose row b holds ``num_tokens[b]`` known tokens (prompt, then output)
    at the start of ``token_ids`` [B, W] (the rest of the row is ignored).

    A longer matching suffix wins over a shorter one; among equally long matches, the most recent.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    batch, width = token_ids.shape
    lengths = num_tokens.astype(np.int64, copy=False)
    rows = np.arange(batch)
    # Candidate c: a continuation starting at token c, after an occurrence that ends at c - 1.
    # match[b, c]: how many of row b's last tokens (up to max_n) the tokens before c repeat.
    match = np.zeros((batch, width), dtype=np.int64)
    run = np.ones((batch, width), dtype=bool)
    for j in range(max_n):
        suffix_token = token_ids[rows, np.maximum(lengths - 1 - j, 0)]
        run[:, :j + 1] = False  # no token j + 1 places before c
        run[:, j + 1:] &= token_ids[:, :width - 1 - j] == suffix_token[:, None]
        match += run
    candidates = np.arange(width)
    # An earlier occurrence (the suffix itself ends at length - 1), at least min_n tokens long.
    usable = (candidates[None, :] < lengths[:, None]) & (match >= min_n)
    score = np.where(usable, match * width + candidates, -1)  # the longest, then the most recent
    start = score.argmax(axis=1)
    found = score[rows, start] >= 0
    period = np.maximum(lengths - start, 1)
    index = start[:, None] + np.arange(k)[None, :] % period[:, None]
    drafts = np.where(found[:, None], token_ids[rows[:, None], index], -1).astype(np.int64, copy=False)
    return Proposals(drafts, np.where(found, k, 0))


@dataclass
class _Row:
    index: int  # row of the history table
    tokens: list[int]  # the request's token list (the same object: a reused request id is noticed)
    num_written: int  # leading tokens already in the row


class NgramProposer:
    """N-gram proposals for a changing set of requests, from a token-history table on the host that
    keeps a row per request: each call writes only the tokens a request got since the last one
    (token lists only grow), not the whole lists. Rows of requests absent from a call are freed."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n, self.k = (config.prompt_lookup_min, config.prompt_lookup_max,
                                          config.num_speculative_tokens)
        self._table = np.zeros((0, 0), dtype=np.int32)
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = []

    def propose(self, request_ids: Sequence[str], token_lists: Sequence[list[int]],
                num_ahead: Sequence[int] | None = None) -> list[list[int]]:
        """Drafts for each request, whose known tokens (prompt, then output) are ``token_lists``.
        ``num_ahead``: per request, how many tokens after its known ones are still being sampled;
        its drafts follow the lookup's continuation past that many tokens (guesses of them)."""
        for stale in self._rows.keys() - set(request_ids):
            self._free.append(self._rows.pop(stale).index)
        lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
        width = int(lengths.max(initial=1))
        self._reserve(len(request_ids), width)
        rows = np.fromiter((self._write(rid, tokens) for rid, tokens in zip(request_ids, token_lists)),
                           dtype=np.int64, count=len(request_ids))
        ahead = num_ahead or [0] * len(request_ids)
        proposals = propose_ngram(self._table[rows, :width], lengths, self.min_n, self.max_n,
                                  self.k + max(ahead, default=0))
        return [row[skip:skip + self.k] if num else []
                for row, num, skip in zip(proposals.token_ids.tolist(), proposals.num_tokens.tolist(), ahead)]

    def _reserve(self, num_requests: int, length: int) -> None:
        """Grows the table (doubling) to hold ``num_requests`` rows of ``length`` tokens."""
        height, width = self._table.shape
        needed_rows = len(self._rows) + num_requests  # at most: some may have rows already
        if needed_rows <= height and length <= width:
            return
        new_height = max(2 * height, needed_rows, 8) if needed_rows > height else height
        new_width = max(2 * width, length, 256) if length > width else width
        grown = np.zeros((new_height, new_width), dtype=np.int32)
        grown[:height, :width] = self._table
        self._free += range(new_height - 1, height - 1, -1)
        self._table = grown

    def _write(self, request_id: str, tokens: list[int]) -> int:
        """The request's row, with its new tokens written."""
        row = self._rows.get(request_id)
        if row is None or row.tokens is not tokens:  # new, or a reused id of a request since freed
            if row is not None:
                self._free.append(row.index)
            row = self._rows[request_id] = _Row(self._free.pop(), tokens, 0)
        end = len(tokens)
        if end > row.num_written:
            self._table[row.index, row.num_written:end] = tokens[row.num_written:end]
            row.num_written = end
        return row.index
