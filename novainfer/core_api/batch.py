"""The input of :meth:`novainfer.core_api.Model.decode`: llama.cpp's ``llama_batch`` as numpy arrays.

A batch is a struct of arrays, preallocated for ``capacity`` tokens and filled in place by the
caller; only the first ``n_tokens`` entries are read. Token ``i`` is ``token[i]`` at position
``pos[i]`` in the sequences ``seq_id[i][:n_seq_id[i]]``, and the decode produces a logits row for it
when ``logits[i]`` is set. ``pos`` may be None: each token then goes right after what its sequences
hold (see :meth:`Model.decode`). Arrays are validated by ``decode``, which returns -1 and names
the field on bad input.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


class Batch:
    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity (n_tokens) must be >= 1, got {capacity}")
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        self.token = np.zeros(capacity, dtype=np.int64)
        self.pos: np.ndarray | None = np.zeros(capacity, dtype=np.int64)
        self.n_seq_id = np.zeros(capacity, dtype=np.int32)
        self.seq_id = np.zeros((capacity, n_seq_max), dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=bool)
        self.n_tokens = 0

    @classmethod
    def init(cls, n_tokens: int, n_seq_max: int = 1) -> Batch:
        """An empty batch with room for ``n_tokens`` tokens of up to ``n_seq_max`` sequences each."""
        return cls(n_tokens, n_seq_max)

    @classmethod
    def get_one(cls, tokens: Sequence[int]) -> Batch:
        """``tokens`` of sequence 0 at the positions after what it holds; logits for the last one."""
        ids = np.asarray(tokens)
        if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"tokens: expected a non-empty sequence of integer token ids, got {tokens!r}")
        batch = cls(len(ids))
        batch.token[:] = ids
        batch.pos = None
        batch.n_seq_id[:] = 1
        batch.logits[len(tokens) - 1:len(tokens)] = True
        batch.n_tokens = len(tokens)
        return batch

    @property
    def capacity(self) -> int:
        return len(self.token)

    def add(self, token: int, pos: int, seq_ids: Sequence[int], logits: bool = False) -> None:
        """Appends one token (llama.cpp's ``common_batch_add``)."""
        i = self.n_tokens
        if not isinstance(token, numbers.Integral) or not isinstance(pos, numbers.Integral):
            raise ValueError(f"token and pos must be integers, got token={token!r}, pos={pos!r}")
        if i >= self.capacity:
            raise ValueError(f"n_tokens: the batch is full ({self.capacity} tokens)")
        if not 1 <= len(seq_ids) <= self.seq_id.shape[1]:
            raise ValueError(f"seq_ids: a token needs 1 to {self.seq_id.shape[1]} sequence ids "
                             f"(the batch's n_seq_max), got {list(seq_ids)}")
        if self.pos is None:
            raise ValueError("pos: this batch has no pos array (get_one); it cannot take explicit positions")
        self.token[i] = token
        self.pos[i] = pos
        self.n_seq_id[i] = len(seq_ids)
        self.seq_id[i, :len(seq_ids)] = seq_ids
        self.logits[i] = logits
        self.n_tokens = i + 1

    def clear(self) -> None:
        """Empties the batch (flags too, so that a refill starts from no outputs)."""
        self.n_tokens = 0
        self.logits[:] = False
