"""One step's integer inputs, staged in one pinned host buffer and sent to the device in one copy.

Every array a forward step needs (token ids, positions, KV slots, logits rows, query start
offsets, sequence lengths, block tables) lives at a fixed offset of one byte buffer. The host
fills numpy views of it; a single non-blocking copy moves the used part to an identically laid
out device buffer, whose typed views the step reads. Fixed offsets are what CUDA graphs need: a
captured graph keeps reading the same device addresses, so refilling the buffer is enough to
run it on new inputs. Growing a buffer moves it, so the owner must drop its graphs then.

Block tables travel packed: the step's rows at its own width (its longest sequence's blocks),
contiguous at the end of the copied part, and :meth:`StepInputBuffers.finish_inputs` spreads
them into the ``block_tables`` rows the kernels read, which span ``max_blocks_per_seq`` (a
32k-token model's row is 8 KB: copied whole, the rows of a decode step of 256 short sequences were
2 MB, about 50 us of copy on the step's stream). Columns past a step's width keep older block ids, which no
kernel reads: a sequence's blocks end within its width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 64  # bytes; keeps every region aligned for any element type and for vector loads
_COPY_GRANULE = 4096  # bytes; a step's copy is rounded up to a multiple (see StepInputBuffers._copy_parts)

# Regions with one entry per token of the step.
# ``token_sources`` is only read by steps whose inputs include tokens still on the device.
_TOKEN_REGIONS = (("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
                  ("logits_indices", np.int64), ("token_sources", np.int64))
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


@dataclass(frozen=True)
class LogitsShift:
    """Moves a step's logits rows on the device: row j by ``min(counts[rows[j]] - 1, limits[j])``,
    or by ``counts[j] - 1`` without ``rows`` and ``limits`` (a draft's catch-up: which of a
    request's rows holds its newest token depends on how many tokens the step before gave it,
    ``counts``, known on the device first)."""

    counts: torch.Tensor
    rows: torch.Tensor | None = None
    limits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.rows is None) != (self.limits is None):
            raise ValueError("a logits shift takes both rows and limits, or neither")


@dataclass(frozen=True)
class BufferCapacity:
    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int

    def covers(self, other: BufferCapacity) -> bool:
        return (self.max_tokens >= other.max_tokens and self.max_seqs >= other.max_seqs
                and self.max_blocks_per_seq >= other.max_blocks_per_seq)

    def grown_to(self, other: BufferCapacity) -> BufferCapacity:
        """At least ``other``, doubling each dimension that is too small (amortised growth)."""
        def grow(have: int, need: int) -> int:
            return have if have >= need else max(need, 2 * have)
        return BufferCapacity(grow(self.max_tokens, other.max_tokens), grow(self.max_seqs, other.max_seqs),
                              grow(self.max_blocks_per_seq, other.max_blocks_per_seq))


class StepInputBuffers:
    """Host (pinned on CUDA) and device copies of one step's integer inputs.

    ``host[name]`` are numpy views to fill, ``device[name]`` the matching torch views.
    ``block_tables`` (int32, ``[max_seqs, max_blocks_per_seq]``) comes first and is written on the
    device only (:meth:`unpack_block_tables`); the copied part follows: token regions of
    ``max_tokens`` int64 entries, ``query_start_loc`` (int32, ``max_seqs + 1``), ``seq_lens`` (int32,
    ``max_seqs``) and ``packed_block_tables`` (int32, last, so that a step copies only what it
    uses; see :meth:`stage_block_tables`). A step's copy spans every token region whole, so what it
    costs grows with ``max_tokens`` (1.3 MB for 32k tokens): buffers that most steps use are best
    sized for the steps they serve. On CPU both sides share memory.
    """

    def __init__(self, capacity: BufferCapacity, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        table_shape = (capacity.max_seqs, capacity.max_blocks_per_seq)
        regions = [("block_tables", np.dtype(np.int32), table_shape)]
        regions += [(name, np.dtype(dtype), (capacity.max_tokens,)) for name, dtype in _TOKEN_REGIONS]
        regions += [("query_start_loc", np.dtype(np.int32), (capacity.max_seqs + 1,)),
                    ("seq_lens", np.dtype(np.int32), (capacity.max_seqs,)),
                    ("packed_block_tables", np.dtype(np.int32), (int(np.prod(table_shape)),))]
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, dtype, shape in regions:
            self.offsets[name] = offset
            offset += -(-int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
        self.nbytes = offset
        on_cuda = device.type == "cuda"
        with torch.inference_mode(False):  # normal tensors: refilled in place from any mode
            self._allocate(on_cuda)
        host_np = self._host_bytes.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.device_views: dict[str, torch.Tensor] = {}
        for name, dtype, shape in regions:
            start, size = self.offsets[name], int(np.prod(shape)) * dtype.itemsize
            self.host[name] = host_np[start:start + size].view(dtype).reshape(shape)
            self.device_views[name] = self._device_bytes[start:start + size].view(_TORCH_DTYPES[dtype]).view(shape)

    def _allocate(self, on_cuda: bool) -> None:
        self._host_bytes = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        self._device_bytes = (torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device) if on_cuda
                              else self._host_bytes)
        # Set when a copy is queued; the host waits on it before overwriting the staging buffer.
        self._copy_done = torch.cuda.Event() if on_cuda else None
        # Copies that other ranks' buffers (threads of this process) queued from this host buffer,
        # by the device they copy to: this buffer is only writable again once they have read it.
        self._reader_copies: dict[torch.device, torch.cuda.Event] = {}
        # The slices of copies from ``_copy_source`` (see :meth:`_copy_parts`), by end.
        self._copy_source: StepInputBuffers | None = None
        self._copy_slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def copy_start(self) -> int:
        """Byte offset where the part a step copies begins (past the device-written block tables)."""
        return self.offsets[_TOKEN_REGIONS[0][0]]

    def stage_block_tables(self, block_tables: np.ndarray) -> int:
        """Writes a step's block tables ([rows, width] int32) packed into the host buffer; returns
        the byte offset just past them (the end of the step's data)."""
        packed = self.host["packed_block_tables"]
        packed[:block_tables.size].reshape(block_tables.shape)[...] = block_tables
        return self.offsets["packed_block_tables"] + block_tables.size * 4

    def unpack_block_tables(self, num_rows: int, width: int) -> None:
        """Spreads the packed ``[num_rows, width]`` block tables of the copied step into the rows of
        ``block_tables`` on the device, queued after the step's copy (the torch operations of
        :meth:`finish_inputs`' first part)."""
        if num_rows and width:
            packed = self.device_views["packed_block_tables"][:num_rows * width].view(num_rows, width)
            self.device_views["block_tables"][:num_rows, :width].copy_(packed)

    def finish_inputs(self, table_shape: tuple[int, int], num_tokens: int, previous: torch.Tensor | None = None,
                      shift: LogitsShift | None = None, num_logits: int = 0) -> None:
        """After the step's copy, on the device: spreads its packed ``table_shape`` block tables
        into their rows (:meth:`unpack_block_tables`); where ``previous`` (tokens still on the
        device, 1-D or rows of them) is given, sets each of the first ``num_tokens`` inputs whose
        ``token_sources`` entry is >= 0 to that entry of ``previous`` flattened, clamped at 0 (-1
        marks an entry without a token, read only where the input is recomputed later); and moves
        the first ``num_logits`` logits rows by ``shift``. One kernel launch on CUDA
        (:mod:`novainfer.worker.input_ops`), these torch operations elsewhere."""
        if self.device.type == "cuda":
            from novainfer.worker.input_ops import finish_step_inputs

            finish_step_inputs(self.device_views, *table_shape, num_tokens, previous, shift, num_logits)
            return
        self.unpack_block_tables(*table_shape)
        views = self.device_views
        if previous is not None:
            sources, input_ids = views["token_sources"][:num_tokens], views["input_ids"][:num_tokens]
            taken = previous.reshape(-1)[sources.clamp(min=0)].clamp(min=0)
            input_ids.copy_(torch.where(sources >= 0, taken, input_ids))
        if shift is not None:
            moves = (shift.counts[:num_logits] - 1 if shift.rows is None
                     else torch.minimum(shift.counts[shift.rows] - 1, shift.limits))
            views["logits_indices"][:num_logits].add_(moves)

    def warm_up(self) -> None:
        """Compiles what :meth:`finish_inputs` launches on CUDA, so that no step waits for it."""
        if self.device.type == "cuda":
            from novainfer.worker.input_ops import warm_up

            warm_up(self.device_views)

    def wait_until_writable(self) -> None:
        """Blocks until the last copy has read the host buffer (call before refilling it).

        The copy is the first thing a step queues, so this rarely waits at all.
        """
        if self._copy_done is not None:
            self._copy_done.synchronize()
        for copy_done in self._reader_copies.values():
            copy_done.synchronize()

    def copy_to_device(self, num_bytes: int, source: StepInputBuffers | None = None) -> None:
        """Sends the copied part of the host buffer, up to byte ``num_bytes``, to the device, asynchronously.

        ``source``: another buffer of the same layout whose host side holds the step instead (the
        driver rank's, staged once for every rank of a ``uni`` executor); ``source`` then waits for
        this copy before it is refilled. On CPU, where the device side is the host buffer, only a
        copy from another buffer does anything.
        """
        source = source or self
        if source is not self and source.offsets != self.offsets:
            raise ValueError(f"cannot copy between step buffers of different layouts "
                             f"({source.capacity} and {self.capacity})")
        if self._copy_done is not None:
            device_part, host_part = self._copy_parts(source, num_bytes)
            device_part.copy_(host_part, non_blocking=True)
            self._copy_done.record()
            if source is not self:
                source._reader_copies[self.device] = self._copy_done
        elif source is not self:
            part = slice(self.copy_start, num_bytes)
            self._device_bytes[part].copy_(source._host_bytes[part])

    def _copy_parts(self, source: StepInputBuffers, num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device and host slices a copy up to ``num_bytes`` moves, rounded up to a whole
        ``_COPY_GRANULE`` (a few bytes more to copy) so that few distinct slices exist, kept: each
        slicing is a torch call of several microseconds on the step's critical path."""
        if self._copy_source is not source:  # another source (rare: a driver rank's grown buffers)
            self._copy_source, self._copy_slices = source, {}
        end = min(-(-num_bytes // _COPY_GRANULE) * _COPY_GRANULE, self.nbytes)
        parts = self._copy_slices.get(end)
        if parts is None:
            part = slice(self.copy_start, end)
            parts = self._copy_slices[end] = (self._device_bytes[part], source._host_bytes[part])
        return parts
