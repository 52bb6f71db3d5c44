"""Rotary position embedding (the "rotate half" / GPT-NeoX layout used by Qwen2 and Llama).

Context-extension schemes (``linear``, ``llama3``) only change the inverse frequencies; the
cos/sin tables, and every kernel that reads them, stay the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

# The ``rope_type`` values a model config may name ("default" is plain RoPE).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How the inverse frequencies are stretched for contexts longer than pre-training.

    ``linear``: every frequency divided by ``factor``. ``llama3``: frequencies whose wavelength
    exceeds ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those
    shorter than ``original_max_position_embeddings / high_freq_factor`` are kept, and those between
    are interpolated.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope_scaling type {self.rope_type!r} is not supported; "
                                      f"supported types: {list(SUPPORTED_ROPE_TYPES)}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if not self.original_max_position_embeddings or self.original_max_position_embeddings < 1:
                raise ValueError(f"llama3 rope_scaling needs original_max_position_embeddings >= 1, "
                                 f"got {self.original_max_position_embeddings}")
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(f"llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                                 f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}")

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """``inv_freq`` (float32) as this scheme uses it."""
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        context = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        slowed = inv_freq / self.factor
        # 0 at the long-wavelength edge of the band (fully slowed), 1 at the short one (kept).
        smooth = (context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(wavelen > context / self.low_freq_factor, slowed,
                           torch.where(wavelen < context / self.high_freq_factor, inv_freq, blended))


def rope_inv_freq(head_size: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The float32 inverse frequency of each of the ``head_size / 2`` rotated pairs."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    return scaling.scale(inv_freq) if scaling is not None else inv_freq


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at arbitrary (flattened, per-token) positions.

    A cos/sin table for every position up to ``max_position`` is built once in float32. It is the
    same for every layer of a model, so a model builds one and shares it.
    """

    def __init__(self, head_size: int, max_position: int, base: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"rotary head_size must be even, got {head_size}")
        self.head_size = head_size
        self.max_position = max_position
        self.base = base
        self.scaling = scaling or RopeScaling()
        inv_freq = rope_inv_freq(head_size, base, self.scaling)
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

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.max_position}, base={self.base}, {self.scaling}"
