"""Captured decode steps of the low-level API: one new token for each of B sequences, replayed from CUDA graphs.

A batch whose every token belongs to exactly one sequence, no sequence having two (one step of B
streams: the common case), is the engine's decode step with blocks of one cell, and runs through
the engine's :class:`~novainfer.worker.cuda_graphs.StepGraphs` (decode graphs by padded batch size).
A graph reads:

* a static step buffer: each row's token id, position, new cell and context length with the new
  token, refilled and copied to the device in one piece per call;
* ``block_tables`` ([max_batch, width + 1] int32 on the device, ``width = min(n_ctx,
  max_position_embeddings)``): row ``b`` holds the cells, by position, of the sequence that batch
  row ``b`` decoded last, as :attr:`KvCells.order` does on the host. The graph appends each row's
  new cell itself, so a run of decodes of the same sequences in the same order uploads nothing;
  a row whose sequence changed, or whose cells changed otherwise (a ``kv_seq_*`` operation, an
  eager decode), is brought up to date before the replay, from where it stopped agreeing. Padding
  rows write only the last column, which no row reads.

The graphs cost the activations of the largest batch plus the table's ``max_batch * (width + 1) * 4``
bytes; ``memory_bytes`` reports both. A sequence of more than ``width - 1`` cells (possible only
when ``kv_seq_add`` made positions overlap) decodes eagerly. On a CPU, :class:`StepGraphs`
emulates the graphs (each replay runs the step eagerly on the same static inputs), which tests
this path against the eager one.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from novainfer.attention import AttentionBackend, AttentionMetadata
from novainfer.core_api.kv_cells import KvCells
from novainfer.worker.cuda_graphs import GraphKey, StepGraphs, cudagraph_capture_sizes

logger = logging.getLogger(__name__)

# Rows of the step buffer; a padding row has no KV slot and an empty context.
_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens")
_INPUT_IDS, _POSITIONS, _SLOT_MAPPING, _SEQ_LENS = range(len(_FIELDS))


class CellDecodeGraphs:
    """Decode steps of up to ``max_batch`` sequences of at most ``max_seq_len`` tokens over ``cells``,
    captured for ``model``."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, cells: KvCells, device: torch.device,
                 max_batch: int, max_seq_len: int) -> None:
        self.model = model
        self.backend = backend
        self.cells = cells
        self.device = device
        self.max_batch = max_batch
        self.width = min(cells.n_ctx, max_seq_len)
        on_cuda = device.type == "cuda"
        with torch.inference_mode(False):  # normal tensors: updated in place from any mode
            self._host = torch.zeros((len(_FIELDS), max_batch), dtype=torch.int64, pin_memory=on_cuda)
            self._inputs = self._host.to(device) if on_cuda else self._host
            self._rows = torch.arange(max_batch, device=device)
            self._query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros((max_batch, self.width + 1), dtype=torch.int32, device=device)
        self._host_np = self._host.numpy()
        self._copied = torch.cuda.Event() if on_cuda else None  # the host buffer may be refilled after it
        # Row b of block_tables holds entries [0, _row_len[b]) of sequence _row_seq[b]'s cells, as of
        # that sequence's generation _row_gen[b].
        self._row_seq = np.full(max_batch, -1, dtype=np.int64)
        self._row_gen = np.zeros(max_batch, dtype=np.int64)
        self._row_len = np.zeros(max_batch, dtype=np.int64)
        self._graphs = StepGraphs()
        self._metadata: dict[GraphKey, AttentionMetadata] = {}  # alive as long as the graphs (workspaces)
        self.memory_bytes = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the decode graphs of every padded batch size up to ``max_batch``."""
        started = time.perf_counter()
        on_cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if on_cuda else 0
        self._fill_padding(0, self.max_batch)
        self._copy_inputs()
        sizes = cudagraph_capture_sizes(self.max_batch)
        try:
            self._graphs.capture([GraphKey("decode", b) for b in sizes], self._run_step, self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(f"capturing the decode graphs (batch sizes up to {self.max_batch}) ran out of device "
                               f"memory; pass enforce_eager=True, or a smaller max_cudagraph_capture_size") from exc
        table_bytes = self.block_tables.numel() * self.block_tables.element_size()
        self.memory_bytes = (torch.cuda.memory_reserved(self.device) - before if on_cuda else 0) + table_bytes
        logger.info("captured %d decode graphs (batch sizes %s) in %.1f s, holding %.1f MiB of device memory "
                    "with their cell tables", len(sizes), sizes, time.perf_counter() - started,
                    self.memory_bytes / 2**20)

    def _run_step(self, key: GraphKey) -> torch.Tensor:
        """The captured step of ``key.size`` rows: final hidden states [rows, hidden]."""
        rows = key.size
        input_ids, positions, slots, seq_lens = self._inputs[:, :rows].unbind()
        block_tables = self.block_tables[:rows]
        # Each row's new cell goes after its context; a padding row's (seq_len 0) in the unread last column.
        columns = (seq_lens - 1).remainder(self.width + 1)
        block_tables.index_put_((self._rows[:rows], columns), slots.to(torch.int32))
        metadata = AttentionMetadata(
            num_tokens=rows, num_seqs=rows, block_size=1, max_query_len=1, max_seq_len=self.width,
            query_start_loc=self._query_start_loc[:rows + 1], seq_lens=seq_lens.to(torch.int32),
            block_tables=block_tables, slot_mapping=slots, query_lens_cpu=None, seq_lens_cpu=None,
            backend=self.backend)
        self._metadata[key] = metadata
        self.backend.prepare(metadata)
        return self.model(input_ids, positions, metadata)

    def can_run(self, seqs: np.ndarray) -> bool:
        """Whether a decode step of ``seqs`` (distinct, one token each) fits the captured graphs."""
        if len(seqs) > self.max_batch:
            return False
        self.cells.sort(seqs)
        return bool((self.cells.n_cells[seqs] < self.width).all())

    def run(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, cells: np.ndarray) -> torch.Tensor:
        """Token ``i`` of sequence ``seqs[i]`` at ``positions[i]``, stored in ``cells[i]`` (a step that
        :meth:`can_run`): the final hidden states [len(tokens), hidden] of a graph replay (valid until
        the next one)."""
        n = len(tokens)
        key = self._graphs.padded_key("decode", n)
        self._sync_rows(seqs)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's inputs have left the host buffer
        host = self._host_np
        host[_INPUT_IDS, :n] = tokens
        host[_POSITIONS, :n] = positions
        host[_SLOT_MAPPING, :n] = cells
        host[_SEQ_LENS, :n] = self.cells.n_cells[seqs] + 1
        self._fill_padding(n, key.size)
        self._copy_inputs()
        return self._graphs.replay(key)[:n]

    def committed(self, num_rows: int) -> None:
        """The step just run is committed: the cells its graph appended on the device are the host's too."""
        self._row_len[:num_rows] += 1

    def _fill_padding(self, start: int, end: int) -> None:
        host = self._host_np
        host[:, start:end] = 0
        host[_SLOT_MAPPING, start:end] = -1

    def _copy_inputs(self) -> None:
        if self._copied is not None:
            self._inputs.copy_(self._host, non_blocking=True)
            self._copied.record()

    def _sync_rows(self, seqs: np.ndarray) -> None:
        """Uploads the cells rows ``[0, len(seqs))`` lack for their new sequences (none in a run of
        decodes of the same sequences)."""
        kv, n = self.cells, len(seqs)
        generation = kv.generation[seqs]
        stale = (self._row_seq[:n] != seqs) | (self._row_gen[:n] != generation)
        self._row_len[:n][stale] = 0
        self._row_seq[:n], self._row_gen[:n] = seqs, generation
        start, end = self._row_len[:n], kv.n_cells[seqs]
        behind = np.flatnonzero(start < end)
        if not len(behind):
            return
        counts = end[behind] - start[behind]
        row = np.repeat(behind, counts)
        col = np.repeat(start[behind] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        flat = torch.from_numpy(row * self.block_tables.shape[1] + col).to(self.device)
        values = torch.from_numpy(kv.order[seqs[row], col]).to(self.device)
        self.block_tables.view(-1).index_copy_(0, flat, values)
        self._row_len[behind] = end[behind]
