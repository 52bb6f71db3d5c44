"""Triton attention backend: paged KV store, varlen prefill and split-K decode kernels (CUDA).

What ``forward`` reads from :class:`AttentionMetadata` (device tensors are read on the device only;
nothing here synchronises with the host, so a decode-only step can be captured in a CUDA graph):

- ``slot_mapping`` [T] int64: cache slot of each new token; a negative slot skips the row.
- ``seq_lens`` [B] int32: true context length of each sequence including this step's tokens;
  0 marks a padding row (its output row is zero and nothing is read for it).
- ``block_tables`` [B, max_blocks] int32 (rows may be strided): only the first
  ``ceil(seq_lens[b] / block_size)`` entries of row ``b`` are read.
- ``query_start_loc`` [B + 1] int32: read only in steps that contain a prefill (``max_query_len > 1``).
  In a decode-only step, token row ``b`` belongs to sequence ``b`` and ``T`` must equal ``num_seqs``.
- ``num_seqs`` (= B) and, through :meth:`prepare`, ``max_query_len``, ``max_seq_len`` (an upper bound is
  fine: it only picks the number of decode splits) and, for mixed steps, ``query_lens_cpu`` /
  ``seq_lens_cpu``. Without those host copies (a captured mixed step, whose contents change from
  replay to replay) both kernels are launched over every sequence slot: each skips on the device
  the sequences that belong to the other, and the empty ones.
- ``backend_data``: the :class:`TritonAttentionPlan` that :meth:`prepare` stored. It also holds the
  split-K workspace allocated by the step's first layer and reused by the others. Under CUDA-graph
  capture, run ``prepare`` for the captured metadata inside the capture (or keep that metadata alive
  as long as the graph), so that the graph's workspace cannot be handed to other tensors.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from novainfer.attention.backends.abstract import AttentionBackend, AttentionMetadata, TracedAttentionInputs
from novainfer.attention.ops import (MAX_SPLITS, choose_num_splits, decode_attention, decode_workspace_shape,
                                     prefill_attention, prefill_tile_config, reshape_and_cache,
                                     rotary_embedding_and_cache)
from novainfer.attention.ops.common import num_sms
from novainfer.attention.ops.traced_attention import triton_attention
from novainfer.layers.rotary_embedding import RotaryEmbedding


@dataclass
class TritonAttentionPlan:
    """What one step's layers share: which kernels run, and how the decode kernel splits its work."""

    decode_only: bool
    num_decodes: int  # sequences with one query token (the split-K decode kernel's)
    has_prefills: bool  # sequences with more than one query token (the prefill kernel's)
    decode_max_seq_len: int  # bound on the decodes' context lengths (picks the number of splits)
    # (num_kv_heads, head_size, num_heads) -> (num_splits, split-K workspace or None), decided by the
    # step's first layer and reused by the others.
    decode_splits: dict[tuple[int, int, int], tuple[int, tuple[torch.Tensor, torch.Tensor] | None]] = \
        field(default_factory=dict)

    def decode_launch(self, num_seqs: int, num_heads: int, k_cache: torch.Tensor):
        """The number of decode splits and the workspace they need, for layers of this cache shape."""
        num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
        key = (num_kv_heads, head_size, num_heads)
        launch = self.decode_splits.get(key)
        if launch is None:
            device = k_cache.device
            num_splits = choose_num_splits(self.num_decodes, num_kv_heads, head_size, self.decode_max_seq_len,
                                           num_sms(device))
            workspace = None
            if num_splits > 1:
                out_shape, lse_shape = decode_workspace_shape(num_seqs, num_heads, head_size, num_splits)
                workspace = (torch.empty(out_shape, dtype=torch.float32, device=device),
                             torch.empty(lse_shape, dtype=torch.float32, device=device))
            launch = self.decode_splits[key] = (num_splits, workspace)
        return launch


