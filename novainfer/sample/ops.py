"""Triton kernels of the sampler (CUDA): the counter-based noise of :mod:`novainfer.sample.rng`,
the whole-vocabulary draw fused into one pass over the logits, and the draw among top-k candidates.

The noise kernel does the same hash as the torch version (the same bits, in uint32 arithmetic;
only ``log`` may differ in the last place). The torch version runs about twenty elementwise passes
over a [rows, vocabulary] int64 tensor; the kernels compute each value in registers. The draws over
the vocabulary rank tokens by ``x / T - log(noise)`` with the GPU's fast log of the noise
(:func:`_log_noise`), so a seeded token may differ from the torch path's where two scores are within
a few ulp of each other.

The fused draw (:func:`draw_whole_vocabulary`) serves steps whose random rows sample from the whole
vocabulary (no top-k, top-p or min-p): each program reads one chunk of one row of the logits once,
applies the step's min_tokens mask and penalties (the same float operations, in the same order, as
:func:`novainfer.sample.sampler.apply_penalties`), adds the noise and reduces the chunk to its best
token; with logprobs it also reduces the raw logits to the chunk's (max, sum of exp). The torch
path instead runs about ten float32 passes (softmax, noise, division, argmax, each penalty).

The nucleus draw (:func:`draw_nucleus`) serves steps where no random row has a top-k but some have
a top-p or min-p: the whole-vocabulary draw, then one program per such row checks the drawn token
against the row's set in a pass over the row and, where the set does not hold it, takes the
best-scored token ranked before it, until one is held (no sort of the vocabulary).

The candidate draw (:func:`draw_candidates`) serves steps whose random rows all have a top-k: one
program per row samples among the row's top-k candidates (:mod:`novainfer.sample.topk`), with its
top-p and min-p, in one launch where the torch stages take about twenty small ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from novainfer.layers.ops.launcher import KernelLauncher, Launch, LaunchPlans, ScratchSpec
from novainfer.sample import rng, topk
from novainfer.sample.kernel_args import stand_in
from novainfer.sample.metadata import SamplingMetadata
from novainfer.sampling_params import SamplingParams

# The hash's constants (see novainfer.sample.rng), as compile-time constants of the kernels.
_MUL = tl.constexpr(rng.HASH_MUL)
_GOLDEN = tl.constexpr(rng.GOLDEN)
# The interpreter (TRITON_INTERPRET=1: kernels on CPU tensors) has no libdevice; it takes the precise log.
_FAST_LOG = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _mix32(x):
    """rng._mix32 on uint32 ``x``: a uint32 product wraps modulo 2**32, which is the torch
    version's ``& MASK32`` of its int64 product, in one 32-bit multiply instead of a 64-bit one."""
    x = ((x >> 16) ^ x) * _MUL.value
    x = ((x >> 16) ^ x) * _MUL.value
    x = ((x >> 16) ^ x) * _MUL.value
    return (x >> 16) ^ x


@triton.jit
def _exponential(key, ids):
    """Exp(1) noise of token ``ids`` (int64) for a row's ``key``: rng.exponential_noise_torch, in
    uint32 arithmetic (the low 32 bits of the torch version's int64 sums and products)."""
    golden = tl.full([], _GOLDEN, tl.uint32)
    bits = _mix32(key.to(tl.uint32) + ids.to(tl.uint32) * golden)
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # rng.uniform_from_bits
    return -tl.log(uniform)


@triton.jit
def _log_noise(key, ids):
    """log of :func:`_exponential`'s noise, the Gumbel-max draws' term (their score is x / T - this).
    The fast log (CUDA's __logf) errs by at most 2**-21.4 absolute on [0.5, 2] and 3 ulp elsewhere.
    The noise itself needs the precise log: near u = 1, -log(u) is about 6e-8, below that error, and
    could come out <= 0. The noise's log may be fast: it only ranks tokens, and it is about half a
    score's arithmetic."""
    noise = _exponential(key, ids)
    if _FAST_LOG:
        return libdevice.fast_logf(noise)
    return tl.log(noise)


