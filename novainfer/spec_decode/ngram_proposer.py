"""N-gram (prompt lookup) proposals: continue a request the way its own text continued before.

For each request, the longest suffix of its tokens (``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens) that also occurs earlier in its prompt or output is looked up; the
tokens that followed its most recent earlier occurrence are proposed, up to
``num_speculative_tokens`` of them. Editing, summarization and code often copy their input, and
greedy outputs that cycle repeat themselves, so such proposals are often accepted.

The search runs over the whole batch at once as tensor operations (on the device that holds the
token history), with no loop over requests or tokens: for each n, one comparison per suffix position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposals:
    """Draft tokens per request: row b proposes ``token_ids[b, :num_tokens[b]]`` (the rest is -1)."""

    token_ids: torch.Tensor  # [B, k] int64
    num_tokens: torch.Tensor  # [B] int64, in [0, k]


def propose_ngram(token_ids: torch.Tensor, num_tokens: torch.Tensor, min_n: int, max_n: int, k: int) -> Proposals:
    """Proposals for a batch whose row b holds ``num_tokens[b]`` known tokens (prompt, then output)
    at the start of ``token_ids`` [B, L] (the rest of the row is ignored).

    A longer matching suffix wins over a shorter one; among equally long matches, the most recent.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    batch, width = token_ids.shape
    device = token_ids.device
    lengths = num_tokens.to(torch.int64)
    rows = torch.arange(batch, device=device)
    # Start of the continuation chosen for each row (-1: none yet).
    start = torch.full((batch,), -1, dtype=torch.int64, device=device)
    for n in range(max_n, min_n - 1, -1):
        if n >= width:
            continue
        positions = torch.arange(width - n + 1, device=device)  # candidate match starts
        match = torch.ones(batch, width - n + 1, dtype=torch.bool, device=device)
        for j in range(n):
            suffix_token = token_ids[rows, (lengths - n + j).clamp(min=0)]
            match &= token_ids[:, j:j + width - n + 1] == suffix_token.unsqueeze(1)
        # An earlier occurrence, followed by at least one known token; the suffix itself excluded.
        match &= positions.unsqueeze(0) < (lengths - n).unsqueeze(1)
        last = torch.where(match, positions.unsqueeze(0), -1).amax(dim=1)
        found = (start < 0) & (last >= 0) & (lengths >= n)
        start = torch.where(found, last + n, start)
    num = torch.where(start >= 0, (lengths - start).clamp(max=k), 0)
    offsets = torch.arange(k, device=device)
    index = (start.clamp(min=0).unsqueeze(1) + offsets).clamp(max=width - 1)
    drafts = torch.where(offsets.unsqueeze(0) < num.unsqueeze(1), token_ids.gather(1, index).to(torch.int64), -1)
    return Proposals(drafts, num)