class TritonAttentionBackend(AttentionBackend):
    """Stores K/V, then attends: prefill rows through the varlen kernel, decode rows through split-K.

    A decode-only step is one store and one decode launch (plus a reduce when split). A step that
    holds prompt chunks runs the prefill kernel over the sequences with more than one query and,
    if some sequences decode, the decode kernel over those, on a side stream beside it. With RoPE
    (:meth:`forward_rotary`) the rotation is part of the store: one kernel rotates the queries in
    place and stores rotated keys.
    """

    name = "triton"
    supports_cuda_graphs = True
    supports_tracing = True

    def prepare(self, metadata: AttentionMetadata) -> None:
        if metadata.max_query_len == 1:
            if metadata.num_tokens != metadata.num_seqs:
                raise ValueError(f"a decode-only step needs one token per sequence, got {metadata.num_tokens} "
                                 f"tokens for num_seqs={metadata.num_seqs}")
            plan = TritonAttentionPlan(True, metadata.num_seqs, False, metadata.max_seq_len)
        elif metadata.query_lens_cpu is None:  # a captured mixed step: any mix of its sequences
            plan = TritonAttentionPlan(False, metadata.num_seqs, True, metadata.max_seq_len)
        else:
            is_decode = metadata.query_lens_cpu == 1
            num_decodes = int(is_decode.sum())
            decode_max = int(metadata.seq_lens_cpu[is_decode].max()) if num_decodes else 0
            plan = TritonAttentionPlan(False, num_decodes, True, decode_max)
        metadata.backend_data = plan

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale):
        reshape_and_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        return self._attend(query, k_cache, v_cache, metadata, scale)

    def forward_rotary(self, positions, rotary_emb, query, key, value, k_cache, v_cache, metadata, scale):
        rotary_embedding_and_cache(positions, query, key, value, k_cache, v_cache, metadata.slot_mapping,
                                   rotary_emb.cos_cached, rotary_emb.sin_cached)
        return self._attend(query, k_cache, v_cache, metadata, scale)

    def traced_inputs(self, metadata: AttentionMetadata, num_heads: int,
                      k_cache: torch.Tensor) -> TracedAttentionInputs:
        plan: TritonAttentionPlan = metadata.backend_data
        workspace = None
        if plan.num_decodes:
            _, workspace = plan.decode_launch(metadata.num_seqs, num_heads, k_cache)
        split_out, split_lse = workspace or _no_workspace(k_cache.device)
        return TracedAttentionInputs(metadata.slot_mapping, metadata.seq_lens, metadata.block_tables,
                                     metadata.query_start_loc, split_out, split_lse, self, plan.decode_only)

    def forward_traced(self, inputs: TracedAttentionInputs, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                       positions: torch.Tensor | None = None,
                       rotary_emb: RotaryEmbedding | None = None) -> torch.Tensor:
        rotary = rotary_emb is not None
        return triton_attention(query, key, value, k_cache, v_cache, positions if rotary else None,
                                rotary_emb.cos_cached if rotary else None, rotary_emb.sin_cached if rotary else None,
                                inputs.slot_mapping, inputs.seq_lens, inputs.block_tables, inputs.query_start_loc,
                                inputs.split_out, inputs.split_lse, scale, inputs.decode_only)

    def warm_up(self, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Launches each variant once on one sequence of one token in block 0 (the kernels only read the
        caches): the prefill kernel with and without decodes to skip, at each tile size a step's size may
        pick (:func:`prefill_tile_config`), and the decode kernel for decode-only
        and mixed steps, unsplit and at every split count's compiled size (its reduction is specialized
        to the split count's power of two). Which of these a step uses depends on its decodes' number
        and lengths, so an eager step beyond the captured ones could otherwise compile mid-run."""
        device, head_size = k_cache.device, k_cache.shape[3]
        query = torch.zeros(1, num_heads, head_size, dtype=k_cache.dtype, device=device)
        out = torch.empty_like(query)
        seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
        block_tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
        tiles = {prefill_tile_config(head_size, query_rows, num_sms(device)) for query_rows in (0, 2 ** 62)}
        for skip_decodes, config in itertools.product((False, True), tiles):
            prefill_attention(query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, 1.0,
                              skip_decodes=skip_decodes, config=config)
        num_splits = 1
        while num_splits <= MAX_SPLITS:
            for start_loc in (None, query_start_loc):
                decode_attention(query, k_cache, v_cache, out, seq_lens, block_tables, 1.0, num_splits,
                                 query_start_loc=start_loc)
            num_splits *= 2

    @staticmethod
    def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        plan: TritonAttentionPlan = metadata.backend_data
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)

        def decode() -> None:
            decode_attention(query, k_cache, v_cache, out, metadata.seq_lens, metadata.block_tables, scale,
                             num_splits, query_start_loc=None if plan.decode_only else metadata.query_start_loc,
                             workspace=workspace)

        def prefill() -> None:
            prefill_attention(query, k_cache, v_cache, out, metadata.query_start_loc, metadata.seq_lens,
                              metadata.block_tables, scale, skip_decodes=plan.num_decodes > 0)

        if plan.num_decodes:
            num_splits, workspace = plan.decode_launch(metadata.num_seqs, query.shape[1], k_cache)
        if plan.has_prefills and plan.num_decodes:
            _concurrently(prefill, decode, query.device)
        elif plan.has_prefills:
            prefill()
        else:
            decode()
        return out


@functools.cache
def _no_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace a traced step of one decode split passes: its split dimension (1) is what counts."""
    return (torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device),
            torch.empty((1, 1, 1), dtype=torch.float32, device=device))


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _concurrently(first: Callable[[], None], second: Callable[[], None], device: torch.device) -> None:
    """Runs ``first`` on the current stream and ``second`` on a side stream beside it, both after
    what the current stream holds and before what it gets next. In a mixed step the prefill kernel
    (a few programs per prompt tile, the last walking the whole prompt) leaves most of the GPU idle
    in its tail; the decode kernel, which writes other rows of the output, fills it. Captured in a
    CUDA graph, the fork and join are edges of the graph."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    first()  # launched first: its longest programs should start first
    with torch.cuda.stream(side):
        second()
    main.wait_stream(side)
