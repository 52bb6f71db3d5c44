"""Tensor-parallel-ready linear layers (seed 000, section 7.1; ARCHITECTURE.md "Layers").

Each parameter carries a ``weight_loader(param, full_tensor, shard_id=None, weight_name=None)``
that receives the FULL checkpoint tensor and keeps this rank's contiguous shard:

* column-parallel layers split the output dimension (weight dim 0, and the bias with it);
* row-parallel layers split the input dimension (weight dim 1); their bias is replicated and
  added once, after the all-reduce of the partial sums;
* fused layers (gate+up, q+k+v) shard every segment separately, then place the local pieces side
  by side (section 7.1.2.1), so that segment boundaries never straddle ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from novainfer.distributed import ProcessGroup, get_tp_group
from novainfer.layers.sharding import WeightShardError, copy_shard, divide


class LinearBase(nn.Module):
    """``y = x W^T + b`` with W stored as this rank's shard.

    ``tp_dim`` is the weight dimension that is sharded: 0 for column parallel, 1 for row
    parallel, ``None`` for a replicated layer.
    """

    tp_dim: int | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 params_dtype: torch.dtype | None = None, tp_group: ProcessGroup | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.tp_group = tp_group if tp_group is not None else get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.world_size if self.tp_dim is not None else 1
        self.prefix = prefix
        self.input_size = input_size
        self.output_size = output_size
        global_shape = (output_size, input_size)
        local_shape = list(global_shape)
        if self.tp_dim is not None:
            local_shape[self.tp_dim] = divide(global_shape[self.tp_dim], self.tp_size, dim=self.tp_dim,
                                              global_shape=global_shape, weight_name=f"{prefix}.weight",
                                              tp_rank=self.tp_rank)
        self.output_size_per_partition, self.input_size_per_partition = local_shape
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(local_shape, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.weight_name = f"{prefix}.weight"
        if bias:
            bias_size = self.output_size_per_partition if self.tp_dim == 0 else output_size
            self.bias = nn.Parameter(torch.empty(bias_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.weight_name = f"{prefix}.bias"
        else:
            self.register_parameter("bias", None)

    def _param_shard_dim(self, param: nn.Parameter) -> int | None:
        if param is self.bias:
            return 0 if self.tp_dim == 0 else None
        return self.tp_dim

    def _segment(self, param: nn.Parameter, shard_id: int | str | None) -> torch.Tensor:
        """The part of ``param`` that a checkpoint tensor with ``shard_id`` fills (all of it here)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} {self.prefix!r} has no shard {shard_id!r}")
        return param.data

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None, weight_name: str | None = None) -> None:
        copy_shard(self._segment(param, shard_id), loaded_weight.to(param.dtype),
                   shard_dim=self._param_shard_dim(param), tp_rank=self.tp_rank, tp_size=self.tp_size,
                   weight_name=weight_name or param.weight_name)

    def _weight_t(self) -> torch.Tensor:
        """``weight.t()``, a view made once and reused while it still views the weight's storage (a
        ``.to()`` of the module or a ``.data`` assignment swaps the storage and it is made anew)."""
        weight = self.weight
        cached = self.__dict__.get("_cached_weight_t")
        if cached is None or cached.data_ptr() != weight.data_ptr():
            cached = self.__dict__["_cached_weight_t"] = weight.t()
        return cached

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``. For the model's [T, in] activations it calls the op F.linear
        calls for them (``addmm(bias, x, weight.t())``, or ``mm`` without a bias: the same kernel, the
        same bits) on a cached transposed view, which saves the per-call dispatch of ``linear``,
        ``t``, ``transpose``, ``as_strided`` and ``matmul`` in every layer of an eager step."""
        if x.dim() != 2 or torch.compiler.is_compiling():
            return F.linear(x, self.weight, bias)
        weight_t = self._weight_t()
        return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    tp_dim = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; each rank returns its slice of the output (no communication)."""

    tp_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class _SegmentedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel layer made of several checkpoint tensors stacked on the output dimension."""

    def __init__(self, input_size: int, segment_sizes: Sequence[int], shard_ids: Sequence[int | str],
                 bias: bool = False, **kwargs) -> None:
        super().__init__(input_size, sum(segment_sizes), bias, **kwargs)
        offsets: dict[int | str, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in zip(shard_ids, segment_sizes, strict=True):
            local = divide(size, self.tp_size, dim=0, global_shape=(size, input_size),
                           weight_name=f"{self.prefix}[{shard_id}]", tp_rank=self.tp_rank)
            offsets[shard_id] = (offset, local)
            offset += local
        self.segment_offsets = offsets
        self.segment_sizes_per_partition = [offsets[s][1] for s in shard_ids]

    def _segment(self, param: nn.Parameter, shard_id: int | str | None) -> torch.Tensor:
        if shard_id not in self.segment_offsets:
            raise ValueError(f"{type(self).__name__} {self.prefix!r}: unknown shard_id {shard_id!r}, "
                             f"expected one of {list(self.segment_offsets)}")
        start, size = self.segment_offsets[shard_id]
        return param.data.narrow(0, start, size)


class MergedColumnParallelLinear(_SegmentedColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate_proj + up_proj).

    Shard ids are the segment indices 0, 1, ...
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, **kwargs) -> None:
        super().__init__(input_size, output_sizes, list(range(len(output_sizes))), bias, **kwargs)


class QKVParallelLinear(_SegmentedColumnParallelLinear):
    """Fused q/k/v projection; shard ids "q", "k", "v".

    Every rank keeps ``num_heads / tp`` query heads and ``num_kv_heads / tp`` key/value heads.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, **kwargs) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        sizes = [total_num_heads * head_size, total_num_kv_heads * head_size, total_num_kv_heads * head_size]
        super().__init__(hidden_size, sizes, ["q", "k", "v"], bias, **kwargs)
        self.num_heads = total_num_heads // self.tp_size
        self.num_kv_heads = total_num_kv_heads // self.tp_size
        if self.num_heads * self.tp_size != total_num_heads or self.num_kv_heads * self.tp_size != total_num_kv_heads:
            raise WeightShardError(
                f"attention heads are not divisible by tensor_parallel_size {self.tp_size} "
                f"(num_heads={total_num_heads}, num_kv_heads={total_num_kv_heads})",
                weight_name=f"{self.prefix}.weight", global_shape=(sum(sizes), hidden_size),
                local_shape=(sum(sizes) / self.tp_size, hidden_size), tp_size=self.tp_size, tp_rank=self.tp_rank)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; partial outputs are summed with one all-reduce.

    ``input_is_parallel``: the input already holds this rank's slice (the output of a
    column-parallel layer), as in every use inside a decoder layer.
    """

    tp_dim = 1

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 reduce_results: bool = True, **kwargs) -> None:
        super().__init__(input_size, output_size, bias, **kwargs)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, None)
        if self.reduce_results:
            # Always through the group: a single-rank group makes this a no-op, and one code path
            # keeps the number of collectives per layer the same at every tensor-parallel size.
            self.tp_group.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
