"""The attention layer a model uses: heads in, heads out, the backend does the rest."""

from __future__ import annotations

import torch
from torch import nn

from novainfer.attention.backends.abstract import AttentionMetadata


class Attention(nn.Module):
    """Paged attention over this rank's local heads.

    The model runner binds ``k_cache``/``v_cache`` ([num_blocks, block_size, num_kv_heads, head_size])
    after it has sized the KV cache; until then they are empty.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, prefix: str = "") -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{prefix}: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.prefix = prefix
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        out = metadata.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_size)
