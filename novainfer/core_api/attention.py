"""Attention over KV cells for the low-level API, and re-rotating cached keys to new positions.

Two paths read the same cache ([n_ctx, 1, num_kv_heads, head_size]: a paged cache whose blocks
are single cells):

* paged: when every token of a batch belongs to one sequence, each sequence's context is its cells
  in position order followed by its new tokens, which is exactly what the engine's backends
  (:mod:`novainfer.attention`) compute over a block table of block size 1;
* masked (:class:`MaskedCellAttention`): the general rule, any batch. Token ``t`` sees cell ``c``
  when their sequence sets intersect and ``pos[c] <= pos[t]``; pure PyTorch, float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from novainfer.attention import AttentionBackend


@dataclass
class CellMask:
    """One masked step: the cells attended, and which of them each new token sees."""

    cells: torch.Tensor  # [C] int64
    visible: torch.Tensor  # [T, C] bool


class MaskedCellAttention(AttentionBackend):
    """Stores the new K/V at ``slot_mapping``, then attends every token over ``backend_data.cells``
    under ``backend_data.visible`` (a :class:`CellMask` the caller builds from cell metadata)."""

    name = "cells-masked"

    def prepare(self, metadata) -> None:
        pass  # the mask is built from cell metadata, which the backend does not see

    def forward(self, query, key, value, k_cache, v_cache, metadata, scale):
        plan: CellMask = metadata.backend_data
        num_tokens, num_heads, head_size = query.shape
        num_kv_heads = key.shape[1]
        flat_k = k_cache.view(-1, num_kv_heads, head_size)
        flat_v = v_cache.view(-1, num_kv_heads, head_size)
        flat_k.index_copy_(0, metadata.slot_mapping, key.to(k_cache.dtype))
        flat_v.index_copy_(0, metadata.slot_mapping, value.to(v_cache.dtype))
        keys = flat_k[plan.cells].float()  # [C, Hkv, D]
        values = flat_v[plan.cells].float()
        # Query head h * group + g reads KV head h (grouped-query attention).
        q = query.float().view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_size)
        scores = torch.einsum("thgd,chd->hgtc", q, keys) * scale
        scores.masked_fill_(~plan.visible, float("-inf"))
        out = torch.einsum("hgtc,chd->thgd", torch.softmax(scores, dim=-1), values)
        return out.reshape(num_tokens, num_heads, head_size).to(query.dtype)


def find_rotaries(model: torch.nn.Module) -> list[torch.nn.Module | None]:
    """The rotary embedding each attention layer's keys went through (None for a layer without one).

    A rotary embedding is any module with ``cos_cached``/``sin_cached`` tables ([max_position,
    rotary_dim], "rotate half" layout, rope scaling already applied). A layer's is the nearest one
    found going up from the attention layer through its enclosing modules.
    """
    parent: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parent[id(child)] = module
    found = []
    for layer in model.attention_layers():
        rotary, node = None, parent.get(id(layer))
        while rotary is None and node is not None:
            rotary = next((m for m in node.modules() if hasattr(m, "cos_cached") and hasattr(m, "sin_cached")), None)
            node = parent.get(id(node))
        found.append(rotary)
    return found


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_keys(flat_k: torch.Tensor, cells: torch.Tensor, rotary: torch.nn.Module, delta: int) -> None:
    """Rotates the cached keys ``flat_k[cells]`` ([n_ctx, Hkv, D]) from position p to p + delta, in place.

    RoPE rotations compose (R(p + delta) = R(delta) R(p)), so this is one rotation by ``delta``. Its
    cos/sin are the model's own table at ``|delta|`` (with any rope scaling), normalised to drop a
    magnitude factor some scalings fold into the table, sin negated for a negative shift.
    """
    row = abs(delta)
    cos = rotary.cos_cached[row].float()
    sin = rotary.sin_cached[row].float()
    norm = torch.sqrt(cos * cos + sin * sin)
    cos, sin = cos / norm, sin / norm * (1 if delta > 0 else -1)
    rot = cos.shape[-1]
    keys = flat_k[cells].float()
    part = keys[..., :rot]
    keys[..., :rot] = part * cos + _rotate_half(part) * sin
    flat_k.index_copy_(0, cells, keys.to(flat_k.dtype))
