"""``Model``: one loaded model, its KV cells and its last outputs, driven llama.cpp-style.

The model is the engine's own (the registry's class, filled by the engine's loader); only the KV
cache differs: ``n_ctx`` cells shared by all sequences instead of the engine's per-request blocks.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from novainfer.attention import AttentionMetadata
from novainfer.attention.backends.selector import get_attn_backend
from novainfer.config import ModelConfig, resolve_device
from novainfer.core_api.attention import CellMask, MaskedCellAttention, find_rotaries, rotate_keys
from novainfer.core_api.batch import Batch
from novainfer.core_api.graphs import CellDecodeGraphs
from novainfer.core_api.kv_cells import CellInfo, KvCells, KvStatus, normalize_range
from novainfer.model_loader import load_model
from novainfer.model_loader.loader import _expected_checkpoint_names, _map_name

logger = logging.getLogger(__name__)

# decode's return codes (llama.cpp's)
DECODE_OK = 0
DECODE_NO_KV_SLOT = 1
DECODE_ABORTED = 2
DECODE_INVALID = -1
DECODE_FATAL = -3

ATTENTION_CHOICES = ("auto", "torch", "sdpa", "triton", "masked")


class _InvalidInput(ValueError):
    pass


class _Aborted(Exception):
    pass


@dataclass
class _Step:
    """A validated batch."""

    tokens: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    token_seqs: np.ndarray  # [T, n_seq_max] bool
    first_seq: np.ndarray  # [T] the first sequence id of each token
    single_seq: bool  # every token in exactly one sequence
    decode_only: bool  # single_seq, and no sequence has two tokens (a captured decode step can run it)
    output_ids: np.ndarray  # batch indices of the tokens with logits


def _read_arrays(batch: Batch, n: int) -> dict[str, np.ndarray]:
    """The first ``n`` entries of each of the batch's arrays (``pos`` only when present), checked to
    be integer (or bool) arrays of the right rank that hold ``n`` tokens."""
    fields = {"token": (batch.token, 1), "n_seq_id": (batch.n_seq_id, 1), "seq_id": (batch.seq_id, 2),
              "logits": (batch.logits, 1)}
    if batch.pos is not None:
        fields["pos"] = (batch.pos, 1)
    arrays = {}
    for field, (value, ndim) in fields.items():
        array = value.numpy(force=True) if isinstance(value, torch.Tensor) else np.asarray(value)
        if array.ndim != ndim or not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
            raise _InvalidInput(f"{field}: expected a {ndim}-d integer array, got dtype {array.dtype} "
                                f"with shape {array.shape}")
        if len(array) < n:
            raise _InvalidInput(f"n_tokens: {n} tokens but {field} holds only {len(array)}")
        arrays[field] = array[:n]
    return arrays


def _on(device: torch.device, array: np.ndarray, dtype=None) -> torch.Tensor:
    """A host array copied to ``device`` (as ``dtype`` when given)."""
    array = np.ascontiguousarray(array if dtype is None else array.astype(dtype))
    return torch.from_numpy(array).to(device, non_blocking=True)


class Model:
    """A model with ``n_ctx`` KV cells, decoding llama.cpp-style batches (see the README's
    "Low-level model interface"). Build it with :meth:`from_pretrained`."""

    def __init__(self, model: nn.Module, hf_config, device: torch.device, dtype: torch.dtype, *, n_ctx: int,
                 n_seq_max: int, n_batch: int | None, attention: str, enforce_eager: bool = False,
                 max_cudagraph_capture_size: int = 512) -> None:
        if n_ctx < 1:
            raise ValueError(f"n_ctx (KV cells) must be >= 1, got {n_ctx}")
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        if max_cudagraph_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {max_cudagraph_capture_size}")
        self.model = model
        self.config = hf_config
        self.device = device
        self.dtype = dtype
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_batch = n_ctx if n_batch is None else n_batch
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {n_batch}")
        self.n_vocab = int(hf_config.vocab_size)
        self.max_position = int(hf_config.max_position_embeddings)
        self.cells = KvCells(n_ctx, n_seq_max)
        self._paged = None if attention == "masked" else get_attn_backend(
            device, None if attention == "auto" else attention)
        self._masked = MaskedCellAttention()
        self._layers = model.attention_layers()
        self._rotaries = find_rotaries(model)
        for layer in self._layers:
            shape = (n_ctx, 1, layer.num_kv_heads, layer.head_size)
            layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.register_forward_pre_hook(self._check_abort)
        self._abort_callback: Callable[[], bool] | None = None
        self.last_error: str | None = None
        self.last_token_cells: list[int] = []  # cell of each token of the last successful decode
        self._no_logits = torch.zeros(0, self.n_vocab, dtype=torch.float32, device=device)
        self._reset_outputs()
        self._graphs: CellDecodeGraphs | None = None
        if not enforce_eager and self._paged is not None and self._can_capture():
            self._graphs = CellDecodeGraphs(model, self._paged, self.cells, device,
                                            min(n_seq_max, self.n_batch, max_cudagraph_capture_size),
                                            self.max_position)
            self._graphs.capture()

    def _can_capture(self) -> bool:
        """Whether decode steps can be captured: CUDA, with a paged backend that supports it."""
        return self.device.type == "cuda" and getattr(self._paged, "supports_cuda_graphs", False)

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay captured graphs (see :meth:`from_pretrained`)."""
        return self._graphs is not None

    @property
    def graph_memory_bytes(self) -> int:
        """Device memory the captured decode steps hold (0 without them)."""
        return self._graphs.memory_bytes if self._graphs is not None else 0

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto",
                        n_ctx: int = 4096, n_seq_max: int = 64, n_batch: int | None = None,
                        attention: str = "auto", enforce_eager: bool = False,
                        max_cudagraph_capture_size: int = 512) -> Model:
        """Loads a Hugging Face model directory with the engine's registry and loader.

        ``n_ctx``: KV cells (tokens cached over all sequences); ``n_seq_max``: sequence ids are
        ``0 .. n_seq_max - 1``; ``n_batch``: most tokens per decode (default ``n_ctx``);
        ``attention``: ``auto`` (single-sequence batches through the device's engine backend, the
        rest masked), ``torch``/``triton`` (that backend for those batches) or ``masked`` (always).

        On CUDA with the Triton backend, decode steps (every token in its own sequence) of up to
        ``min(n_seq_max, n_batch, max_cudagraph_capture_size)`` tokens are captured as CUDA graphs
        here, once (logged, with the memory they hold: ``graph_memory_bytes``); ``enforce_eager``
        runs every batch eagerly instead.
        """
        torch_device = resolve_device(device)
        model_config = ModelConfig(str(model_dir), dtype=dtype, device=torch_device)
        model = load_model(model_config.model, model_config.hf_config, model_config.torch_dtype, torch_device)
        return cls(model, model_config.hf_config, torch_device, model_config.torch_dtype, n_ctx=n_ctx,
                   n_seq_max=n_seq_max, n_batch=n_batch, attention=attention, enforce_eager=enforce_eager,
                   max_cudagraph_capture_size=max_cudagraph_capture_size)

    # ---- decode --------------------------------------------------------------------------------
    def set_abort_callback(self, callback: Callable[[], bool] | None) -> None:
        """``callback()`` is asked before the batch and before each layer's attention (a captured
        decode step: before the batch only); True aborts the decode (it returns 2 and nothing is
        committed)."""
        self._abort_callback = callback

    def _check_abort(self, *_) -> None:
        if self._abort_callback is not None and self._abort_callback():
            raise _Aborted

    def decode(self, batch: Batch) -> int:
        """Computes the batch's tokens and stores their K/V; returns llama.cpp's code.

        0: done, logits of the flagged tokens readable. 1: not enough free cells for the batch
        (nothing changed; free some with ``kv_seq_rm``/``kv_seq_keep``). 2: aborted by the abort
        callback (nothing committed). -1: invalid batch, ``last_error`` names the field. -3: the
        forward pass failed (``last_error`` says how; nothing committed). Outputs of the previous
        decode are dropped by every call.
        """
        self.last_error = None
        self._reset_outputs()
        try:
            step = self._validate(batch)
        except _InvalidInput as exc:
            self.last_error = str(exc)
            return DECODE_INVALID
        num_tokens = len(step.tokens)
        cells = self.cells.free_cells(num_tokens)
        if len(cells) < num_tokens:
            self.last_error = (f"no KV slot: the batch needs {num_tokens} free cells, {len(cells)} of "
                               f"n_ctx={self.n_ctx} are free")
            return DECODE_NO_KV_SLOT
        use_graph = self._graphs is not None and step.decode_only and self._graphs.can_run(step.first_seq)
        try:
            self._check_abort()
            with torch.inference_mode():
                logits = self._forward(step, cells, use_graph)
        except _Aborted:
            self.last_error = "aborted by the abort callback"
            return DECODE_ABORTED
        except Exception as exc:  # reported as a code, as llama.cpp does; the cells stay as they were
            logger.exception("decode failed")
            self.last_error = f"decode failed: {type(exc).__name__}: {exc}"
            return DECODE_FATAL
        self.cells.commit(cells, step.positions, step.token_seqs)
        if use_graph:
            self._graphs.committed(num_tokens)
        self.last_token_cells = cells.tolist()
        self._logits = logits
        self._output_ids = step.output_ids
        self._output_row = np.full(num_tokens, -1, dtype=np.int64)
        self._output_row[step.output_ids] = np.arange(len(step.output_ids))
        return DECODE_OK

    def _validate(self, batch: Batch) -> _Step:
        n = batch.n_tokens
        if not isinstance(n, numbers.Integral) or not 1 <= n <= self.n_batch:
            raise _InvalidInput(f"n_tokens: must be an integer in [1, n_batch={self.n_batch}], got {n!r}")
        arrays = _read_arrays(batch, n)
        tokens = arrays["token"].astype(np.int64)
        bad = np.flatnonzero((tokens < 0) | (tokens >= self.n_vocab))
        if len(bad):
            raise _InvalidInput(f"token[{bad[0]}] = {tokens[bad[0]]} is outside the vocabulary [0, {self.n_vocab})")
        n_seq_id, seq_id = arrays["n_seq_id"], arrays["seq_id"]
        token_seqs = self._sequence_sets(n_seq_id, seq_id)
        logits = arrays["logits"].astype(bool)
        if not logits.any():
            raise _InvalidInput("logits: no token of the batch has its logits flag set; set it for at least one")
        positions = self._positions(arrays.get("pos"), token_seqs, n_seq_id, seq_id)
        single_seq = bool((n_seq_id == 1).all())
        decode_only = single_seq and int(token_seqs.sum(axis=0).max()) == 1
        return _Step(tokens, positions, token_seqs, seq_id[:, 0].astype(np.int64), single_seq, decode_only,
                     np.flatnonzero(logits))

    def _sequence_sets(self, n_seq_id: np.ndarray, seq_id: np.ndarray) -> np.ndarray:
        """[T, n_seq_max] bool: the sequences of each token, checked."""
        width = seq_id.shape[1]
        bad = np.flatnonzero((n_seq_id < 1) | (n_seq_id > width))
        if len(bad):
            raise _InvalidInput(f"n_seq_id[{bad[0]}] = {n_seq_id[bad[0]]} is outside [1, {width}]")
        listed = np.arange(width)[None, :] < n_seq_id[:, None]
        known = listed & (seq_id >= 0) & (seq_id < self.n_seq_max)
        token_seqs = np.zeros((len(n_seq_id), self.n_seq_max), dtype=bool)
        row, col = np.nonzero(known)
        token_seqs[row, seq_id[row, col]] = True
        # A token with an unknown id, or one id twice, has fewer sequences than it lists.
        bad = np.flatnonzero(token_seqs.sum(axis=1) != n_seq_id)
        if len(bad):
            i = bad[0]
            raise _InvalidInput(f"seq_id[{i}] = {seq_id[i, :n_seq_id[i]].tolist()}: sequence ids must be distinct "
                                f"and in [0, n_seq_max={self.n_seq_max})")
        return token_seqs

    def _positions(self, pos: np.ndarray | None, token_seqs: np.ndarray, n_seq_id: np.ndarray,
                   seq_id: np.ndarray) -> np.ndarray:
        """Each token's position (given, or right after its sequences' last); checked to increase
        through the batch for every sequence and to follow what the sequence holds."""
        token, seq = np.nonzero(token_seqs)
        by_seq = np.argsort(seq, kind="stable")
        token, seq = token[by_seq], seq[by_seq]  # (token, sequence) pairs, each sequence's in batch order
        first = np.ones(len(seq), dtype=bool)
        first[1:] = seq[1:] != seq[:-1]
        group = np.cumsum(first) - 1
        held = self.cells.pos_max_of(seq[first])[group]  # what the pair's sequence held before the batch
        if pos is not None:
            positions = pos.astype(np.int64)
        elif len(seq) == len(token_seqs):  # one sequence per token: count on from what each holds
            positions = np.empty(len(seq), dtype=np.int64)
            positions[token] = held + 1 + np.arange(len(seq)) - np.flatnonzero(first)[group]
        else:
            positions = self._chained_positions(token_seqs, dict(zip(seq.tolist(), held.tolist())))
        previous = np.where(first, held, positions[np.roll(token, 1)])
        out_of_order = positions[token] <= previous
        out_of_range = (positions < 0) | (positions >= self.max_position)
        bad = np.concatenate([np.flatnonzero(out_of_range), token[out_of_order]])
        if not len(bad):
            return positions
        i = int(bad.min())
        if out_of_range[i]:
            raise _InvalidInput(f"pos[{i}] = {positions[i]} is outside [0, {self.max_position}) (the model's "
                                f"max_position_embeddings)")
        after = dict(zip(seq[out_of_order & (token == i)].tolist(), previous[out_of_order & (token == i)].tolist()))
        s = next(s for s in seq_id[i, :n_seq_id[i]].tolist() if s in after)
        raise _InvalidInput(f"pos[{i}] = {positions[i]} for sequence {s} is not after its previous position "
                            f"{after[s]}: a sequence's positions must increase through the batch and follow "
                            f"kv_seq_pos_max")

    @staticmethod
    def _chained_positions(token_seqs: np.ndarray, last: dict[int, int]) -> np.ndarray:
        """Missing positions of a batch with tokens in several sequences: each token goes right after
        the latest of its sequences' positions so far (``last``: what each held before the batch)."""
        positions = np.empty(len(token_seqs), dtype=np.int64)
        for i, row in enumerate(token_seqs):
            ids = np.flatnonzero(row).tolist()
            positions[i] = p = max(last[s] for s in ids) + 1
            last.update((s, p) for s in ids)
        return positions

    def _forward(self, step: _Step, cells: np.ndarray, use_graph: bool) -> torch.Tensor:
        """Runs the model over the batch; returns float32 logits of ``step.output_ids`` in that order."""
        if use_graph:
            hidden = self._graphs.run(step.tokens, step.positions, step.first_seq, cells)
            rows = step.output_ids
        else:
            if self._paged is not None and step.single_seq:
                metadata, order = self._paged_metadata(step, cells)
            else:
                metadata, order = self._masked_metadata(step, cells), np.arange(len(cells))
            hidden = self.model(_on(self.device, step.tokens[order]), _on(self.device, step.positions[order]),
                                metadata)
            row_of_token = np.empty(len(order), dtype=np.int64)
            row_of_token[order] = np.arange(len(order))
            rows = row_of_token[step.output_ids]
        if (rows == np.arange(len(rows))).all():  # every row from the first (a decode step's usual case)
            hidden = hidden[:len(rows)]
        else:
            hidden = hidden[_on(self.device, rows)]
        return self.model.compute_logits(hidden).float()

    def _paged_metadata(self, step: _Step, cells: np.ndarray) -> tuple[AttentionMetadata, np.ndarray]:
        """Tokens grouped by sequence (batch order kept within each); each sequence's block table is
        its cells by position, then its new cells. Returns the metadata and the token order."""
        order = np.argsort(step.first_seq, kind="stable")
        seqs, query_lens = np.unique(step.first_seq[order], return_counts=True)
        self.cells.sort(seqs)
        context_lens = self.cells.n_cells[seqs]
        seq_lens = context_lens + query_lens
        query_start = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        # Each row's context, then its new cells over what follows (entries past a row's length are not read).
        block_tables = self.cells.order[seqs, :int(seq_lens.max())]
        row = np.repeat(np.arange(len(seqs)), query_lens)
        block_tables[row, context_lens[row] + np.arange(len(order)) - query_start[row]] = cells[order]
        dev = self.device
        metadata = AttentionMetadata(
            num_tokens=len(cells), num_seqs=len(seqs), block_size=1, max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=_on(dev, query_start, np.int32),
            seq_lens=_on(dev, seq_lens, np.int32), block_tables=_on(dev, block_tables),
            slot_mapping=_on(dev, cells[order], np.int64), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            backend=self._paged)
        self._paged.prepare(metadata)
        return metadata, order

    def _masked_metadata(self, step: _Step, cells: np.ndarray) -> AttentionMetadata:
        """Every cell of the batch's sequences plus the new ones, under the visibility rule."""
        kv = self.cells
        cached = np.flatnonzero(kv.seqs[step.token_seqs.any(axis=0)].any(axis=0))
        context = np.concatenate([cached, cells])
        context_seqs = np.concatenate([kv.seqs[:, cached].T, step.token_seqs])
        context_pos = np.concatenate([kv.pos[cached], step.positions])
        shares_seq = step.token_seqs.astype(np.float32) @ context_seqs.T.astype(np.float32) > 0
        visible = shares_seq & (context_pos[None, :] <= step.positions[:, None])
        dev, num_tokens = self.device, len(cells)
        return AttentionMetadata(
            num_tokens=num_tokens, num_seqs=1, block_size=1, max_query_len=num_tokens, max_seq_len=len(context),
            query_start_loc=_on(dev, np.array([0, num_tokens], dtype=np.int32)),
            seq_lens=_on(dev, np.array([len(context)], dtype=np.int32)),
            block_tables=_on(dev, context[None], np.int32), slot_mapping=_on(dev, cells, np.int64),
            query_lens_cpu=np.array([num_tokens]), seq_lens_cpu=np.array([len(context)]), backend=self._masked,
            backend_data=CellMask(_on(dev, context, np.int64), _on(dev, visible)))

    # ---- outputs -------------------------------------------------------------------------------
    def _reset_outputs(self) -> None:
        self._logits = self._no_logits
        self._output_ids = np.zeros(0, dtype=np.int64)
        self._output_row = np.zeros(0, dtype=np.int64)

    def n_outputs(self) -> int:
        """Logits rows of the last decode (= its tokens with the logits flag)."""
        return len(self._output_ids)

    def output_ids(self) -> list[int]:
        """The batch index of the token behind each logits row of the last decode."""
        return self._output_ids.tolist()

    def get_logits(self) -> torch.Tensor:
        """[n_outputs, n_vocab] float32 on the model's device, rows in batch order; valid until the next decode."""
        return self._logits

    def get_logits_ith(self, i: int) -> torch.Tensor:
        """Logits of batch token ``i`` of the last decode; a negative ``i`` counts logits rows from
        the end (-1: the last row), as in llama.cpp."""
        n_rows, n_tokens = len(self._output_ids), len(self._output_row)
        if i < 0:
            if i < -n_rows:
                raise IndexError(f"i = {i}: the last decode has {n_rows} logits rows, so a negative i must be "
                                 f">= {-n_rows}")
            return self._logits[n_rows + i]
        if i >= n_tokens:
            raise IndexError(f"i = {i}: the last decode had {n_tokens} tokens")
        row = int(self._output_row[i])
        if row < 0:
            raise IndexError(f"i = {i}: token {i} of the last decode has no logits (its logits flag was not set)")
        return self._logits[row]

    # ---- KV cells ------------------------------------------------------------------------------
    def _seq_or_error(self, seq: int, allow_any: bool) -> int | None:
        """The sequence id (None for "any"), or raises ``_InvalidInput``."""
        if allow_any and seq < 0:
            return None
        if not 0 <= seq < self.n_seq_max:
            allowed = "a negative id (any) or " if allow_any else ""
            raise _InvalidInput(f"seq_id {seq} is not {allowed}in [0, n_seq_max={self.n_seq_max})")
        return int(seq)

    def _kv_op(self, op: Callable[[], KvStatus]) -> KvStatus:
        """Runs a KV operation: bad ids give INVALID_SEQ, failures INTERNAL_ERROR (every operation
        changes cell metadata only after its tensor work, so the metadata is then as before; keys
        that ``kv_seq_add`` was rotating may be left half rotated). ``last_error`` says why for
        every status but OK."""
        self.last_error = None
        try:
            return op()
        except _InvalidInput as exc:
            self.last_error = str(exc)
            return KvStatus.INVALID_SEQ
        except Exception as exc:
            logger.exception("KV operation failed")
            self.last_error = f"{type(exc).__name__}: {exc}"
            return KvStatus.INTERNAL_ERROR

    def _range_or_status(self, p0: int, p1: int) -> tuple[int, int] | None:
        lo, hi = normalize_range(p0, p1)
        if lo >= hi:
            self.last_error = f"empty range [p0={p0}, p1={p1})"
            return None
        return lo, hi

    def kv_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> KvStatus:
        """Takes ``seq`` (any sequence when negative) off its cells with positions in [p0, p1); a cell
        left with no sequence is free. OK also when no cell matched; EMPTY_RANGE when p1 <= p0."""
        def op() -> KvStatus:
            s = self._seq_or_error(seq, allow_any=True)
            span = self._range_or_status(p0, p1)
            if span is None:
                return KvStatus.EMPTY_RANGE
            self.cells.remove(s, self.cells.cells_in_range(s, *span))
            return KvStatus.OK
        return self._kv_op(op)

    def kv_seq_cp(self, dst: int, src: int, p0: int = -1, p1: int = -1) -> KvStatus:
        """Adds ``dst`` to ``src``'s cells with positions in [p0, p1): the cells are shared, nothing is copied."""
        def op() -> KvStatus:
            d, s = self._seq_or_error(dst, False), self._seq_or_error(src, False)
            span = self._range_or_status(p0, p1)
            if span is None:
                return KvStatus.EMPTY_RANGE
            if d != s:
                self.cells.add_seq(d, self.cells.cells_in_range(s, *span))
            return KvStatus.OK
        return self._kv_op(op)

    def kv_seq_keep(self, seq: int) -> KvStatus:
        """Removes every other sequence from every cell."""
        def op() -> KvStatus:
            self.cells.keep_only(self._seq_or_error(seq, False))
            return KvStatus.OK
        return self._kv_op(op)

    def kv_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> KvStatus:
        """Moves ``seq``'s cells with positions in [p0, p1) by ``delta``, re-rotating their cached keys
        so that attention is as if they had been computed at the new positions.

        Cells whose position would become negative leave ``seq`` (as ``kv_seq_rm``). A cell ``seq``
        shares with other sequences is first copied to a free cell for ``seq`` alone, so the others
        keep their positions (OOM_SLOT, nothing changed, when there are not enough free cells).
        INVALID_POS, nothing changed, when a position would reach the model's limit.
        """
        def op() -> KvStatus:
            s = self._seq_or_error(seq, False)
            span = self._range_or_status(p0, p1)
            if span is None:
                return KvStatus.EMPTY_RANGE
            cells = self.cells.cells_in_range(s, *span)
            if delta == 0 or not len(cells):
                return KvStatus.OK
            new_pos = self.cells.pos[cells] + delta
            if new_pos.max() >= self.max_position:
                self.last_error = (f"delta {delta} moves position {int(new_pos.max()) - delta} to "
                                   f"{int(new_pos.max())}, past the model's limit {self.max_position - 1}")
                return KvStatus.INVALID_POS
            gone, stay = cells[new_pos < 0], cells[new_pos >= 0]
            shared = np.flatnonzero(self.cells.seqs[:, stay].sum(axis=0) > 1)
            free = self.cells.free_cells(len(shared))
            if len(free) < len(shared):
                self.last_error = (f"no KV slot: moving cells shared with other sequences needs {len(shared)} "
                                   f"free cells, {len(free)} are free")
                return KvStatus.OOM_SLOT
            targets = stay.copy()
            targets[shared] = free
            # Tensors first (into free cells, or cells only seq owns), metadata last: a failure
            # leaves the metadata as it was.
            self._copy_cells(stay[shared], free)
            self._rotate(targets, delta)
            self.cells.remove(s, gone)
            self.cells.move(s, stay[shared], free)
            self.cells.shift(targets, delta)
            return KvStatus.OK
        return self._kv_op(op)

    def _copy_cells(self, src: np.ndarray, dst: np.ndarray) -> None:
        if not len(src):
            return
        src_t, dst_t = _on(self.device, src, np.int64), _on(self.device, dst, np.int64)
        for layer in self._layers:
            for cache in (layer.k_cache, layer.v_cache):
                flat = cache.view(self.n_ctx, -1)
                flat.index_copy_(0, dst_t, flat[src_t])

    def _rotate(self, cells: np.ndarray, delta: int) -> None:
        if not len(cells):
            return
        cells_t = _on(self.device, cells, np.int64)
        with torch.inference_mode():
            for layer, rotary in zip(self._layers, self._rotaries):
                if rotary is not None:  # a model without RoPE: positions are metadata only
                    rotate_keys(layer.k_cache.view(self.n_ctx, layer.num_kv_heads, layer.head_size), cells_t,
                                rotary, delta)

    def kv_seq_pos_max(self, seq: int) -> int:
        """The largest position ``seq`` holds, -1 when it holds none."""
        return self.cells.pos_max(self._checked_seq(seq))

    def kv_seq_pos_min(self, seq: int) -> int:
        """The smallest position ``seq`` holds, -1 when it holds none."""
        return self.cells.pos_min(self._checked_seq(seq))

    def _checked_seq(self, seq: int) -> int:
        try:
            return self._seq_or_error(seq, False)
        except _InvalidInput as exc:
            raise ValueError(str(exc)) from None

    def kv_clear(self) -> None:
        """Frees every cell (the cached K/V are left in place and overwritten as cells are reused)."""
        self.cells.clear()

    def kv_used_cells(self) -> int:
        return self.cells.num_used

    def kv_cells_dump(self, used_only: bool = False) -> list[CellInfo]:
        """``{cell, seq_ids, pos, used}`` of every cell (or the used ones), for debugging."""
        return self.cells.dump(used_only)

    # ---- weights -------------------------------------------------------------------------------
    def replace_weight(self, name: str, layer: int | None, tensor: torch.Tensor) -> None:
        """Overwrites one checkpoint tensor of the loaded model in place.

        ``name`` is a checkpoint (Hugging Face) name: relative to the decoder layer when ``layer`` is
        given (``"self_attn.q_proj.weight"``, ``layer=3``), whole otherwise (``"model.norm.weight"``).
        Parts of fused parameters (q/k/v, gate/up) go through the loader's mapping. The tensor must
        have the checkpoint shape and a floating dtype (cast to the model's). With tied embeddings,
        ``model.embed_tokens.weight`` is the LM head too; ``lm_head.weight`` is refused. Cached K/V
        are not recomputed (``kv_clear`` to start over).
        """
        full = self._weight_name(name, layer)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(f"tensor for {full!r}: expected a floating-point torch.Tensor, got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        param_name, shard_id = _map_name(self.model, full)
        param = dict(self.model.named_parameters())[param_name]
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is not None:
                args = (shard_id,) if shard_id is not None else ()
                loader(param, tensor.to(self.device), *args, weight_name=full)
            elif tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"tensor for {full!r}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            else:
                param.data.copy_(tensor.to(self.device, param.dtype))

    def _weight_name(self, name: str, layer: int | None) -> str:
        expected = _expected_checkpoint_names(self.model)
        tied = getattr(self.model, "tie_word_embeddings", False)
        if tied and name == "lm_head.weight":
            raise ValueError("lm_head.weight is tied to model.embed_tokens.weight in this model; replace that "
                             "one (it is both the embedding and the LM head)")
        if layer is None:
            if name not in expected:
                per_layer = sorted({n.split(".layers.0.", 1)[1] for n in expected if ".layers.0." in n})
                raise ValueError(f"unknown weight {name!r} (layer=None); global weights: "
                                 f"{sorted(n for n in expected if '.layers.' not in n)}; per-layer weights "
                                 f"(with layer=i): {per_layer}")
            return name
        num_layers = int(self.config.num_hidden_layers)
        if not isinstance(layer, numbers.Integral) or not 0 <= layer < num_layers:
            raise ValueError(f"layer must be in [0, {num_layers}), got {layer!r}")
        matches = [n for n in expected if n.endswith(f"layers.{layer}.{name}")]
        if len(matches) != 1:
            per_layer = sorted({n.split(f"layers.{layer}.", 1)[1] for n in expected if f"layers.{layer}." in n})
            raise ValueError(f"unknown weight {name!r} for layer {layer}; per-layer weights: {per_layer}")
        return matches[0]