@triton.jit(do_not_specialize=["width", "stride_ids", "stride_out"])
def _exponential_noise_kernel(keys_ptr, token_ids_ptr, out_ptr, width, stride_ids, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    key = tl.load(keys_ptr + row).to(tl.int64)
    ids = tl.load(token_ids_ptr + row * stride_ids + cols, mask=mask, other=0).to(tl.int64)
    tl.store(out_ptr + row * stride_out + cols, _exponential(key, ids), mask=mask)


_launch_exponential_noise = KernelLauncher(_exponential_noise_kernel)


def exponential_noise_triton(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """As :func:`novainfer.sample.rng.exponential_noise`: ``keys`` [B], ``token_ids`` [B, W] or [W]."""
    token_ids = token_ids.contiguous()
    width = token_ids.shape[-1]
    out = torch.empty(keys.shape[0], width, dtype=torch.float32, device=keys.device)
    block = 1024
    _launch_exponential_noise[(keys.shape[0], triton.cdiv(width, block))](
        keys.contiguous(), token_ids, out, width, token_ids.stride(0) if token_ids.dim() == 2 else 0, out.stride(0),
        BLOCK=block)
    return out


# The penalty stages are runtime flags, and neither they nor the tables' strides specialize the
# kernel: one compiled variant per (NOISE, LSE) serves every mix of settings, so start-up compiles
# all four (warm_up) and no request's first penalty pays for a compile. The per-row parameters are
# columns of the sampling state's parameter table, whose byte offsets (e.g. 20 for the repetition
# penalty) are not 16-byte aligned where warm-up's tensors are: their pointers are not specialized
# on alignment either (each program reads one value of each).
@triton.jit(do_not_specialize=["stride_temperature", "use_stop", "stride_stop", "use_repetition", "stride_repetition",
                               "stride_seen", "use_frequency", "stride_frequency", "use_presence", "stride_presence",
                               "stride_counts", "use_table_rows"],
            do_not_specialize_on_alignment=["temperature_ptr", "repetition_ptr", "frequency_ptr", "presence_ptr"])
def _draw_kernel(logits_ptr, stride_logits, vocab_size, num_chunks,
                 temperature_ptr, stride_temperature, greedy_ptr, keys_ptr,
                 use_stop, stop_ptr, stride_stop, use_repetition, repetition_ptr, stride_repetition, seen_ptr,
                 stride_seen, use_frequency, frequency_ptr, stride_frequency, use_presence, presence_ptr,
                 stride_presence, counts_ptr, stride_counts, use_table_rows, table_rows_ptr,
                 best_score_ptr, best_token_ptr, chunk_max_ptr, chunk_sum_ptr,
                 BLOCK: tl.constexpr, NOISE: tl.constexpr, LSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    raw = tl.load(logits_ptr + row * stride_logits + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
    out = row * num_chunks + chunk
    if LSE:
        # Of the raw logits (logprobs describe the model's own distribution).
        chunk_max = tl.max(raw, axis=0)
        tl.store(chunk_max_ptr + out, chunk_max)
        tl.store(chunk_sum_ptr + out, tl.sum(tl.where(raw > float("-inf"), tl.exp(raw - chunk_max), 0.0), axis=0))
    x = raw
    if use_stop != 0:
        stop = tl.load(stop_ptr + row * stride_stop + cols, mask=in_vocab, other=0)
        x = tl.where(stop != 0, float("-inf"), x)
    # The row of the seen-token mask and the counts: the sampling table's row of the request, or
    # this row of copies gathered for the step.
    table_row = row
    if use_table_rows != 0:
        table_row = tl.load(table_rows_ptr + row)
    if use_repetition != 0:
        penalty = tl.load(repetition_ptr + row * stride_repetition)
        seen = tl.load(seen_ptr + table_row * stride_seen + cols, mask=in_vocab, other=0)
        # div_rn: IEEE division, as torch's (Triton's default float32 division is approximate).
        x = tl.where(seen != 0, tl.where(x > 0, tl.math.div_rn(x, penalty), x * penalty), x)
    if use_frequency + use_presence != 0:
        counts = tl.load(counts_ptr + table_row * stride_counts + cols, mask=in_vocab, other=0)
        if use_frequency != 0:
            x = x - tl.load(frequency_ptr + row * stride_frequency) * counts.to(tl.float32)
        if use_presence != 0:
            x = x - tl.load(presence_ptr + row * stride_presence) * (counts > 0).to(tl.float32)
    # A NaN logit is never drawn: a reduction's index over NaN is arbitrary on a GPU (it may point
    # past the vocabulary), so a broken row still yields one of its own ids.
    x = tl.where(x == x, x, float("-inf"))
    if NOISE:
        if tl.load(greedy_ptr + row) == 0:
            # Gumbel-max in log space: argmax(x / T - log q) = argmax(softmax(x / T) / q), the
            # exponential race of the torch path, for the same Exp(1) noise q.
            key = tl.load(keys_ptr + row).to(tl.int64)
            x = x / tl.load(temperature_ptr + row * stride_temperature) - _log_noise(key, cols)
    # Ties go to the lowest id, within the chunk here and across chunks in the caller (as argmax).
    best_score, best = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_score_ptr + out, best_score)
    tl.store(best_token_ptr + out, chunk.to(tl.int64) * BLOCK + best)


_launch_draw = KernelLauncher(_draw_kernel)


def draw_whole_vocabulary(logits: torch.Tensor, metadata: SamplingMetadata, keys: torch.Tensor | None,
                          with_lse: bool, block: int = 4096,
                          record: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """One token per row of ``logits`` [B, V] (any float dtype), in one pass: min_tokens mask and
    penalties of ``metadata``, then greedy rows take the argmax and the others draw from
    softmax(logits / temperature) over the whole vocabulary with the Exp(1) noise of their row's
    ``keys`` entry ([B] int64, see :mod:`novainfer.sample.rng`; None when every row is greedy).
    Callers make sure no random row has a top-k, top-p or min-p.

    Returns the tokens [B] int64, ``with_lse`` the log-sum-exp [B] float32 of the raw logits (else
    None), and whether the tokens were also recorded in the sampling table's penalty state (as
    SamplingStateTable.record_sampled does): with ``record``, where the step reads the tables in
    place (not gathered copies).
    """
    stop = None if metadata.min_tokens_mask is None else metadata.min_tokens_mask.view(torch.uint8)
    seen, seen_rows = metadata.table_rows("seen_table")
    counts, counts_rows = metadata.table_rows("counts_table")
    table_rows = seen_rows if seen is not None else counts_rows
    if seen is not None and counts is not None and seen_rows is not counts_rows:
        # One table gathered (changed in place) and the other not: both as copies, read at row b.
        seen, counts, table_rows = metadata.seen_token_mask, metadata.output_token_counts, None
    record = record and table_rows is not None and (seen is not None or counts is not None)
    tokens, lse = _draw(logits, metadata.temperature, metadata.is_greedy.contiguous().view(torch.uint8), keys, stop,
                        None if seen is None else seen.view(torch.uint8), metadata.repetition_penalties, counts,
                        metadata.frequency_penalties, metadata.presence_penalties, with_lse, block, table_rows, record)
    return tokens, lse, record


def _draw(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, keys: torch.Tensor | None,
          stop: torch.Tensor | None, seen: torch.Tensor | None, repetition: torch.Tensor,
          counts: torch.Tensor | None, frequency: torch.Tensor | None, presence: torch.Tensor | None,
          with_lse: bool, block: int, table_rows: torch.Tensor | None = None,
          record: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`draw_whole_vocabulary` on plain tensors (uint8 masks, int32 counts, float32 per-row
    values; None for a stage the step skips). ``seen`` and ``counts`` are [B, V], row b row b's, or,
    with ``table_rows`` ([B] int64), tables whose row ``table_rows[b]`` is row b's; ``record``
    (tables only) adds the tokens to them."""
    batch_size, vocab_size = logits.shape
    device = logits.device
    tokens = torch.empty(batch_size, dtype=torch.int64, device=device)
    lse = torch.empty(batch_size, dtype=torch.float32, device=device) if with_lse else None
    # The launches take these contiguous (stand_in), and a kept plan must see the tensors they take.
    keys, stop, seen, counts, frequency, presence, table_rows = (
        None if t is None else t.contiguous() for t in (keys, stop, seen, counts, frequency, presence, table_rows))
    variable = (logits, temperature, greedy, keys, stop, seen, repetition, counts, frequency, presence, table_rows,
                tokens, lse)

    def build() -> tuple[ScratchSpec, Callable[[list[torch.Tensor]], list[Launch]]]:
        num_chunks = triton.cdiv(vocab_size, block)
        scratch = [((batch_size, num_chunks), dtype)
                   for dtype in (torch.float32, torch.int64) + ((torch.float32,) * 2 if with_lse else ())]
        return scratch, functools.partial(_draw_launches, variable, num_chunks, block, record)

    # The rows' strides are arguments of the launches, so part of what a kept plan depends on.
    strides = tuple(None if t is None else t.stride(0)
                    for t in (logits, temperature, stop, seen, repetition, counts, frequency, presence))
    _DRAW_PLANS.launch(device, (batch_size, vocab_size, logits.dtype, block, with_lse, record, *strides), variable,
                       build)
    return tokens, lse


_DRAW_PLANS = LaunchPlans()


def _draw_launches(variable: tuple, num_chunks: int, block: int, record: bool,
                   scratch: list[torch.Tensor]) -> list[Launch]:
    """:func:`_draw`'s two launches: each chunk's best score and token (and its maximum and sum for
    the log-sum-exp), then each row's token from its chunks'."""
    (logits, temperature, greedy, keys, stop, seen, repetition, counts, frequency, presence, table_rows,
     tokens, lse) = variable
    batch_size, vocab_size = logits.shape
    device = logits.device
    best_score, best_token, *lse_parts = scratch
    chunk_max, chunk_sum = lse_parts or (best_score, best_score)
    # Absent tables are never read (their flag is off); stand-ins of the same dtypes keep the
    # kernel's signature, so that absent and present stages launch the same compiled variant.
    stop_table = stand_in(stop, torch.uint8, device)
    seen_table = stand_in(seen, torch.uint8, device)
    counts_table = stand_in(counts, torch.int32, device)
    frequency_values = stand_in(frequency, torch.float32, device)
    presence_values = stand_in(presence, torch.float32, device)
    rows = stand_in(table_rows, torch.int64, device)
    with_lse = lse is not None
    draw = (_launch_draw, (batch_size, num_chunks), (
        logits, logits.stride(0), vocab_size, num_chunks, temperature, temperature.stride(0), greedy,
        stand_in(keys, torch.int64, device),
        int(stop is not None), stop_table, stop_table.stride(0),
        int(seen is not None), repetition, repetition.stride(0), seen_table, seen_table.stride(0),
        int(frequency is not None), frequency_values, frequency_values.stride(0),
        int(presence is not None), presence_values, presence_values.stride(0), counts_table, counts_table.stride(0),
        int(table_rows is not None), rows,
        best_score, best_token, chunk_max, chunk_sum),
        # No fused multiply-adds, so that penalized logits round as torch's separate operations do.
        dict(BLOCK=block, NOISE=keys is not None, LSE=with_lse, enable_fp_fusion=False, num_warps=8))
    combine = (_launch_combine_chunks, (batch_size,), (
        best_score, best_token, chunk_max, chunk_sum, num_chunks, tokens, lse if with_lse else best_score,
        int(record and seen is not None), seen_table, seen_table.stride(0),
        int(record and counts is not None), counts_table, counts_table.stride(0), rows),
        dict(CHUNKS=triton.next_power_of_2(num_chunks), LSE=with_lse))
    return [draw, combine]


@triton.jit
def _scaled_logits(base, cols, vocab_size, temperature):
    y = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    y = tl.where(y == y, y, float("-inf"))  # NaN: never drawn (see _draw_kernel)
    return tl.math.div_rn(y, temperature)  # IEEE division, as the torch path's logits / temperature


@triton.jit(do_not_specialize=["stride_logits", "vocab_size", "stride_temperature", "stride_top_p", "stride_min_p"],
            do_not_specialize_on_alignment=["temperature_ptr", "top_p_ptr", "min_p_ptr"])
def _nucleus_kernel(logits_ptr, stride_logits, vocab_size, temperature_ptr, stride_temperature, top_p_ptr,
                    stride_top_p, min_p_ptr, stride_min_p, greedy_ptr, keys_ptr, tokens_ptr, BLOCK: tl.constexpr):
    """Turns a row's whole-vocabulary draw (in ``tokens_ptr``) into its draw from its top-p and min-p
    set N, in passes over the row: the token is kept if N holds it, else replaced by the best-scored
    token ranked before it within the min-p set (the next pass checks that one against the top-p).
    N is a prefix of the row's tokens in descending order, so the token ends as the argmax of the
    same scores over N: the exponential race restricted to N, the sorting torch path's token."""
    row = tl.program_id(0).to(tl.int64)
    top_p = tl.load(top_p_ptr + row * stride_top_p)
    min_p = tl.load(min_p_ptr + row * stride_min_p)
    done = (tl.load(greedy_ptr + row) != 0) | ((top_p >= 1.0) & (min_p <= 0.0))
    base = logits_ptr + row * stride_logits
    temperature = tl.load(temperature_ptr + row * stride_temperature)
    key = tl.load(keys_ptr + row).to(tl.int64)
    token = tl.load(tokens_ptr + row)
    # The min-p set (apply_min_p: a probability at least min_p times the top one, exp(0) / total)
    # needs the row's largest logit first: a pass of its own.
    row_max = float("-inf")
    if (not done) & (min_p > 0.0):
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK).to(tl.int64)
            row_max = tl.maximum(row_max, tl.max(_scaled_logits(base, cols, vocab_size, temperature), axis=0))
    while not done:
        # Tokens ranked before the token have a larger scaled logit, or an equal one at a lower id
        # (the stable descending sort of the torch path).
        token_logit = _scaled_logits(base, token, vocab_size, temperature)
        total = 0.0  # sum of exp(logit - row_max) over the row
        before = 0.0  # the same over the tokens ranked before the token
        best_score = float("-inf")
        best = token
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK).to(tl.int64)
            y = _scaled_logits(base, cols, vocab_size, temperature)
            # Without a min-p, row_max is found here: rescale the sums as it grows.
            new_max = tl.maximum(row_max, tl.max(y, axis=0))
            rescale = tl.where(row_max == float("-inf"), 0.0, tl.exp(row_max - new_max))
            row_max = new_max
            weights = tl.where(y > float("-inf"), tl.exp(y - row_max), 0.0)
            ahead = (y > token_logit) | ((y == token_logit) & (cols < token))
            total = total * rescale + tl.sum(weights, axis=0)
            before = before * rescale + tl.sum(tl.where(ahead, weights, 0.0), axis=0)
            candidate = ahead & (weights >= min_p)  # (always, without a min-p)
            score = tl.where(candidate, y - _log_noise(key, cols), float("-inf"))
            chunk_best, index = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
            # Strictly better only: among equal scores the earlier chunk's (lower) id stays.
            best = tl.where(chunk_best > best_score, start + index, best)
            best_score = tl.maximum(best_score, chunk_best)
        # sampler.mask_sorted_top_k_top_p drops a token whose mass before it reaches top_p.
        in_top_p = (top_p >= 1.0) | (tl.math.div_rn(before, total) < top_p)
        in_min_p = tl.exp(token_logit - row_max) >= min_p
        keep = in_top_p & in_min_p
        # Without a top-p, the best of the min-p set needs no check. Where nothing is ranked before
        # the token (exactly, the set's first token, which it holds), the token stays: with NaN
        # logits, or a row of -inf (0 / 0 mass), the checks above fail and would never end.
        done = keep | (top_p >= 1.0) | (best == token)
        token = tl.where(keep, token, best)
    tl.store(tokens_ptr + row, token)


_launch_nucleus = KernelLauncher(_nucleus_kernel)


def draw_nucleus(logits: torch.Tensor, metadata: SamplingMetadata, keys: torch.Tensor, block: int = 4096,
                 pass_block: int = 8192) -> torch.Tensor:
    """One token [B] int64 per row of ``logits`` [B, V] (any float dtype; min_tokens and penalties
    already applied), for steps where no random row has a top-k: greedy rows take the argmax, the
    others draw from softmax(logits / temperature) cut to their top-p and min-p with the Exp(1)
    noise of their row's ``keys`` entry, without sorting the vocabulary: the whole-vocabulary draw,
    then :func:`_nucleus_kernel`'s passes over each row that has a top-p or min-p. A pass keeps a
    top-p row's token with probability at least top_p (the set's share of the tokens that could
    have been drawn), so such a row takes at most 1 / top_p passes on average."""
    greedy = metadata.is_greedy.contiguous().view(torch.uint8)
    tokens, _ = _draw(logits, metadata.temperature, greedy, keys, None, None, metadata.repetition_penalties, None,
                      None, None, False, block)
    _launch_nucleus[(logits.shape[0],)](
        logits, logits.stride(0), logits.shape[1], metadata.temperature, metadata.temperature.stride(0),
        metadata.top_p, metadata.top_p.stride(0), metadata.min_p, metadata.min_p.stride(0), greedy, keys, tokens,
        # One program walks a whole row: wide chunks keep more of it in flight (8,192 logits on 16
        # warps took 0.50 ms at batch 256 on an H200, 4,096 on 8 warps 0.65 ms).
        BLOCK=pass_block, num_warps=max(1, min(16, pass_block // 512)))
    return tokens


@triton.jit
def _softmax(x):
    e = tl.exp(x - tl.max(x, axis=0))
    return e / tl.sum(e, axis=0)


@triton.jit(do_not_specialize=["stride_candidates", "num_candidates", "stride_temperature", "stride_top_k",
                               "use_top_p", "stride_top_p", "use_min_p", "stride_min_p"])
def _draw_candidates_kernel(values_ptr, ids_ptr, stride_candidates, num_candidates, temperature_ptr,
                            stride_temperature, top_k_ptr, stride_top_k, use_top_p, top_p_ptr, stride_top_p,
                            use_min_p, min_p_ptr, stride_min_p, greedy_ptr, keys_ptr, tokens_ptr,
                            WIDTH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * stride_candidates
    if tl.load(greedy_ptr + row) != 0:
        # The first candidate is the argmax (the lowest id among equal maxima).
        tl.store(tokens_ptr + row, tl.load(ids_ptr + base))
    else:
        # sampler.mask_sorted_top_k_top_p, then _min_p_probs and random_sample, on the row's sorted
        # candidates: the same operations in float32 (sums in another order).
        cols = tl.arange(0, WIDTH)
        kept = (cols < num_candidates) & (cols < tl.load(top_k_ptr + row * stride_top_k))
        x = tl.load(values_ptr + base + cols, mask=kept, other=float("-inf"))
        x = tl.math.div_rn(x, tl.load(temperature_ptr + row * stride_temperature))
        top_p = tl.load(top_p_ptr + row * stride_top_p)
        if (use_top_p != 0) & (top_p < 1.0):
            probs = _softmax(x)
            mass_before = tl.cumsum(probs, axis=0) - probs
            x = tl.where((mass_before >= top_p) & (cols > 0), float("-inf"), x)
        probs = _softmax(x)
        if use_min_p != 0:
            probs = tl.where(probs < tl.load(min_p_ptr + row * stride_min_p) * tl.max(probs, axis=0), 0.0, probs)
        ids = tl.load(ids_ptr + base + cols, mask=cols < num_candidates, other=0)
        race = tl.math.div_rn(probs, _exponential(tl.load(keys_ptr + row), ids))
        # Columns past the row's candidates, and NaN (a row of broken logits), rank below every
        # real race (>= 0): otherwise a row of NaN may pick a column past its candidates, whose
        # "id" is whatever memory follows the row.
        race = tl.where(kept & (race == race), race, -1.0)
        _, choice = tl.max(race, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(tokens_ptr + row, tl.load(ids_ptr + base + choice))


_launch_draw_candidates = KernelLauncher(_draw_candidates_kernel)


def draw_candidates(values: torch.Tensor, ids: torch.Tensor, metadata: SamplingMetadata,
                    keys: torch.Tensor) -> torch.Tensor:
    """One token [B] int64 per row from its candidates, the ``values`` [B, k] (float32, descending)
    and ``ids`` [B, k] of :func:`novainfer.sample.topk.top_k` over the penalized logits, k the
    step's largest top-k (a row without one draws among the k; the caller replaces its token):
    greedy rows take the first candidate, the others draw from softmax(values / temperature) cut
    to their top-k, top-p and min-p, with
    the Exp(1) noise of each candidate's id under their row's ``keys`` entry ([B] int64, see
    :mod:`novainfer.sample.rng`): the tokens of Sampler._sample's torch stages for the same noise."""
    batch_size, num_candidates = values.shape
    tokens = torch.empty(batch_size, dtype=torch.int64, device=values.device)
    _launch_draw_candidates[(batch_size,)](
        values, ids, values.stride(0), num_candidates, metadata.temperature, metadata.temperature.stride(0),
        metadata.top_k, metadata.top_k.stride(0), int(not metadata.no_top_p), metadata.top_p,
        metadata.top_p.stride(0), int(not metadata.no_min_p), metadata.min_p, metadata.min_p.stride(0),
        metadata.is_greedy.contiguous().view(torch.uint8), keys, tokens,
        WIDTH=topk.kernel_width(num_candidates), num_warps=1)  # at most 128 candidates: one warp
    return tokens


def warm_up_draw(logits: torch.Tensor) -> torch.Tensor:
    """Launches the whole-vocabulary draw in each of its four variants on ``logits`` [1, V]; returns
    the int64 noise key it used."""
    device = logits.device
    one = torch.ones(1, dtype=torch.float32, device=device)
    keys = torch.zeros(1, dtype=torch.int64, device=device)
    greedy = torch.zeros(1, dtype=torch.uint8, device=device)
    for noise in (None, keys):
        for with_lse in (False, True):
            _draw(logits, one, greedy, noise, None, None, one, None, None, None, with_lse, 4096)
    return keys


def warm_up(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compiles every variant of the sampler's kernels for logits [B, ``vocab_size``] of ``dtype``: the
    draw with and without noise and log-sum-exp, the top-p / min-p passes, the top-k of each width
    with its candidate draw, and the noise of chosen tokens."""
    logits = torch.zeros(1, vocab_size, dtype=dtype, device=device)
    keys = warm_up_draw(logits)
    top_p = SamplingMetadata.from_requests([SamplingParams(temperature=1.0, top_p=0.5)], [[]], [[]], device,
                                           vocab_size)
    for nucleus_dtype in {dtype, torch.float32}:  # raw logits, or float32 where penalties apply
        draw_nucleus(logits.to(nucleus_dtype), top_p, keys)
    # Top-k candidates read the raw logits, or float32 ones where penalties or min_tokens apply;
    # every width a k <= V can take.
    for width in {min(width, vocab_size) for width in topk.WIDTHS}:
        for top_k_dtype in {dtype, torch.float32}:
            values, ids = topk.top_k(logits.to(top_k_dtype), width)
        metadata = SamplingMetadata.from_requests([SamplingParams(temperature=1.0, top_k=width)], [[]], [[]], device,
                                                  vocab_size)
        draw_candidates(values, ids, metadata, keys)
    for token_ids in (keys, keys.view(1, 1)):
        exponential_noise_triton(keys, token_ids)


@triton.jit(do_not_specialize=["record_seen", "stride_seen", "record_counts", "stride_counts"])
def _combine_chunks_kernel(best_score_ptr, best_token_ptr, chunk_max_ptr, chunk_sum_ptr, num_chunks, tokens_ptr,
                           lse_ptr, record_seen, seen_ptr, stride_seen, record_counts, counts_ptr, stride_counts,
                           table_rows_ptr, CHUNKS: tl.constexpr, LSE: tl.constexpr):
    """A row's token and log-sum-exp from its chunks' (one launch rather than a few torch ops);
    with ``record_seen`` / ``record_counts``, the token is also marked in its table row's seen mask
    and counted in its output counts (SamplingStateTable.record_sampled, without launches of its own)."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    valid = chunks < num_chunks
    scores = tl.load(best_score_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"))
    # The first chunk of the best score holds the lowest id among equal best scores.
    _, best = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.load(best_token_ptr + row * num_chunks + best)
    tl.store(tokens_ptr + row, token)
    if record_seen != 0:
        tl.store(seen_ptr + tl.load(table_rows_ptr + row) * stride_seen + token, 1)
    if record_counts != 0:  # atomic: step rows may share a table row
        tl.atomic_add(counts_ptr + tl.load(table_rows_ptr + row) * stride_counts + token, 1)
    if LSE:
        tl.store(lse_ptr + row, topk.combined_lse(chunk_max_ptr, chunk_sum_ptr, row, num_chunks, CHUNKS))


_launch_combine_chunks = KernelLauncher(_combine_chunks_kernel)
