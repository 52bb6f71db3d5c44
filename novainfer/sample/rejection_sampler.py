"""Verification of speculative tokens by rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

A request proposes draft tokens d_1..d_k, drawn from the proposer's distributions q_1..q_k (a
deterministic proposer, such as n-gram lookup, is the case where q_i is one-hot at d_i). One forward
pass of the target gives its distributions p_1..p_{k+1} at those positions. Draft i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)), in order, until one is rejected; at the first rejection a
token is drawn from the residual max(0, p_i - q_i) (renormalized), and when every draft is accepted
a bonus token is drawn from p_{k+1}. Every emitted token is then distributed exactly as if the target
had sampled it alone. A greedy request accepts the drafts that equal the target's argmax, then
emits the argmax where they first differ (or after the last one).

Randomness comes in from the caller (``uniform`` for the acceptance tests, ``noise`` for the final
draw), so that the caller decides how a seeded request's random stream is kept reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from novainfer.sample.metadata import SamplingMetadata


@dataclass
class RejectionSamplerOutput:
    """Row b emitted ``token_ids[b, :num_tokens[b]]`` (the accepted drafts, then one more token); -1 after."""

    token_ids: torch.Tensor  # [B, k + 1] int64
    num_tokens: torch.Tensor  # [B] int64, in [1, k + 1]
    num_accepted: torch.Tensor  # [B] int64: accepted drafts (num_tokens - 1)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None, greedy_token_ids: torch.Tensor, is_greedy: torch.Tensor,
                     uniform: torch.Tensor, noise: torch.Tensor) -> RejectionSamplerOutput:
    """Verifies a batch of drafts.

    ``target_probs`` [B, k + 1, V]: the target's sampling distribution (after temperature, top-k,
    top-p) at each draft's position and the bonus position; rows of greedy requests are not read.
    ``draft_token_ids`` [B, k] (entries past ``num_draft_tokens[b]`` are ignored); ``draft_probs``
    [B, k, V] or None for one-hot proposals; ``greedy_token_ids`` [B, k + 1]: the target's argmax
    at each position (read for greedy rows only); ``uniform`` [B, k] in [0, 1); ``noise`` [B, V]
    positive, Exp(1)-distributed (an exponential race picks the final token), or [B, k + 1, V]:
    one row per position, of which the final token's position is used (the caller may then key
    the noise by position, and take ``uniform`` from entries of it that the final draw never reads:
    that of draft i at position i, which a rejection takes out of the residual).
    """
    batch, num_positions, vocab = target_probs.shape
    k = num_positions - 1
    if draft_token_ids.shape != (batch, k):
        raise ValueError(f"draft_token_ids must have shape ({batch}, {k}), got {tuple(draft_token_ids.shape)}")
    rows = torch.arange(batch, device=target_probs.device)
    valid = torch.arange(k, device=target_probs.device).unsqueeze(0) < num_draft_tokens.unsqueeze(1)
    drafts = draft_token_ids.clamp(min=0).to(torch.int64)
    target_of_draft = target_probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    draft_of_draft = 1.0 if draft_probs is None else draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accept_random = uniform * draft_of_draft < target_of_draft
    accept_greedy = drafts == greedy_token_ids[:, :k]
    num_accepted = _num_accepted(torch.where(is_greedy.unsqueeze(1), accept_greedy, accept_random) & valid)

    # The emitted token after the accepted drafts: from the residual where a draft was rejected,
    # else (every draft accepted) from the target's distribution at the bonus position.
    rejected = num_accepted < num_draft_tokens
    probs = target_probs[rows, num_accepted]
    at = num_accepted.clamp(max=max(k - 1, 0))
    if draft_probs is None:
        residual = probs.scatter(1, drafts[rows, at].unsqueeze(1), 0.0) if k else probs
    else:
        residual = (probs - draft_probs[rows, at]).clamp(min=0.0) if k else probs
    # A residual of zero mass (p equal to q up to rounding) leaves the target's own distribution.
    has_mass = residual.sum(dim=1, keepdim=True) > 0
    probs = torch.where(rejected.unsqueeze(1) & has_mass, residual, probs)
    if noise.dim() == 3:
        noise = noise[rows, num_accepted]
    sampled = (probs / noise).argmax(dim=1)
    final = torch.where(is_greedy, greedy_token_ids[rows, num_accepted], sampled)

    positions = torch.arange(num_positions, device=target_probs.device).unsqueeze(0)
    padded_drafts = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    token_ids = torch.where(positions < num_accepted.unsqueeze(1), padded_drafts, -1)
    token_ids[rows, num_accepted] = final
    return RejectionSamplerOutput(token_ids, num_accepted + 1, num_accepted)


def greedy_verify(greedy_token_ids: torch.Tensor, draft_token_ids: torch.Tensor) -> RejectionSamplerOutput:
    """Verifies a batch of drafts of greedy requests only: what :func:`rejection_sample` gives them,
    without the target's distributions. ``greedy_token_ids`` [B, k + 1]: the target's argmax at each
    position; ``draft_token_ids`` [B, k], padded with negative ids past each row's drafts (they
    never match). The accepted drafts equal the argmax, so row b emits ``greedy_token_ids[b, :n + 1]``
    where n drafts were accepted."""
    k = draft_token_ids.shape[1]
    num_accepted = _num_accepted(draft_token_ids == greedy_token_ids[:, :k])
    positions = torch.arange(k + 1, device=greedy_token_ids.device)
    token_ids = torch.where(positions <= num_accepted.unsqueeze(1), greedy_token_ids, -1)
    return RejectionSamplerOutput(token_ids, num_accepted + 1, num_accepted)


def draft_rows(proposals: torch.Tensor, proposal_rows: torch.Tensor, num_drafts: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] int64: request b's drafts, the first ``num_drafts[b]`` entries of row ``proposal_rows[b]``
    of ``proposals`` [R, >= k], then -1 (which matches no token)."""
    drafts = proposals[proposal_rows, :k]
    return torch.where(torch.arange(k, device=drafts.device) < num_drafts.unsqueeze(1), drafts, -1)


