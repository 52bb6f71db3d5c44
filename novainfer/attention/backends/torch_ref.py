"""Pure-PyTorch paged attention: the CPU path and the oracle for faster backends.

It gathers each sequence's context from the paged cache into a padded [B, max_seq_len] view and
runs masked attention in float32: written out with einsum and softmax in the reference
(:class:`TorchReferenceBackend`, the oracle), fused by PyTorch's ``scaled_dot_product_attention``
in :class:`TorchSDPABackend` (the default on CPUs; the same gathering, padding and masks).

Decoding sequences (one query each) and sequences computing a prompt chunk are padded separately:
padding every decode to the longest prompt chunk of the step would multiply the work of a mixed
step by that chunk's length. Prompt chunks are grouped by size for the same reason: padding 64
prompts of about 200 tokens to one of 1,500 would do 50x the work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from novainfer.attention.backends.abstract import AttentionBackend, AttentionMetadata


@dataclass
class _PaddedGroup:
    """Sequences attended together in one padded [B, max_q, max_ctx] problem."""

    token_index: torch.Tensor  # [n] flattened token rows of this group, in order
    token_to_padded: torch.Tensor  # [n] position of each of those rows in the [B * max_q] layout
    # [B, ceil(max_ctx / block_size)] cache block of every block of context (clamped where invalid):
    # whole blocks are gathered, block_size rows per index instead of one.
    key_blocks: torch.Tensor
    mask: torch.Tensor  # [B, 1, 1, max_q, max_ctx] True where query i may attend key j
    num_seqs: int
    max_q: int
    max_ctx: int
    all_tokens: bool  # token_index is every token of the step, in order


def _build_group(metadata: AttentionMetadata, all_query_lens: np.ndarray, all_seq_lens: np.ndarray,
                 seqs: np.ndarray) -> _PaddedGroup:
    device = metadata.query_start_loc.device
    query_lens_np = all_query_lens[seqs]
    seq_lens_np = all_seq_lens[seqs]
    num_seqs, max_q, max_ctx = len(seqs), int(query_lens_np.max()), max(int(seq_lens_np.max()), 1)
    starts_np = np.concatenate(([0], np.cumsum(all_query_lens)[:-1]))[seqs]
    num_tokens = int(query_lens_np.sum())
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens_np)
    index_in_seq = np.arange(num_tokens) - np.repeat(np.cumsum(query_lens_np) - query_lens_np, query_lens_np)
    token_index_np = starts_np[seq_of_token] + index_in_seq
    token_to_padded_np = seq_of_token * max_q + index_in_seq

    query_lens = torch.from_numpy(query_lens_np).to(device)
    seq_lens = torch.from_numpy(seq_lens_np).to(device)
    positions = torch.arange(max_ctx, device=device)
    num_blocks = -(-max_ctx // metadata.block_size)
    block_cols = torch.arange(num_blocks, device=device).clamp(max=metadata.block_tables.shape[1] - 1)
    seq_ids = torch.from_numpy(seqs).to(device)
    key_blocks = metadata.block_tables[seq_ids][:, block_cols].to(torch.int64).clamp(min=0)

    q_idx = torch.arange(max_q, device=device)
    context_lens = seq_lens - query_lens  # tokens before this step's first query
    causal = positions[None, None, :] <= (context_lens[:, None, None] + q_idx[None, :, None])
    in_seq = positions[None, None, :] < seq_lens[:, None, None]
    # Padded query rows (i >= query_len) still see key 0, so softmax never divides by zero.
    mask = (causal & in_seq) | (positions[None, None, :] == 0)
    all_tokens = len(token_index_np) == metadata.num_tokens and bool((token_index_np == np.arange(num_tokens)).all())
    return _PaddedGroup(torch.from_numpy(token_index_np).to(device), torch.from_numpy(token_to_padded_np).to(device),
                        key_blocks, mask[:, None, None], num_seqs, max_q, max_ctx, all_tokens)


def _similar_size_groups(seqs: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
                         max_waste: float = 2.0) -> list[np.ndarray]:
    """``seqs`` in groups whose padded problem (sequences x longest query x longest context) is at
    most ``max_waste`` times the work of their own query x context products."""
    groups: list[np.ndarray] = []
    cost = query_lens[seqs] * seq_lens[seqs]
    start, work, max_q, max_ctx = 0, 0, 0, 0
    ordered = seqs[np.argsort(-cost, kind="stable")]
    for i, seq in enumerate(ordered):
        q, ctx = int(query_lens[seq]), int(seq_lens[seq])
        padded = (i - start + 1) * max(max_q, q) * max(max_ctx, ctx)
        if i > start and padded > max_waste * (work + q * ctx):
            groups.append(ordered[start:i])
            start, work, max_q, max_ctx = i, 0, 0, 0
        work, max_q, max_ctx = work + q * ctx, max(max_q, q), max(max_ctx, ctx)
    if len(ordered):
        groups.append(ordered[start:])
    return groups


@dataclass
class _TorchPlan:
    groups: list[_PaddedGroup]
    # Rows with a KV slot, when some have none (a captured step's padding); None: every row has one.
    stored_rows: torch.Tensor | None


class TorchReferenceBackend(AttentionBackend):
    """Also takes the padding of a captured step, as the Triton backend does: a negative slot stores
    nothing, a sequence without query tokens is skipped, and a token of no sequence gets a zero row.
    Without host copies of the lengths (a captured step's metadata), it reads them from the step's
    tensors, which is how graph capture is emulated on a CPU."""

    name = "torch"

    def prepare(self, metadata: AttentionMetadata) -> None:
        stored_rows = None
        if metadata.query_lens_cpu is None:
            query_lens = np.diff(metadata.query_start_loc.cpu().numpy()).astype(np.int64)
            seq_lens = metadata.seq_lens.cpu().numpy().astype(np.int64)
            stored_rows = torch.nonzero(metadata.slot_mapping >= 0).flatten()
        else:
            query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
        # Decodes and prompt chunks apart, each by size: one decode group padded every sequence's
        # context to the longest, and with prompts of a few dozen to a few thousand tokens that
        # gathered and attended several times the keys the step needs.
        groups = [*_similar_size_groups(np.flatnonzero(query_lens == 1), query_lens, seq_lens),
                  *_similar_size_groups(np.flatnonzero(query_lens > 1), query_lens, seq_lens)]
        metadata.backend_data = _TorchPlan(
            [_build_group(metadata, query_lens, seq_lens, seqs) for seqs in groups if len(seqs)], stored_rows)

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale):
        num_kv_heads, head_size = key.shape[1], key.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head_size)
        flat_v = v_cache.view(-1, num_kv_heads, head_size)
        plan: _TorchPlan = metadata.backend_data
        slots = metadata.slot_mapping
        if plan.stored_rows is not None:
            slots, key, value = slots[plan.stored_rows], key[plan.stored_rows], value[plan.stored_rows]
        flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
        flat_v.index_copy_(0, slots, value.to(v_cache.dtype))

        if plan.stored_rows is None and plan.groups and plan.groups[0].all_tokens:  # one group of every token
            return self._attend_group(plan.groups[0], query, k_cache, v_cache, scale).to(query.dtype)
        # Padding tokens of a captured step belong to no sequence: their rows stay zero.
        out = torch.empty_like(query) if plan.stored_rows is None else torch.zeros_like(query)
        for group in plan.groups:
            out[group.token_index] = self._attend_group(group, query, k_cache, v_cache, scale).to(query.dtype)
        return out

    def _attend_group(self, group: _PaddedGroup, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """Attention of ``group``'s query rows (in its ``token_index`` order), in float32."""
        num_heads, head_size = query.shape[1], query.shape[2]
        keys, values = self._context(k_cache, group, "keys"), self._context(v_cache, group, "values")
        rows = query if group.all_tokens else query[group.token_index]
        if group.max_q == 1:  # one query per sequence (decodes): nothing to pad
            padded_q = rows.float().unsqueeze(1)
        else:
            padded_q = query.new_zeros(group.num_seqs * group.max_q, num_heads, head_size, dtype=torch.float32)
            padded_q[group.token_to_padded] = rows.float()
            padded_q = padded_q.view(group.num_seqs, group.max_q, num_heads, head_size)
        result = self._attend(padded_q, keys, values, group.mask, scale)
        result = result.reshape(group.num_seqs * group.max_q, num_heads, head_size)
        return result if group.max_q == 1 else result[group.token_to_padded]

    def _context(self, cache: torch.Tensor, group: _PaddedGroup, name: str) -> torch.Tensor:
        """``group``'s context of ``cache`` (keys or values, by ``name``), [B, max_ctx, Hkv, D] float32."""
        return cache[group.key_blocks].flatten(1, 2)[:, :group.max_ctx].float()

    @staticmethod
    def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Masked attention of padded float32 ``query`` [B, Q, H, D] over ``keys``/``values``
        [B, K, Hkv, D] (query head h reads kv head h // (H / Hkv)); ``mask`` [B, 1, 1, Q, K] is True
        where a query may attend a key. Returns [B, Q, H, D]."""
        batch, max_q, num_heads, head_size = query.shape
        num_kv_heads = keys.shape[2]
        # Query head h*group_size + g reads kv head h (grouped-query attention).
        query = query.view(batch, max_q, num_kv_heads, num_heads // num_kv_heads, head_size)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", query, keys) * scale
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bhgqk,bkhd->bqhgd", probs, values).reshape(batch, max_q, num_heads, head_size)


class TorchSDPABackend(TorchReferenceBackend):
    """The reference's gathering and masks with the attention itself fused by
    ``scaled_dot_product_attention`` (one pass instead of two einsums, a masked fill and a softmax:
    about 1.5x faster for a CPU decode step of 256 sequences over 512 positions)."""

    name = "sdpa"

    def __init__(self) -> None:
        # Flat buffers by (name, dtype), kept from call to call and grown to the largest use.
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._buffers.get((name, dtype))
        if flat is None or flat.numel() < numel or flat.device != device:
            flat = self._buffers[name, dtype] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)

    def _context(self, cache: torch.Tensor, group: _PaddedGroup, name: str) -> torch.Tensor:
        """As the reference's, gathered into buffers kept for the next call: a decode step of 256
        sequences gathers tens of MB per layer, and a fresh tensor that size costs more in page
        faults than the copy (a 10 MB gather on a CPU: 2.5 ms fresh, 1.2 ms into a kept buffer)."""
        blocks = group.key_blocks
        out = self._buffer(name, (blocks.numel(), *cache.shape[1:]), cache.dtype, cache.device)
        gathered = torch.index_select(cache, 0, blocks.view(-1), out=out)
        gathered = gathered.view(blocks.shape[0], -1, *cache.shape[2:])[:, :group.max_ctx]
        if cache.dtype == torch.float32:
            return gathered
        return self._buffer(name, gathered.shape, torch.float32, cache.device).copy_(gathered)

    @staticmethod
    def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
        batch, max_q = query.shape[:2]
        result = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask.view(batch, 1, max_q, -1), scale=scale, enable_gqa=True)
        return result.transpose(1, 2)
