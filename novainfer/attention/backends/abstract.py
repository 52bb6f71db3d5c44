"""The attention backend interface and the per-step metadata every backend reads.

A step's tokens are flattened (no padding to [B, T]). For sequence ``b`` the step computes
``query_lens[b]`` new tokens that sit at the end of its ``seq_lens[b]`` tokens of context; the
first ``seq_lens[b] - query_lens[b]`` tokens are already in the paged KV cache (an earlier chunk or
a prefix-cache hit). ``slot_mapping[t]`` is where token ``t``'s key/value go:
``block_id * block_size + offset``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from novainfer.layers.rotary_embedding import RotaryEmbedding


@dataclass
class AttentionMetadata:
    num_tokens: int
    num_seqs: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    block_tables: torch.Tensor  # [B, max_blocks] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device
    # [B] host copies, for backends that plan on the host; None in a captured step, whose plan must
    # hold for any step of its shape (lengths bounded by max_query_len and max_seq_len).
    query_lens_cpu: np.ndarray | None
    seq_lens_cpu: np.ndarray | None
    backend: "AttentionBackend"
    # Whatever the backend precomputes once per step and reuses in every layer.
    backend_data: Any = field(default=None)


class AttentionBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Precomputes per-step data (index maps, masks, ...) into ``metadata.backend_data``."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Stores ``key``/``value`` [T, Hkv, D] into the caches at ``slot_mapping``, then attends
        ``query`` [T, Hq, D] causally over each sequence's cached context. Returns [T, Hq, D]."""

    def warm_up(self, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Compiles every kernel variant a step may launch on caches like these with ``num_heads`` query
        heads, so that no step of a workload pays for a first launch (nothing to do by default)."""

    def forward_rotary(self, positions: torch.Tensor, rotary_emb: RotaryEmbedding, query: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """As :meth:`forward`, with ``query`` and ``key`` first rotated by ``rotary_emb`` at ``positions``
        [T] (RoPE). ``query`` and ``key`` may be rotated in place. A backend may fuse the rotation into
        its KV-cache store; this one rotates, then runs :meth:`forward`."""
        query, key = rotary_emb(positions, query, key)
        return self.forward(query, key, value, k_cache, v_cache, metadata, scale)
