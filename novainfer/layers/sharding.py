"""Cutting a full checkpoint tensor into this rank's contiguous shard (seed 000, section 7.1.3)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class WeightShardError(ValueError):
    """A weight cannot be sharded or does not have the shape the model expects.

    The message always names ``weight_name``, ``global_shape``, ``local_shape``, ``tp_size`` and
    ``tp_rank`` so a bad checkpoint or an impossible tensor-parallel size is diagnosable at once.
    """

    def __init__(self, reason: str, *, weight_name: str, global_shape: Sequence[int | float],
                 local_shape: Sequence[int | float], tp_size: int, tp_rank: int) -> None:
        self.weight_name = weight_name
        self.global_shape = tuple(global_shape)
        self.local_shape = tuple(local_shape)
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        super().__init__(
            f"{reason} (weight_name={weight_name}, global_shape={self.global_shape}, "
            f"local_shape={self.local_shape}, tp_size={tp_size}, tp_rank={tp_rank})")


def divide(size: int, tp_size: int, *, dim: int, global_shape: Sequence[int], weight_name: str,
           tp_rank: int) -> int:
    """``size / tp_size``, or a ``WeightShardError`` when it is not a whole number."""
    if size % tp_size != 0:
        local = list(global_shape)
        local[dim] = size / tp_size
        raise WeightShardError(
            f"dimension {dim} of size {size} is not divisible by tensor_parallel_size {tp_size}",
            weight_name=weight_name, global_shape=global_shape, local_shape=local,
            tp_size=tp_size, tp_rank=tp_rank)
    return size // tp_size


def copy_shard(dest: torch.Tensor, full: torch.Tensor, *, shard_dim: int | None, tp_rank: int, tp_size: int,
               weight_name: str) -> None:
    """Copies this rank's contiguous chunk of ``full`` along ``shard_dim`` into ``dest``.

    ``shard_dim=None`` means the tensor is replicated: ``full`` must match ``dest`` exactly.
    Any mismatch names the expected and the actual shapes.
    """
    global_shape = tuple(full.shape)
    expected_global = list(dest.shape)
    if shard_dim is not None:
        expected_global[shard_dim] *= tp_size
    if list(global_shape) != expected_global:
        raise WeightShardError(
            f"checkpoint tensor has shape {global_shape}, expected {tuple(expected_global)}",
            weight_name=weight_name, global_shape=global_shape, local_shape=tuple(dest.shape),
            tp_size=tp_size, tp_rank=tp_rank)
    if shard_dim is None:
        dest.copy_(full)
        return
    chunk = dest.shape[shard_dim]
    dest.copy_(full.narrow(shard_dim, tp_rank * chunk, chunk))
