"""Pure-PyTorch paged attention: the CPU path and the oracle for faster backends.

It gathers each sequence's context from the paged cache into a padded [B, max_seq_len] view and
runs masked attention in float32. Simple and exact; memory grows with B * max_q * max_seq_len.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from novainfer.attention.backends.abstract import AttentionBackend, AttentionMetadata


@dataclass
class _TorchRefStepData:
    token_to_padded: torch.Tensor  # [T] index of each flattened token in the [B * max_q] padded layout
    key_slots: torch.Tensor  # [B, max_ctx] cache slot of every context position (clamped where invalid)
    mask: torch.Tensor  # [B, 1, 1, max_q, max_ctx] True where query i may attend key j


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def prepare(self, metadata: AttentionMetadata) -> None:
        device = metadata.query_start_loc.device
        num_seqs = metadata.num_seqs
        max_q, max_ctx = metadata.max_query_len, metadata.max_seq_len
        query_lens = torch.from_numpy(metadata.query_lens_cpu).to(device=device, dtype=torch.int64)
        seq_lens = metadata.seq_lens.to(torch.int64)
        starts = metadata.query_start_loc[:-1].to(torch.int64)

        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
        index_in_seq = torch.arange(metadata.num_tokens, device=device) - starts[seq_of_token]
        token_to_padded = seq_of_token * max_q + index_in_seq

        positions = torch.arange(max_ctx, device=device)
        block_idx = (positions // metadata.block_size).clamp(max=metadata.block_tables.shape[1] - 1)
        blocks = metadata.block_tables.to(torch.int64)[:, block_idx].clamp(min=0)
        key_slots = blocks * metadata.block_size + positions % metadata.block_size

        q_idx = torch.arange(max_q, device=device)
        context_lens = seq_lens - query_lens  # tokens before this step's first query
        causal = positions[None, None, :] <= (context_lens[:, None, None] + q_idx[None, :, None])
        in_seq = positions[None, None, :] < seq_lens[:, None, None]
        # Padded query rows (i >= query_len) still see key 0, so softmax never divides by zero.
        mask = (causal & in_seq) | (positions[None, None, :] == 0)
        metadata.backend_data = _TorchRefStepData(token_to_padded, key_slots, mask[:, None, None])

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale):
        data: _TorchRefStepData = metadata.backend_data
        num_kv_heads, head_size = key.shape[1], key.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head_size)
        flat_v = v_cache.view(-1, num_kv_heads, head_size)
        flat_k.index_copy_(0, metadata.slot_mapping, key.to(k_cache.dtype))
        flat_v.index_copy_(0, metadata.slot_mapping, value.to(v_cache.dtype))

        num_seqs, max_q = metadata.num_seqs, metadata.max_query_len
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        keys = flat_k[data.key_slots].float()  # [B, max_ctx, Hkv, D]
        values = flat_v[data.key_slots].float()
        padded_q = query.new_zeros(num_seqs * max_q, num_heads, head_size, dtype=torch.float32)
        padded_q[data.token_to_padded] = query.float()
        # Query head h*group + g reads kv head h (grouped-query attention).
        padded_q = padded_q.view(num_seqs, max_q, num_kv_heads, group, head_size)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", padded_q, keys) * scale
        scores.masked_fill_(~data.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, values)
        out = out.reshape(num_seqs * max_q, num_heads, head_size)[data.token_to_padded]
        return out.to(query.dtype)
