"""Batched next-token sampler: penalties, greedy/random sampling and logprobs.

Each stage is a plain function over [B, V] tensors so it can be tested on its
own; `Sampler.forward` chains them in vLLM's order. No stage modifies the
caller's logits. These torch stages are the reference (and the CPU path). On
CUDA, Triton kernels (novainfer.sample.ops, novainfer.sample.topk) replace them
with the same noise for seeded rows, and so the same tokens: a step whose random
rows draw from the whole vocabulary (no top-k, top-p or min-p) runs in one fused
pass; one whose random rows all have a top-k (up to 128) draws from each row's
candidates of a Triton top-k; rows without a top-k draw from the whole vocabulary
and then have the token checked against their top-p and min-p in passes over the
row, replaced until the set holds it (no sort); only a top-k above 128 takes the
torch stages, sorting the vocabulary. Logprobs come from the top-k's pass.
Logprobs are the raw logits minus their log-sum-exp, never a [B, V] log_softmax.
Without the kernels (a CPU), rows without a seed draw with one uniform each (the inverse of the
row's cumulative distribution) rather than noise over the whole vocabulary, and a top-p without a
top-k draws, checks the token against the set and draws again, rather than sorting the vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from novainfer.sample.metadata import SamplingMetadata
from novainfer.sample.rng import exponential_noise


@dataclass
class LogprobsTensors:
    """Log-probabilities of the raw (unpenalized, temperature 1) distribution, held as the one int64
    tensor that goes to the host (:meth:`pack`); the three columns are views of it, made when read.

    Every row has max_num_logprobs top entries; rows that asked for fewer
    should be cut to their own `logprobs` by the caller.
    """

    # [B, 1 + 2 (k + 1)] int64: the sampled token's rank, the token ids (the sampled token, then
    # the top k), then the logprobs' float32 bit patterns, sign-extended (see :meth:`unpack`).
    packed: torch.Tensor

    @classmethod
    def of(cls, token_ids: torch.Tensor, logprobs: torch.Tensor, sampled_token_ranks: torch.Tensor) -> LogprobsTensors:
        """From the columns: ``token_ids`` [B, k + 1] int64, ``logprobs`` [B, k + 1] float32, ``sampled_token_ranks`` [B]."""
        value_bits = logprobs.view(torch.int32).to(torch.int64)
        return cls(torch.cat([sampled_token_ranks.unsqueeze(1), token_ids, value_bits], dim=1))

    @property
    def width(self) -> int:
        return (self.packed.shape[1] - 1) // 2

    @property
    def token_ids(self) -> torch.Tensor:
        """[B, k + 1] int64; column 0 = sampled token, then the top k."""
        return self.packed[:, 1:1 + self.width]

    @property
    def logprobs(self) -> torch.Tensor:
        """[B, k + 1] float32, the top-k part sorted descending."""
        # Each logprob's bits are the low half of its int64 (little-endian, as CPUs and CUDA devices are).
        return self.packed[:, 1 + self.width:].view(torch.float32)[:, ::2]

    @property
    def sampled_token_ranks(self) -> torch.Tensor:
        """[B] int64, 1 = most likely token."""
        return self.packed[:, 0]

    @property
    def sampled_token_ids(self) -> torch.Tensor:
        """[B] int64: column 0 of :attr:`token_ids`."""
        return self.packed[:, 1]

    def pack(self) -> torch.Tensor:
        """The int64 tensor [B, 1 + 2 (k + 1)] for a single copy to the host (see :meth:`unpack`)."""
        return self.packed

    @staticmethod
    def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids [B, k + 1], logprobs [B, k + 1] float32, ranks [B]) from :meth:`pack`'s output."""
        width = (packed.shape[1] - 1) // 2
        values = packed[:, 1 + width:].astype(np.int32).view(np.float32)
        return packed[:, 1:1 + width], values, packed[:, 0]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None
    # Whether the tokens are already in the sampling table's penalty state (see Sampler.forward).
    recorded: bool = False


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Forbid stop tokens in rows that have not yet produced min_tokens tokens."""
    if metadata.min_tokens_mask is None:
        return logits
    return logits.masked_fill(metadata.min_tokens_mask, float("-inf"))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens)."""
    if metadata.seen_token_mask is not None:
        penalty = metadata.repetition_penalties.unsqueeze(1)
        # Dividing positive and multiplying negative logits both make the token less likely.
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(metadata.seen_token_mask, penalized, logits)
    counts = metadata.output_token_counts
    if metadata.frequency_penalties is not None:
        logits = logits - metadata.frequency_penalties.unsqueeze(1) * counts.to(logits.dtype)
    if metadata.presence_penalties is not None:
        logits = logits - metadata.presence_penalties.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_penalties_and_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The logits a step draws from, before temperature and truncation: float32 where a stage
    changes them, else the caller's tensor (any float dtype)."""
    if metadata.min_tokens_mask is None and metadata.no_penalties:
        return logits
    logits = apply_min_tokens(logits.to(torch.float32), metadata)
    return logits if metadata.no_penalties else apply_penalties(logits, metadata)


