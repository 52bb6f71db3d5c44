"""Persistent per-request sampling state on the device: the sampling side of the request table.

Each running request owns a row (the model runner uses the row of its block table). What sampling
needs of a request lives in that row on the device: its parameters (temperature, top-k, top-p,
min-p, penalties, min_tokens), and where it uses them, the counts of the tokens it
generated (frequency and presence penalties), the set of tokens in its prompt or output
(repetition penalty) and its stop tokens (min_tokens).
A row is written once, when its request joins (or resumes after preemption), in one packed
non-blocking copy from pinned memory; afterwards the only host-to-device traffic of a step is one
packed non-blocking copy of its noise keys (and output positions where min_tokens applies), with
the step's row indices and greedy and seeded flags when its rows differ from the step before, and
the output counts are updated on the device from the sampled tokens. A step therefore never waits
for the device, whatever its sampling settings.

The host keeps a numpy mirror of the per-row flags and seed lanes, so that which stages a step
needs (any top-k? any penalty? below min_tokens?) is decided, and the noise keys are hashed,
without reading the device.

Memory: the parameters take 40 bytes a row. The vocabulary-wide tables are allocated on first use,
for every row: output counts (int32) once some request has a frequency or presence penalty, the
seen-token mask (bool) once some request has a repetition penalty, and the stop-token mask (bool)
once some request has min_tokens: 6 bytes per row and vocabulary entry at most, e.g. 0.9 MB a row
for Qwen2's 151,936 entries (233 MB for 256 rows, 933 MB for 1,024).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from novainfer.sample.metadata import SamplingMetadata
from novainfer.sample.rng import MASK32, row_keys, seed_lanes
from novainfer.sampling_params import SamplingParams

# Columns of the float and int parameter tables.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)
_TOP_K, _MIN_TOKENS = range(2)
_NUM_FLOAT, _NUM_INT = 6, 2
# Each array of a packed copy starts at a multiple of 16 bytes: Triton specializes a kernel on
# whether its pointers are 16-byte aligned, so views at offsets that vary with the batch size would
# compile new variants mid-run (the step's greedy flags and noise keys go to the sampler's kernels).
_ALIGN = 16


def copy_to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays on ``device``, packed into one (pinned, on CUDA) host buffer and sent in one
    non-blocking copy; typed views of the copy are returned. The caching host allocator keeps the
    pinned buffer from being reused before the copy has read it. On CPU the views are of the
    packed buffer itself (the same packing runs)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    on_cuda = device.type == "cuda"
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=on_cuda)
    host_np = host.numpy()
    for a, offset in zip(arrays, offsets):
        host_np[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    packed = host.to(device, non_blocking=True) if on_cuda else host
    views = [packed[offset:offset + a.nbytes].view(_torch_dtype(a.dtype)) for a, offset in zip(arrays, offsets)]
    return [view if a.ndim == 1 else view.view(a.shape) for view, a in zip(views, arrays)]


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    # Looked up once per dtype: copy_to_device runs several times per step.
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


# What a step sends, in the order of its staging buffer: the noise keys and output positions of every
# step first, then what a step sends only when its rows differ from the step before's. A copy covers
# the buffer from its start to the end of the last region the step wrote.
_STEP_REGIONS = (("keys", np.dtype(np.int64)), ("positions", np.dtype(np.int64)), ("rows", np.dtype(np.int64)),
                 ("greedy", np.dtype(np.bool_)), ("seeded", np.dtype(np.bool_)))


class _StepStaging:
    """The buffers of a table's per-step copy, kept from step to step: each region holds up to
    ``capacity`` entries. On CUDA two pinned host buffers take turns (a step fills one while the
    copy of the step before may still be reading the other) and one device buffer receives them;
    a step's copy is queued on the current stream, after every kernel that read the previous
    contents. On CPU one buffer is both. So what a step reads from here is valid until the table's
    next step rewrites it."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.offsets: dict[str, int] = {}
        self.ends: dict[str, int] = {}
        total = 0
        for name, dtype in _STEP_REGIONS:
            self.offsets[name] = total
            self.ends[name] = total + capacity * dtype.itemsize
            total = -(-self.ends[name] // _ALIGN) * _ALIGN
        on_cuda = device.type == "cuda"
        with torch.inference_mode(False):  # normal tensors: refilled in place from any mode
            self._host = [torch.zeros(total, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(2 if on_cuda else 1)]
            self._device = torch.zeros(total, dtype=torch.uint8, device=device) if on_cuda else self._host[0]
        self._copied = [torch.cuda.Event() for _ in self._host] if on_cuda else None
        self._slot = 0
        self._host_views = [{name: buf.numpy()[self.offsets[name]:self.ends[name]].view(dtype)
                             for name, dtype in _STEP_REGIONS} for buf in self._host]
        self._device_views = {name: self._device[self.offsets[name]:self.ends[name]].view(_torch_dtype(dtype))
                              for name, dtype in _STEP_REGIONS}

    def send(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Writes ``arrays`` (regions by name, each at most ``capacity`` long) into the host buffer
        and queues one copy of them to the device; returns their device views."""
        slot = self._slot
        if self._copied is not None:
            self._slot ^= 1
            self._copied[slot].synchronize()  # the copy that last read this buffer, two steps ago
        host = self._host_views[slot]
        for name, array in arrays.items():
            host[name][:len(array)] = array
        if self._copied is not None:
            end = max(self.ends[name] for name in arrays)
            self._device[:end].copy_(self._host[slot][:end], non_blocking=True)
            self._copied[slot].record()
        return {name: self._device_views[name][:len(array)] for name, array in arrays.items()}


@dataclass
class _Composition:
    """A step's rows and what its metadata takes from them alone (see SamplingStateTable._composition)."""

    rows: np.ndarray  # [B] int64 table rows
    version: int  # the table's version it was read at
    fields: dict[str, Any]  # the SamplingMetadata fields that depend on the rows only
    penalties: dict[str, bool]  # whether some row has each penalty ("repetition", "frequency", "presence")
    greedy: np.ndarray  # [B] bool
    any_seeded: bool
    seeded: np.ndarray  # [B] bool
    seed_lo: np.ndarray  # [B] int64 seed lanes
    seed_hi: np.ndarray
    min_tokens: np.ndarray  # [B] int64
    any_min_tokens: bool
    rows_d: torch.Tensor | None = None  # [B] int64, on the device, once sent
    ints: torch.Tensor | None = None  # [B, _NUM_INT] int64 parameters, on the device, once sent


class SamplingStateTable:
    """Per-row sampling parameters and token statistics on the device, with a host mirror of the
    flags. Rows are the caller's (the block-table rows of the model runner); the table grows to fit."""

    def __init__(self, vocab_size: int, device: torch.device, num_rows: int = 16, seed: int | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = device
        self.num_rows = 0
        # Keys of the unseeded rows' noise, drawn on the host: they travel in the step's one copy.
        # Without a seed, the generator's is drawn from torch's global one: fresh for every table,
        # yet repeatable under torch.manual_seed.
        if seed is None:
            seed = int(torch.randint(2**63 - 1, (1,)))
        self._generator = np.random.default_rng(seed)
        # Bumped by every write to the table; a kept composition is of one version.
        self._version = 0
        self._last_composition: _Composition | None = None
        self._staging = _StepStaging(num_rows, device)
        # Host mirror of what decides a step's stages.
        self._greedy = np.zeros(0, dtype=bool)
        self._seeded = np.zeros(0, dtype=bool)
        self._seed_lo = np.zeros(0, dtype=np.int64)  # the seed's hashed lanes (rng.seed_lanes)
        self._seed_hi = np.zeros(0, dtype=np.int64)
        self._top_k = np.zeros(0, dtype=np.int64)
        self._top_p = np.zeros(0, dtype=np.float32)
        self._min_p = np.zeros(0, dtype=np.float32)
        self._repetition = np.zeros(0, dtype=bool)
        self._frequency = np.zeros(0, dtype=bool)
        self._presence = np.zeros(0, dtype=bool)
        self._min_tokens = np.zeros(0, dtype=np.int64)  # 0 for rows without stop tokens to block
        self._logprobs = np.zeros(0, dtype=np.int64)  # -1: none asked
        self.float_params = torch.zeros(0, _NUM_FLOAT, dtype=torch.float32, device=device)
        self.int_params = torch.zeros(0, _NUM_INT, dtype=torch.int64, device=device)
        # Vocabulary-wide tables, allocated on first use.
        self.output_counts: torch.Tensor | None = None  # [rows, V] int32
        self.seen_mask: torch.Tensor | None = None  # [rows, V] bool: in the prompt or the output
        self.stop_mask: torch.Tensor | None = None  # [rows, V] bool
        self.ensure_rows(num_rows)

    # ---- rows --------------------------------------------------------------------------------
    def ensure_rows(self, num_rows: int) -> None:
        """Grows the table (doubling) to hold rows [0, num_rows); existing rows keep their state."""
        if num_rows <= self.num_rows:
            return
        self._version += 1
        new = max(num_rows, 2 * self.num_rows)

        def grown_np(a: np.ndarray, fill) -> np.ndarray:
            out = np.full(new, fill, dtype=a.dtype)
            out[:len(a)] = a
            return out

        self._greedy, self._seeded = grown_np(self._greedy, True), grown_np(self._seeded, False)
        self._seed_lo, self._seed_hi = grown_np(self._seed_lo, 0), grown_np(self._seed_hi, 0)
        self._top_k, self._top_p = grown_np(self._top_k, self.vocab_size), grown_np(self._top_p, 1.0)
        self._min_p = grown_np(self._min_p, 0.0)
        self._repetition = grown_np(self._repetition, False)
        self._frequency, self._presence = grown_np(self._frequency, False), grown_np(self._presence, False)
        self._min_tokens, self._logprobs = grown_np(self._min_tokens, 0), grown_np(self._logprobs, -1)
        self.float_params = self._grown(self.float_params, new)
        self.int_params = self._grown(self.int_params, new)
        for name in ("output_counts", "seen_mask", "stop_mask"):
            table = getattr(self, name)
            if table is not None:
                setattr(self, name, self._grown(table, new))
        self.num_rows = new

    def _grown(self, table: torch.Tensor, num_rows: int) -> torch.Tensor:
        out = torch.zeros((num_rows, *table.shape[1:]), dtype=table.dtype, device=self.device)
        out[:table.shape[0]] = table
        return out

    def _vocab_table(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        table = getattr(self, name)
        if table is None:
            table = torch.zeros(self.num_rows, self.vocab_size, dtype=dtype, device=self.device)
            setattr(self, name, table)
        return table

    def add_requests(self, rows: Sequence[int], params: Sequence[SamplingParams],
                     prompt_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[Sequence[int]]) -> None:
        """Writes the rows of requests that join (or resume): parameters, and where they are used,
        the output counts, the seen-token mask and the stop mask, in one copy. Token ids must be in
        [0, vocab_size)."""
        if not rows:
            return
        n, vocab = len(rows), self.vocab_size
        self.ensure_rows(max(rows) + 1)
        self._version += 1
        floats = np.empty((n, _NUM_FLOAT), dtype=np.float32)
        ints = np.empty((n, _NUM_INT), dtype=np.int64)
        counted, repetition, blocking = [], [], []
        count_index, seen_index, stop_index = [], [], []
        for i, (row, p, prompt, output) in enumerate(zip(rows, params, prompt_token_ids, output_token_ids)):
            greedy = p.is_greedy
            seeded = p.seed is not None and not greedy
            top_k = p.top_k if 0 < p.top_k < vocab else vocab
            seed_lo, seed_hi = seed_lanes(p.seed) if seeded else (0, 0)
            floats[i] = (1.0 if greedy else p.temperature, p.top_p, p.min_p, p.presence_penalty,
                         p.frequency_penalty, p.repetition_penalty)
            ints[i] = (top_k, p.min_tokens)
            stops = [t for t in p.all_stop_token_ids if t < vocab] if p.min_tokens else []
            self._greedy[row], self._seeded[row], self._top_k[row] = greedy, seeded, top_k
            self._seed_lo[row], self._seed_hi[row] = seed_lo, seed_hi
            self._top_p[row], self._min_p[row] = p.top_p, p.min_p
            self._repetition[row] = p.repetition_penalty != 1.0
            self._frequency[row], self._presence[row] = p.frequency_penalty != 0.0, p.presence_penalty != 0.0
            self._min_tokens[row] = p.min_tokens if stops else 0
            self._logprobs[row] = -1 if p.logprobs is None else p.logprobs
            base = row * vocab
            if self._frequency[row] or self._presence[row]:
                counted.append(row)
                count_index.append(base + np.asarray(output, dtype=np.int64))
            if self._repetition[row]:
                repetition.append(row)
                seen_index.append(base + np.asarray([*prompt, *output], dtype=np.int64))
            if stops:
                blocking.append(row)
                stop_index.append(base + np.asarray(stops, dtype=np.int64))

        def flat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        (rows_d, floats_d, ints_d, counted_d, count_d, repetition_d, seen_d, blocking_d,
         stop_d) = copy_to_device([np.asarray(rows, dtype=np.int64), floats, ints,
                                   np.asarray(counted, dtype=np.int64), flat(count_index),
                                   np.asarray(repetition, dtype=np.int64), flat(seen_index),
                                   np.asarray(blocking, dtype=np.int64), flat(stop_index)], self.device)
        self.float_params.index_copy_(0, rows_d, floats_d)
        self.int_params.index_copy_(0, rows_d, ints_d)
        if counted:
            counts = self._vocab_table("output_counts", torch.int32)
            counts.index_fill_(0, counted_d, 0)
            counts.view(-1).scatter_add_(0, count_d, torch.ones_like(count_d, dtype=torch.int32))
        if repetition:
            self._set_rows(self._vocab_table("seen_mask", torch.bool), repetition_d, seen_d)
        if blocking:
            self._set_rows(self._vocab_table("stop_mask", torch.bool), blocking_d, stop_d)

    @staticmethod
    def _set_rows(mask: torch.Tensor, rows: torch.Tensor, flat_index: torch.Tensor) -> None:
        """Rows ``rows`` of ``mask`` become exactly the entries ``flat_index`` (row * V + token)."""
        mask.index_fill_(0, rows, False)
        mask.view(-1).index_fill_(0, flat_index, True)

    # ---- steps -------------------------------------------------------------------------------
    def gather(self, rows: np.ndarray, positions: np.ndarray) -> SamplingMetadata:
        """The metadata of a step that samples ``rows`` (int64, one per logits row) at output
        ``positions`` (tokens each row generated before this one). What it sends to the device
        goes in one copy through the table's staging buffer, so its noise keys and row tensors are
        valid until the table's next gather (a step's sampling reads them before the next step's)."""
        if len(rows) > self._staging.capacity:  # then the rows differ from the kept composition's
            self._staging = _StepStaging(max(len(rows), 2 * self._staging.capacity), self.device)
        positions = positions.astype(np.int64, copy=False)
        composition = self._last_composition
        kept = (composition is not None and composition.version == self._version
                and np.array_equal(composition.rows, rows))
        if not kept:
            composition = self._composition(rows)
        blocking = composition.any_min_tokens and bool((positions < composition.min_tokens).any())
        arrays = {}
        if not composition.fields["all_greedy"]:
            arrays["keys"] = self._noise_keys(composition, positions)
        if blocking:
            arrays["positions"] = positions
        if not kept:
            arrays.update(rows=composition.rows, greedy=composition.greedy, seeded=composition.seeded)
        sent = self._staging.send(arrays) if arrays else {}
        if not kept:
            self._add_device_fields(composition, sent)
            self._last_composition = composition
        min_tokens_mask = None
        if blocking:
            below = sent["positions"] < composition.ints[:, _MIN_TOKENS]
            min_tokens_mask = self.stop_mask[composition.rows_d] & below.unsqueeze(1)
        return SamplingMetadata(**composition.fields, noise_keys=sent.get("keys"), min_tokens_mask=min_tokens_mask)

    def _noise_keys(self, composition: _Composition, positions: np.ndarray) -> np.ndarray:
        """[B] keys of the step's noise: a seeded row's hashed from its seed and position, the
        others' fresh from the table's generator."""
        keys = self._generator.integers(0, MASK32 + 1, size=len(positions), dtype=np.int64)
        if composition.any_seeded:
            keys = np.where(composition.seeded, row_keys(composition.seed_lo, composition.seed_hi, positions), keys)
        return keys

    def _composition(self, rows: np.ndarray) -> _Composition:
        """What the metadata takes from the step's rows alone, from the host mirror; kept while the
        rows and the table stay the same, as they do from one decode step to the next. Its device
        fields follow once the step's copy has sent the rows (:meth:`_add_device_fields`)."""
        vocab = self.vocab_size
        greedy = self._greedy[rows]
        random = ~greedy
        any_random = bool(random.any())
        top_k = self._top_k[rows][random]
        has_top_k = top_k < vocab
        seeded = self._seeded[rows]
        penalties = {name: bool(getattr(self, "_" + name)[rows].any())
                     for name in ("repetition", "frequency", "presence")}
        logprobs = int(self._logprobs[rows].max(initial=-1))
        fields = dict(
            vocab_size=vocab,
            all_greedy=not any_random,
            all_random=not greedy.any(),
            no_top_k=not has_top_k.any(),
            no_top_p=bool((self._top_p[rows][random] >= 1.0).all()),
            no_min_p=bool((self._min_p[rows][random] <= 0.0).all()),
            max_top_k=int(top_k.max()) if any_random and has_top_k.all() else None,
            largest_top_k=int(top_k[has_top_k].max()) if has_top_k.any() else None,
            all_random_seeded=bool(seeded[random].all()),
            no_penalties=not any(penalties.values()),
            counts_table=self.output_counts if penalties["frequency"] or penalties["presence"] else None,
            seen_table=self.seen_mask if penalties["repetition"] else None,
            max_num_logprobs=logprobs if logprobs >= 0 else None,
        )
        min_tokens = self._min_tokens[rows]
        return _Composition(rows=rows.astype(np.int64), version=self._version, fields=fields, penalties=penalties,
                            greedy=greedy, any_seeded=bool(seeded.any()), seeded=seeded,
                            seed_lo=self._seed_lo[rows], seed_hi=self._seed_hi[rows],
                            min_tokens=min_tokens, any_min_tokens=bool(min_tokens.any()))

    def _add_device_fields(self, composition: _Composition, sent: dict[str, torch.Tensor]) -> None:
        """The composition's device fields: its rows' parameters gathered by the ``sent`` rows."""
        rows_d = sent["rows"]
        floats = self.float_params[rows_d]
        ints = self.int_params[rows_d]
        penalties = composition.penalties
        composition.rows_d, composition.ints = rows_d, ints
        composition.fields.update(
            temperature=floats[:, _TEMPERATURE],
            is_greedy=sent["greedy"],
            top_k=ints[:, _TOP_K],
            top_p=floats[:, _TOP_P],
            min_p=floats[:, _MIN_P],
            is_seeded=sent["seeded"] if composition.any_seeded else None,
            presence_penalties=floats[:, _PRESENCE] if penalties["presence"] else None,
            frequency_penalties=floats[:, _FREQUENCY] if penalties["frequency"] else None,
            repetition_penalties=floats[:, _REPETITION],
            rows=rows_d,
        )

    def record_sampled(self, metadata: SamplingMetadata, sampled: torch.Tensor,
                       counted: torch.Tensor | None = None) -> None:
        """Adds a step's sampled tokens to their rows' output counts and seen-token masks (on the
        device), where some row of the step reads them; the other rows never do. ``counted`` [B]
        bool: which entries add to the output counts (None: all); an entry left out must repeat a
        token that a counted entry of its row records (it marks that token seen again). Speculative
        decoding leaves out the positions after a rejected draft, which emit nothing."""
        if metadata.no_penalties:
            return
        flat = metadata.rows * self.vocab_size + sampled
        if metadata.counts_table is not None:
            ones = torch.ones_like(flat, dtype=torch.int32) if counted is None else counted.to(torch.int32)
            self.output_counts.view(-1).scatter_add_(0, flat, ones)
        if metadata.seen_table is not None:
            self.seen_mask.view(-1).index_fill_(0, flat, True)
