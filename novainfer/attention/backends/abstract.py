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
from typing import TYPE_CHECKING, Any, NamedTuple

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


class TracedAttentionInputs(NamedTuple):
    """A step's attention inputs as a compiled forward takes them when its backend's attention is traced
    into the compiled graph (:meth:`AttentionBackend.traced_inputs`). The tensors are the graph's
    inputs; ``backend`` and ``decode_only`` are constants of the graph (one graph per kind of step)."""

    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    # The split-K decode's float32 workspace (partial outputs [B, Hq, S, Dpad], log-sum-exps [B, Hq, S]);
    # its size S is the step's number of splits (1: no workspace is used).
    split_out: torch.Tensor
    split_lse: torch.Tensor
    backend: "AttentionBackend"
    decode_only: bool


class AttentionBackend(ABC):
    name: str = "abstract"
    # Whether traced_inputs/forward_traced exist: attention that inductor compiles into the graph.
    supports_tracing: bool = False

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

    def traced_inputs(self, metadata: AttentionMetadata, num_heads: int,
                      k_cache: torch.Tensor) -> TracedAttentionInputs:
        """The inputs :meth:`forward_traced` takes in every layer of the step ``metadata`` describes
        (after :meth:`prepare`), for layers of ``num_heads`` query heads on caches like ``k_cache``."""
        raise NotImplementedError(f"the {self.name} attention backend is not traced by torch.compile")

    def forward_traced(self, inputs: TracedAttentionInputs, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                       positions: torch.Tensor | None = None,
                       rotary_emb: RotaryEmbedding | None = None) -> torch.Tensor:
        """:meth:`forward` (or with ``rotary_emb``, :meth:`forward_rotary`) as one op that inductor
        traces into a compiled forward."""
        raise NotImplementedError(f"the {self.name} attention backend is not traced by torch.compile")
