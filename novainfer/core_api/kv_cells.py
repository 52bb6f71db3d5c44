"""KV cell metadata of the low-level API: which sequences own each physical cell, at which position.

A cell is one token's K/V slot in every layer. Its metadata is a logical position and a set of
sequence ids; a cell whose set is empty is free. Physical cells and logical positions are
independent: a cell is wherever a token happened to be stored, and ``kv_seq_add`` changes positions
without moving anything. This module holds only metadata; :class:`novainfer.core_api.Model` moves
K/V and keeps the two consistent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class KvStatus(enum.IntEnum):
    """What a KV operation did (returned, never raised)."""

    OK = 0
    OOM_SLOT = 1  # not enough free cells; nothing changed
    INVALID_SEQ = 2  # a sequence id outside [0, n_seq_max) (or negative where "any" is not allowed)
    INVALID_POS = 3  # the operation would move a position to or past the model's position limit
    EMPTY_RANGE = 4  # [p0, p1) holds no position (p1 <= p0 after normalisation); nothing changed
    INTERNAL_ERROR = 5  # an unexpected failure; metadata is as before the call (see Model.last_error)


@dataclass
class CellInfo:
    """One cell of :meth:`KvCells.dump`."""

    cell: int
    seq_ids: list[int]
    pos: int  # -1 when free
    used: bool


def normalize_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's convention: a negative ``p0`` means 0, a negative ``p1`` means "to the end"."""
    p0 = 0 if p0 < 0 else int(p0)
    p1 = np.iinfo(np.int64).max if p1 < 0 else int(p1)
    return p0, p1