def draws_from_whole_vocabulary(metadata: SamplingMetadata) -> bool:
    """Whether no random row of the step has a top-k, top-p or min-p."""
    return metadata.no_top_k and metadata.no_top_p and metadata.no_min_p


def mask_sorted_top_k_top_p(
    sorted_logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set entries outside each row's top-k / top-p set to -inf, on logits sorted descending.

    top_k: [B] in [1, V]; top_p: [B] in (0, 1]. Top-p is applied to the distribution left after
    top-k and keeps the smallest prefix whose cumulative probability reaches top_p, always
    including the top token.
    """
    if top_k is not None:
        positions = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
        sorted_logits = sorted_logits.masked_fill(positions >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        # Rows at top_p == 1 keep everything even where float rounding makes
        # the running sum reach 1 before the tail.
        drop &= (top_p < 1.0).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """:func:`mask_sorted_top_k_top_p` on unsorted logits (the whole vocabulary)."""
    # Stable sort so that ties are broken by lowest id, exactly like argmax.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    return logits.scatter(-1, sorted_ids, mask_sorted_top_k_top_p(sorted_logits, top_k, top_p))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below min_p times the row's top probability.

    The result is not renormalized: random_sample does not need it.
    """
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each row draws from, over the whole vocabulary: temperature, top-k, top-p,
    then min-p (penalties and min_tokens are the caller's). Rows with a min-p are not renormalized."""
    logits = logits / metadata.temperature.unsqueeze(1)
    top_p = None if metadata.no_top_p else metadata.top_p
    if not (metadata.no_top_k and top_p is None):
        logits = apply_top_k_top_p(logits, None if metadata.no_top_k else metadata.top_k, top_p)
    return _min_p_probs(logits, metadata)


def _min_p_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    return _min_p_probs_of(logits.softmax(dim=-1), metadata)


def _min_p_probs_of(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    return probs if metadata.no_min_p else apply_min_p(probs, metadata.min_p)


def exponential_draws(probs: torch.Tensor, token_ids: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Exp(1) noise for each entry of ``probs`` ([B, W], entry j of row b being token
    ``token_ids[b, j]``, or ``token_ids[j]`` for a 1-D ``token_ids``): counter-based (see
    novainfer.sample.rng) for seeded rows, from the global generator for the others."""
    seeded = None
    if metadata.is_seeded is not None:
        seeded = exponential_noise(metadata.noise_keys, token_ids)
        if metadata.all_random_seeded:
            return seeded
    noise = torch.empty_like(probs).exponential_()
    # A zero draw would turn 0 / 0 into NaN, which argmax picks: a banned token.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    if seeded is None:
        return noise
    return torch.where(metadata.is_seeded.unsqueeze(1), seeded, noise)


def largest_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``logits`` [B, V] (any float dtype), descending, as
    float32 values and int64 ids. On CUDA, for k up to novainfer.sample.topk.MAX_K, one Triton top-k
    that puts the lowest ids first among equal values; elsewhere torch.topk, which names any of them."""
    if logits.is_cuda:
        from novainfer.sample.topk import MAX_K, top_k

        if k <= MAX_K:
            return top_k(logits, k)
    values, ids = logits.topk(k, dim=-1)
    return values.to(torch.float32), ids


def random_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one index per row from (unnormalized) probs, given Exp(1) noise of the same shape.

    Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) picks i with probability p_i / sum(p),
    without a normalization or a cumsum.
    """
    return (probs / noise).argmax(dim=-1)


def inverse_cdf_sample(probs: torch.Tensor) -> torch.Tensor:
    """Draw one index per row from (unnormalized, non-negative) probs [B, W] with one uniform per
    row from the global generator: the first index whose cumulative mass exceeds u times the row's
    total. The running sums are float64, so that every entry keeps its own mass however long the
    row (a float32 sum of a whole vocabulary is off by up to 6e-8 at each entry)."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    # u < 1, so u times the total stays below it (float64: the product never rounds up to it) and
    # the first sum above it is an entry's with mass. A row without mass, or of NaNs (broken
    # logits), has none: the clamp keeps its index a token's.
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


# Draws again a row with a top-p gets before draw_in_nucleus leaves the step to the sorting path: a
# draw lands in the row's set with probability at least top_p where no min-p cuts the row.
NUCLEUS_REDRAWS = 4


def draw_in_nucleus(logits: torch.Tensor, metadata: SamplingMetadata,
                    rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """Tokens of unseeded rows without a top-k, with top-p and min-p, without sorting the
    vocabulary: each row draws from its whole distribution after temperature and min-p
    (:func:`inverse_cdf_sample`), keeps the token once the probability ranked before it (larger,
    or equal at a lower id: the sorting path's order) is below its top-p, and draws again
    otherwise. A kept token is then a draw from the row's set, as the sorting path's is. ``rows``
    ([B] bool; default every row, then none may have a top-k) are those served: the others' tokens
    are meaningless. None when some served row is still outside its set after NUCLEUS_REDRAWS more
    draws (a small top-p over a flat distribution): the caller then sorts."""
    if metadata.is_seeded is not None or (rows is None and not metadata.no_top_k):
        raise ValueError("draw_in_nucleus serves unseeded rows without a top-k")
    probs = (logits / metadata.temperature.unsqueeze(1)).softmax(dim=-1)
    drawable = _min_p_probs_of(probs, metadata)
    tokens = inverse_cdf_sample(drawable)
    # Rows at top_p 1 keep every token (the sorting path's rule against the running sum's rounding).
    checked = metadata.top_p < 1.0
    rows = torch.nonzero(checked if rows is None else checked & rows).squeeze(1)
    for _ in range(NUCLEUS_REDRAWS):
        rows = _outside_nucleus(probs, tokens, rows, metadata.top_p)
        if rows.numel() == 0:
            return tokens
        tokens[rows] = inverse_cdf_sample(drawable[rows])
    return None if _outside_nucleus(probs, tokens, rows, metadata.top_p).numel() else tokens


def _outside_nucleus(probs: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """The ``rows`` whose token lies outside the row's top-p set: the probability ranked before it
    reaches top_p."""
    row_probs, row_tokens = probs[rows], tokens[rows].unsqueeze(1)
    drawn = row_probs.gather(1, row_tokens)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    ranked_before = (row_probs > drawn) | ((row_probs == drawn) & (ids < row_tokens))
    return rows[(row_probs * ranked_before).sum(dim=-1) >= top_p[rows]]


def draw(probs: torch.Tensor, token_ids: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """One index per row of (unnormalized) ``probs`` [B, W] (entry j of row b being token
    ``token_ids[b, j]``, or ``token_ids[j]`` for a 1-D ``token_ids``): seeded rows by the exponential
    race over their counter-based noise (the CUDA kernels' noise: the same tokens whatever the batch
    and device), the others by :func:`inverse_cdf_sample`, one random number per row where the race
    needs one per entry (on a CPU, Exp(1) noise over a whole vocabulary cost about ten times the
    cumulative sum)."""
    if metadata.is_seeded is None:
        return inverse_cdf_sample(probs)
    seeded = random_sample(probs, exponential_noise(metadata.noise_keys, token_ids))
    if metadata.all_random_seeded:
        return seeded
    return torch.where(metadata.is_seeded, seeded, inverse_cdf_sample(probs))


def gather_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int, lse: torch.Tensor | None = None
) -> LogprobsTensors:
    """Sampled token's logprob and rank plus the top num_logprobs alternatives, of the raw
    ``logits`` [B, V] (any float dtype), without a [B, V] log_softmax: a logprob is the logit minus
    the row's log-sum-exp ``lse`` ([B] float32; computed here when not given), and the top
    alternatives are the top logits."""
    if logits.is_cuda:
        from novainfer.sample.topk import MAX_K, top_k_logprobs

        if num_logprobs <= min(MAX_K, logits.shape[-1]):
            # The top-k pass also counts the ranks and, where not given, the lse.
            return LogprobsTensors(top_k_logprobs(logits, sampled, num_logprobs, lse))
    if lse is None:
        lse = torch.logsumexp(logits.to(torch.float32), dim=-1)
    sampled = sampled.unsqueeze(1)
    sampled_logits = logits.gather(-1, sampled).to(torch.float32)
    top_logits, top_ids = largest_logits(logits, min(num_logprobs, logits.shape[-1]))
    return LogprobsTensors.of(
        token_ids=torch.cat([sampled, top_ids], dim=1),
        logprobs=torch.cat([sampled_logits, top_logits], dim=1) - lse.unsqueeze(1),
        # 1 + the number of strictly larger logits: tied tokens share the best rank.
        sampled_token_ranks=(logits.to(torch.float32) > sampled_logits).sum(dim=-1) + 1,
    )


def greedy_with_logprobs(logits: torch.Tensor, num_logprobs: int) -> tuple[torch.Tensor, LogprobsTensors]:
    """A greedy step's tokens (the argmax of each row of ``logits`` [B, V], lowest id among equal
    maxima) and their logprobs as :func:`gather_logprobs` gives them. On CUDA the top-k pass finds
    the argmax too: its top entry, of rank 1 (no argmax and no rank count of their own)."""
    if logits.is_cuda:
        from novainfer.sample.topk import MAX_K, top_k_logprobs

        if num_logprobs <= min(MAX_K, logits.shape[-1]):
            logprobs = LogprobsTensors(top_k_logprobs(logits, None, num_logprobs, None))
            return logprobs.sampled_token_ids, logprobs
    sampled = logits.argmax(dim=-1)
    return sampled, gather_logprobs(logits, sampled, num_logprobs)


class Sampler(nn.Module):
    """Turns [B, V] logits (any float dtype; the arithmetic is float32) into one token per row,
    following SamplingMetadata."""

    @staticmethod
    def warm_up(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compiles the Triton kernels a step may launch for logits of this width and dtype (CUDA)."""
        if device.type == "cuda":
            from novainfer.sample.ops import warm_up

            warm_up(vocab_size, dtype, device)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata, record: bool = False) -> SamplerOutput:
        """``record``: the sampler may add the tokens to the penalty state of the table ``metadata``
        came from, as SamplingStateTable.record_sampled would (the fused draw does it in its last
        launch); the output says whether it did, so that the caller records them otherwise."""
        batch_size = metadata.temperature.shape[0]
        if logits.shape != (batch_size, metadata.vocab_size):
            raise ValueError(
                f"logits must have shape ({batch_size}, {metadata.vocab_size}) to match the "
                f"sampling metadata, got {tuple(logits.shape)}"
            )
        lse = None  # of the raw logits, where the draw computes it
        recorded = False
        if logits.is_cuda and draws_from_whole_vocabulary(metadata):
            # One Triton pass over the logits, in their own dtype (see novainfer.sample.ops).
            from novainfer.sample.ops import draw_whole_vocabulary

            sampled, lse, recorded = draw_whole_vocabulary(logits, metadata, metadata.noise_keys,
                                                           with_lse=metadata.max_num_logprobs is not None,
                                                           record=record)
        else:
            sampled = self._sample(apply_penalties_and_min_tokens(logits, metadata), metadata)
        # Logprobs describe the model's own distribution (vLLM v1's default "raw" mode).
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(logits, sampled, metadata.max_num_logprobs, lse)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, recorded=recorded)

    @staticmethod
    def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if logits.is_cuda:
            tokens = _sample_with_kernels(logits, metadata)
            if tokens is not None:
                return tokens
        # Logits in any float dtype: argmax and top-k read them as they are (a float32 copy of the
        # whole vocabulary would be a pass of its own), the arithmetic is float32.
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy

        # Greedy rows go through the random path too (its result is discarded for them); their
        # temperature is 1, so they are free of division by zero.
        if metadata.max_top_k is not None:
            sampled = _draw_from_candidates(logits, metadata, metadata.max_top_k)
        else:
            sampled = None
            if not logits.is_cuda and metadata.is_seeded is None and not (metadata.no_top_k and metadata.no_top_p):
                sampled = _draw_without_sorting(logits.to(torch.float32), metadata)
            if sampled is None:
                token_ids = torch.arange(logits.shape[-1], device=logits.device)
                sampled = draw(sampling_probs(logits.to(torch.float32), metadata), token_ids, metadata)
        if greedy is None:
            return sampled
        return torch.where(metadata.is_greedy, greedy, sampled)


def _draw_from_candidates(logits: torch.Tensor, metadata: SamplingMetadata, k: int) -> torch.Tensor:
    """Tokens of rows that keep at most ``k`` tokens (their top-k): drawn among their ``k`` largest
    logits (sorted, as top-p needs) rather than over a sorted vocabulary. A temperature keeps a row's
    order, so it only scales the candidates."""
    logits, token_ids = largest_logits(logits, min(k, logits.shape[-1]))
    top_p = None if metadata.no_top_p else metadata.top_p
    probs = _min_p_probs(mask_sorted_top_k_top_p(logits / metadata.temperature.unsqueeze(1), metadata.top_k, top_p),
                         metadata)
    return token_ids.gather(1, draw(probs, token_ids, metadata).unsqueeze(1)).squeeze(1)


def _draw_without_sorting(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
    """Tokens of an unseeded step with a top-k or a top-p in some row (a CPU's path; None where
    the sorting path has to serve it): rows without a top-k by :func:`draw_in_nucleus`, rows with
    one among their candidates, in one step that may mix both."""
    if metadata.no_top_k:
        return draw_in_nucleus(logits, metadata)
    has_top_k = metadata.top_k < logits.shape[-1]
    tokens = draw_in_nucleus(logits, metadata, rows=~has_top_k)
    if tokens is None:
        return None
    return torch.where(has_top_k, _draw_from_candidates(logits, metadata, int(metadata.top_k[has_top_k].max())),
                       tokens)


def _sample_with_kernels(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
    """Sampler._sample's tokens from the Triton kernels (CUDA), or None for a step they do not serve
    (a top-k above novainfer.sample.topk.MAX_K). Rows without a top-k draw from the whole vocabulary
    and then have their draw checked against their top-p and min-p; rows with one draw among the
    step's top-k candidates."""
    from novainfer.sample.ops import draw_candidates, draw_nucleus
    from novainfer.sample.topk import MAX_K, top_k

    keys = metadata.noise_keys
    if metadata.no_top_k:
        return draw_nucleus(logits, metadata, keys)
    num_candidates = min(metadata.largest_top_k, logits.shape[-1])
    if num_candidates > MAX_K:
        return None
    # Five Triton launches (the top-k's four and the draw) for what the torch stages do in about twenty.
    values, ids = top_k(logits, num_candidates)
    tokens = draw_candidates(values, ids, metadata, keys)
    if metadata.max_top_k is None:  # some random rows have no top-k: theirs come from the whole vocabulary
        has_top_k = metadata.top_k < metadata.vocab_size
        # Without their top-p and min-p, the rows with a top-k take no checking passes there.
        whole = dataclasses.replace(metadata, top_p=metadata.top_p.masked_fill(has_top_k, 1.0),
                                    min_p=metadata.min_p.masked_fill(has_top_k, 0.0))
        tokens = torch.where(has_top_k, tokens, draw_nucleus(logits, whole, keys))
    return tokens
