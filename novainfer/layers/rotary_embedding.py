"""Rotary position embedding (the "rotate half" / GPT-NeoX layout used by Qwen2)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at arbitrary (flattened, per-token) positions.

    A cos/sin table for every position up to ``max_position`` is built once in float32.
    """

    def __init__(self, head_size: int, max_position: int, base: float) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"rotary head_size must be even, got {head_size}")
        self.head_size = head_size
        self.max_position = max_position
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_size]: cos of each frequency, then sin, each repeated for both halves.
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """``query`` [T, Hq, D] and ``key`` [T, Hkv, D] rotated by ``positions`` [T] (new tensors)."""
        cos = self.cos_cached[positions].unsqueeze(1).to(query.dtype)
        sin = self.sin_cached[positions].unsqueeze(1).to(query.dtype)
        q = query * cos + self._rotate_half(query) * sin
        k = key * cos + self._rotate_half(key) * sin
        return q, k

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """As :meth:`forward_native`; on CUDA a Triton kernel rotates ``query`` and ``key`` in place
        (in float32, rounded once) and returns them."""
        if query.is_cuda:
            from novainfer.layers.ops import rotary_embedding_

            rotary_embedding_(positions, query, key, self.cos_cached, self.sin_cached)
            return query, key
        return self.forward_native(positions, query, key)
