"""The Triton backend's attention as one op that inductor traces into a compiled forward.

The opaque ``novainfer::attention`` op (:mod:`novainfer.attention.layer`) calls back into Python in
every layer of a compiled step: the backend's planning, the kernels' argument checks and launches,
about as much host time as the eager layer spends there. ``novainfer::triton_attention`` is a
``torch.library.triton_op`` instead: its body launches the kernels through ``wrap_triton``, so inductor
sees the Triton kernels themselves, puts them in its graph and launches them from its generated code
(Python, or C++ with inductor's C++ wrapper) with nothing of ours running per layer.

The step's plan comes in as tensors and constants of the graph (:class:`TracedAttentionInputs`): a
decode-only step launches the store and the decode kernel; any other step launches the store, the
prefill kernel over the sequences with several queries and the decode kernel over the others (each
skips, on the device, the sequences that belong to the other, as in a captured mixed step). The
decode's number of splits is the size of the workspace passed in, so a new count compiles nothing
(one graph for one split, one for any other count).
"""

from __future__ import annotations

import torch
from torch.library import triton_op

from novainfer.attention.ops.decode_attention import decode_attention
from novainfer.attention.ops.prefill_attention import prefill_attention
from novainfer.attention.ops.reshape_and_cache import reshape_and_cache, rotary_embedding_and_cache


@triton_op("novainfer::triton_attention", mutates_args={"k_cache", "v_cache"})
def triton_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, positions: torch.Tensor | None, cos_cached: torch.Tensor | None,
                     sin_cached: torch.Tensor | None, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, query_start_loc: torch.Tensor, split_out: torch.Tensor,
                     split_lse: torch.Tensor, scale: float, decode_only: bool) -> torch.Tensor:
    """Stores ``key``/``value`` [T, Hkv, D] (rotated, with ``query`` [T, Hq, D], when ``positions`` is
    given), then attends; returns [T, Hq, D]. See the module docstring."""
    if positions is None:
        reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, traced=True)
    else:
        # Rotated into a new tensor: rotating ``query`` (a view of the QKV product) in place would make
        # inductor copy it out of the product before the op and back after it, two kernels per layer.
        rotated = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        rotary_embedding_and_cache(positions, query, key, value, k_cache, v_cache, slot_mapping, cos_cached,
                                   sin_cached, traced=True, query_out=rotated)
        query = rotated
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_splits = split_lse.shape[2]
    if not decode_only:
        prefill_attention(query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                          skip_decodes=True, traced=True)
    decode_attention(query, k_cache, v_cache, out, seq_lens, block_tables, scale, num_splits,
                     query_start_loc=None if decode_only else query_start_loc,
                     workspace=(split_out, split_lse) if num_splits > 1 else None, traced=True)
    return out
