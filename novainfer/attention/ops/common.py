"""Host-side checks and constants shared by the attention kernels' Python wrappers."""

from __future__ import annotations

import functools

import torch

from novainfer.layers.ops.common import next_power_of_2

LOG2E = 1.4426950408889634
# The Triton interpreter (CPU tensors) has no SM count; any small number exercises the same paths.
_INTERPRETER_SMS = 8


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (what the kernels size their grids against)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def head_pad(head_size: int) -> int:
    """The head dimension a kernel tile uses: a power of two, at least 16 (the smallest dot operand)."""
    return max(16, next_power_of_2(head_size))


def dot_precision(dtype: torch.dtype) -> str:
    # float32 runs are the exact path (tests, CPU-like numerics): no TF32 rounding of the operands.
    return "ieee" if dtype == torch.float32 else "tf32"


def scale_log2(scale: float) -> float:
    """The softmax scale folded with log2(e): the kernels exponentiate with exp2."""
    return scale * LOG2E


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    """The kernels index both caches with one set of strides and assume unit stride along the head dim."""
    expected = (k_cache.shape[0], k_cache.shape[1], num_kv_heads, head_size)
    if tuple(k_cache.shape) != expected or tuple(v_cache.shape) != expected:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[num_blocks, block_size, num_kv_heads={num_kv_heads}, head_size={head_size}]")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache and v_cache need equal strides with a contiguous head dim, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")


def check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    """The output is written with the query's shape through its own row strides, unit stride last."""
    if out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"out must have the query's shape {tuple(query.shape)} and a contiguous head dim, got "
                         f"shape {tuple(out.shape)} with strides {out.stride()}")


def queries_per_kv(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head (grouped-query attention: query head ``h * group + g`` reads KV head ``h``)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (rows may be strided), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
