"""The attention layer a model uses: heads in, heads out, the backend does the rest.

Under ``torch.compile`` the layer is one op. With a backend that supports tracing (Triton), it is
the backend's traced op, whose kernels inductor compiles into its graph; the step's tensors come in
as the compiled forward's inputs (:class:`TracedAttentionInputs`). Otherwise it is one opaque custom
op (``novainfer::attention``), so that inductor never traces the backend's kernels and host-side
planning; the step's metadata and the layers themselves reach that op through
:func:`attention_context`, set around the compiled call (per thread: tensor-parallel ranks may run
as threads of one process).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from novainfer.attention.backends.abstract import AttentionMetadata, TracedAttentionInputs
from novainfer.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    """Paged attention over this rank's local heads.

    The model runner binds ``k_cache``/``v_cache`` ([num_blocks, block_size, num_kv_heads, head_size])
    after it has sized the KV cache; until then they are empty.

    With ``rotary_emb``, queries and keys are rotated (RoPE) at the step's positions first, by the
    backend, which may fuse the rotation into its KV-cache store.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, prefix: str = "",
                 rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{prefix}: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.prefix = prefix
        self.rotary_emb = rotary_emb
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata | TracedAttentionInputs | None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` [T, Hq * D], ``k``/``v`` [T, Hkv * D] (rows may be strided, e.g. views into a fused QKV
        output) -> [T, Hq * D]; ``positions`` [T] is needed with a rotary embedding. Inside a compiled
        forward ``metadata`` is the step's traced inputs, or None for the opaque custom op (see the
        module docstring)."""
        if metadata is None:
            return torch.ops.novainfer.attention(q, k, v, positions, self.prefix)
        num_tokens, head_size = q.shape[0], self.head_size
        query = q.view(num_tokens, self.num_heads, head_size)
        key = k.view(num_tokens, self.num_kv_heads, head_size)
        value = v.view(num_tokens, self.num_kv_heads, head_size)
        backend = metadata.backend
        if isinstance(metadata, TracedAttentionInputs):
            out = backend.forward_traced(metadata, query, key, value, self.k_cache, self.v_cache, self.scale,
                                         positions, self.rotary_emb)
        elif self.rotary_emb is None:
            out = backend.forward(query, key, value, self.k_cache, self.v_cache, metadata, self.scale)
        else:
            out = backend.forward_rotary(positions, self.rotary_emb, query, key, value, self.k_cache, self.v_cache,
                                         metadata, self.scale)
        return out.reshape(num_tokens, self.num_heads * head_size)


_context = threading.local()


@contextmanager
def attention_context(metadata: AttentionMetadata, layers: Mapping[str, Attention]) -> Iterator[None]:
    """Makes ``metadata`` and ``layers`` (by prefix) what ``novainfer::attention`` uses in this thread."""
    previous = getattr(_context, "step", None)
    _context.step = (metadata, layers)
    try:
        yield
    finally:
        _context.step = previous


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
                  layer_name: str) -> torch.Tensor:
    step = getattr(_context, "step", None)
    if step is None:
        raise RuntimeError(f"attention layer {layer_name!r} ran without metadata outside attention_context()")
    metadata, layers = step
    return layers[layer_name](q, k, v, metadata, positions)


def _attention_op_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
                       layer_name: str) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# Registered on the dispatcher directly rather than through ``torch.library.custom_op``, whose Python
# wrapper (output aliasing checks, autograd and in-place/view bookkeeping) costs several times the
# dispatch itself on every call, 24 times per step. The schema declares that the backend may rotate
# ``q`` in place (the Triton store does), so that a compiled graph never reads the query rows
# expecting them unrotated. The KV caches it writes live outside the graph.
_library = torch.library.Library("novainfer", "FRAGMENT")
_library.define("attention(Tensor(a!) q, Tensor k, Tensor v, Tensor? positions, str layer_name) -> Tensor")
for _dispatch_key in ("CPU", "CUDA"):
    _library.impl("attention", _attention_op, _dispatch_key)
torch.library.register_fake("novainfer::attention", _attention_op_fake, lib=_library)
