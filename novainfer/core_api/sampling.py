"""Picking a token from one logits row (sampling proper stays with the caller; this is a convenience)."""

from __future__ import annotations

import torch


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                 generator: torch.Generator | None = None) -> int:
    """Greedy when ``temperature`` is 0, else a draw from softmax(logits / temperature) over the
    ``top_k`` largest logits (all of them when ``top_k`` is 0). ``generator`` must live on the
    logits' device."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        values, indices = logits.topk(top_k)
        choice = torch.multinomial(torch.softmax(values, -1), 1, generator=generator)
        return int(indices[choice])
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