class KvCells:
    """Metadata of ``n_ctx`` cells shared by up to ``n_seq_max`` sequences (no per-sequence quota).

    ``seqs[s, c]`` says whether sequence ``s`` owns cell ``c``; ``pos[c]`` is the cell's position
    (-1 when free). Every decode needs each sequence's cells in position order (its attention
    context, its next position) and most decodes only append to them, so they are kept, row ``s``
    of ``order`` holding sequence ``s``'s ``n_cells[s]`` cells ([n_seq_max, n_ctx] int32, 4 bytes
    per cell and sequence): a decode appends to the rows, any other change marks a row for
    rebuilding when next read and bumps the sequence's ``generation`` (so that copies of a row, the
    captured decode steps' table on the device, know to start over).
    """

    def __init__(self, n_ctx: int, n_seq_max: int) -> None:
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.pos = np.full(n_ctx, -1, dtype=np.int64)
        self.seqs = np.zeros((n_seq_max, n_ctx), dtype=bool)
        self.used = np.zeros(n_ctx, dtype=bool)
        self.order = np.zeros((n_seq_max, n_ctx), dtype=np.int32)
        self.n_cells = np.zeros(n_seq_max, dtype=np.int64)
        self.generation = np.zeros(n_seq_max, dtype=np.int64)
        self._in_order = np.ones(n_seq_max, dtype=bool)
        self._first_free = 0  # every cell below it is used (where the search for free cells starts)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return int(self.used.sum())

    def free_cells(self, n: int) -> np.ndarray:
        """Up to ``n`` free cells, lowest first (searched in chunks from the lowest free cell, so that
        a decode step does not scan the whole cache)."""
        found, start = [], self._first_free
        while start < self.n_ctx and sum(map(len, found)) < n:
            end = min(self.n_ctx, start + max(4 * n, 4096))
            found.append(start + np.flatnonzero(~self.used[start:end]))
            start = end
        free = np.concatenate(found)[:n] if found else np.zeros(0, dtype=np.int64)
        self._first_free = int(free[0]) if len(free) else start
        return free

    def sort(self, seqs: np.ndarray) -> None:
        """Makes ``order`` and ``n_cells`` hold the current cells of ``seqs``."""
        for s in np.unique(seqs[~self._in_order[seqs]]):
            cells = np.flatnonzero(self.seqs[s])
            self.order[s, :len(cells)] = cells[np.argsort(self.pos[cells], kind="stable")]
            self.n_cells[s] = len(cells)
            self._in_order[s] = True

    def seq_cells(self, seq: int) -> np.ndarray:
        """Cells of ``seq`` ordered by position (a view, valid until the cells change)."""
        self.sort(np.array([seq]))
        return self.order[seq, :self.n_cells[seq]]

    def pos_max_of(self, seqs: np.ndarray) -> np.ndarray:
        """The largest position each of ``seqs`` holds (-1 when it holds none)."""
        self.sort(seqs)
        n = self.n_cells[seqs]
        return np.where(n > 0, self.pos[self.order[seqs, np.maximum(n - 1, 0)]], -1)

    def pos_max(self, seq: int) -> int:
        return int(self.pos_max_of(np.array([seq]))[0])

    def pos_min(self, seq: int) -> int:
        cells = self.seq_cells(seq)
        return int(self.pos[cells[0]]) if len(cells) else -1

    def cells_in_range(self, seq: int | None, p0: int, p1: int) -> np.ndarray:
        """Cells owned by ``seq`` (any sequence when None) whose position is in [p0, p1)."""
        owned = self.used if seq is None else self.seqs[seq]
        return np.flatnonzero(owned & (self.pos >= p0) & (self.pos < p1))

    def dump(self, used_only: bool = False) -> list[CellInfo]:
        """Every cell's ``{seq_ids, pos, used}``, for debugging."""
        cells = np.flatnonzero(self.used) if used_only else range(self.n_ctx)
        return [CellInfo(int(c), np.flatnonzero(self.seqs[:, c]).tolist(), int(self.pos[c]), bool(self.used[c]))
                for c in cells]

    # ---- changes -------------------------------------------------------------------------------
    def _touch(self, seqs) -> None:
        self._in_order[seqs] = False
        self.generation[seqs] += 1

    def _refresh_used(self, cells: np.ndarray) -> None:
        self.used[cells] = self.seqs[:, cells].any(axis=0)
        freed = cells[~self.used[cells]]
        self.pos[freed] = -1
        if len(freed):
            self._first_free = min(self._first_free, int(freed.min()))

    def commit(self, cells: np.ndarray, positions: np.ndarray, token_seqs: np.ndarray) -> None:
        """Stores a decoded batch: token ``i`` in cell ``cells[i]`` at ``positions[i]`` owned by the
        sequences of row ``i`` of ``token_seqs`` [T, n_seq_max] (bool).

        The caller has checked that each sequence's new positions exceed its cached ones and increase
        through the batch, so appending keeps each row of ``order`` in position order.
        """
        self.pos[cells] = positions
        self.seqs[:, cells] = token_seqs.T
        self.used[cells] = True
        token, seq = np.nonzero(token_seqs)
        by_seq = np.argsort(seq, kind="stable")  # each sequence's new cells in batch order
        token, seq = token[by_seq], seq[by_seq]
        kept = self._in_order[seq]  # rows waiting for a rebuild get these cells then
        token, seq = token[kept], seq[kept]
        rank = np.arange(len(seq)) - np.searchsorted(seq, seq)  # among the sequence's new cells
        self.order[seq, self.n_cells[seq] + rank] = cells[token]
        appended, counts = np.unique(seq, return_counts=True)
        self.n_cells[appended] += counts

    def remove(self, seq: int | None, cells: np.ndarray) -> None:
        """Takes ``seq`` (every sequence when None) off ``cells``; cells left with none become free."""
        if seq is None:
            self._touch(np.flatnonzero(self.seqs[:, cells].any(axis=1)))
            self.seqs[:, cells] = False
        else:
            self._touch([seq])
            self.seqs[seq, cells] = False
        self._refresh_used(cells)

    def add_seq(self, seq: int, cells: np.ndarray) -> None:
        self._touch([seq])
        self.seqs[seq, cells] = True

    def keep_only(self, seq: int) -> None:
        others = np.ones(self.n_seq_max, dtype=bool)
        others[seq] = False
        self._touch(np.flatnonzero(others))
        self.seqs[others] = False
        self._refresh_used(np.arange(self.n_ctx))

    def move(self, seq: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Moves ``seq``'s ownership of cells ``src`` to the free cells ``dst`` (same positions)."""
        self._touch([seq])
        self.pos[dst] = self.pos[src]
        self.seqs[seq, src] = False
        self.seqs[seq, dst] = True
        self.used[dst] = True
        self._refresh_used(src)

    def shift(self, cells: np.ndarray, delta: int) -> None:
        self._touch(np.flatnonzero(self.seqs[:, cells].any(axis=1)))
        self.pos[cells] += delta

    def clear(self) -> None:
        self.pos[:] = -1
        self.seqs[:] = False
        self.used[:] = False
        self._first_free = 0
        self.n_cells[:] = 0
        self._in_order[:] = True
        self.generation += 1
