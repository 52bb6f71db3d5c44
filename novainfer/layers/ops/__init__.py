"""Triton kernels of the small per-token layers (CUDA only; the layers keep a PyTorch path elsewhere).

Each kernel rounds at the same places as the layer's PyTorch code, so the two paths agree to the
last bit up to the order of a float32 reduction.
"""

from novainfer.layers.ops.activation import silu_and_mul
from novainfer.layers.ops.rms_norm import fused_add_rms_norm_, rms_norm
from novainfer.layers.ops.rotary_embedding import rotary_embedding_

__all__ = ["fused_add_rms_norm_", "rms_norm", "rotary_embedding_", "silu_and_mul"]