def greedy_verify_rows(argmax: torch.Tensor, index: torch.Tensor, proposals: torch.Tensor, proposal_rows: torch.Tensor,
                       num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`greedy_verify` of a step's drafts, laid out as its results travel to the host.
    ``argmax`` [R] int64: the target's argmax at each row of the step; ``index`` [B, k + 1]: request
    b's rows (its last known token's, then one per draft; padded by repeating the last); the drafts
    as :func:`draft_rows` takes them. Returns ([B, 1 + (k + 1)] int64: the number of tokens each
    request emits, then those tokens, -1 after; [B] int64: each request's last emitted token). On
    CUDA one Triton launch (novainfer.sample.verify_ops), elsewhere these torch operations."""
    if argmax.is_cuda:
        from novainfer.sample.verify_ops import greedy_verify_packed

        return greedy_verify_packed(argmax, index, proposals, proposal_rows, num_drafts)
    out = greedy_verify(argmax[index], draft_rows(proposals, proposal_rows, num_drafts, index.shape[1] - 1))
    packed = torch.cat([out.num_tokens.unsqueeze(1), out.token_ids], dim=1)
    return packed, out.token_ids.gather(1, out.num_accepted.unsqueeze(1)).squeeze(1)


def warm_up_verification(num_speculative_tokens: int, device: torch.device) -> None:
    """Compiles what :func:`greedy_verify_rows` launches for up to ``num_speculative_tokens`` drafts (CUDA)."""
    if device.type == "cuda":
        from novainfer.sample.verify_ops import warm_up

        warm_up(num_speculative_tokens, device)


def _num_accepted(accept: torch.Tensor) -> torch.Tensor:
    """[B] int64: the length of each row's leading run of accepted drafts (``accept`` [B, k])."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def add_preceding_drafts(metadata: SamplingMetadata, draft_token_ids: torch.Tensor,
                         num_draft_tokens: np.ndarray) -> None:
    """Penalties under speculation: the rows of a step that verifies request b's drafts d_1..d_n
    (row b of ``draft_token_ids`` [B, k] on the device, ``num_draft_tokens[b]`` of them) are its
    n + 1 positions, consecutive and in request order, and the row of position j is scored as if
    d_1..d_j had been emitted (they have, wherever that row's token is used: the drafts before it
    were all accepted). Adds them to the rows' output counts and seen-token masks, which
    ``metadata`` holds as copies gathered for this step. The drafts are read where they are (the
    host only knows how many each request has)."""
    k = draft_token_ids.shape[1]
    counts = num_draft_tokens + 1
    starts = np.cumsum(counts) - counts
    position, before = np.tril_indices(k + 1, -1)  # every (position j, draft index i < j)
    request, pair = np.nonzero(position[None, :] <= num_draft_tokens[:, None])
    if not len(request):
        return
    device = metadata.temperature.device
    rows_d, request_d, before_d = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(
        device, non_blocking=True) for a in (starts[request] + position[pair], request, before[pair]))
    tokens_d = draft_token_ids.to(device)[request_d, before_d]
    if metadata.output_token_counts is not None:
        table = metadata.output_token_counts
        table.index_put_((rows_d, tokens_d), torch.ones_like(rows_d, dtype=table.dtype), accumulate=True)
    if metadata.seen_token_mask is not None:
        metadata.seen_token_mask[rows_d, tokens_d] = True
