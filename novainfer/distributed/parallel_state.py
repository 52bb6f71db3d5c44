"""Which tensor-parallel group the model being built belongs to, and how that group is made.

Layers read the current group once, when they are constructed, and keep it. The group is
thread-local so that one process can build several ranks' models on several threads (the
single-process ``uni`` executor) without them seeing each other's group.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from novainfer.distributed.factory import ProcessGroupFactory
from novainfer.distributed.process_group import ProcessGroup, SingleRankProcessGroup

if TYPE_CHECKING:
    from novainfer.config import ParallelConfig

_state = threading.local()
_SINGLE = SingleRankProcessGroup("tp-single")


def get_tp_group() -> ProcessGroup:
    """The tensor-parallel group of the model being built on this thread (a single rank by default)."""
    return getattr(_state, "tp_group", _SINGLE)


def single_rank_group() -> ProcessGroup:
    """A group of one rank, for layers that are replicated rather than sharded."""
    return _SINGLE


def get_vocab_parallel_group(enabled: bool | None = None) -> ProcessGroup:
    """The group the embedding and LM head are split over (seed 000 section 7.1.9).

    The tensor-parallel group when vocabulary parallelism is on, else a single rank (replicated).
    ``enabled=None`` takes the setting of the enclosing :func:`tp_group_context`.
    """
    if enabled is None:
        enabled = getattr(_state, "vocab_parallel", False)
    return get_tp_group() if enabled else _SINGLE


@contextlib.contextmanager
def tp_group_context(group: ProcessGroup, *, vocab_parallel: bool = False) -> Iterator[ProcessGroup]:
    """Builds layers under ``group``: inside the block, ``get_tp_group()`` returns it.

    ``vocab_parallel``: whether models built in the block split their vocabulary over ``group``.
    """
    previous = (getattr(_state, "tp_group", None), getattr(_state, "vocab_parallel", False))
    _state.tp_group, _state.vocab_parallel = group, vocab_parallel
    try:
        yield group
    finally:
        if previous[0] is None:
            del _state.tp_group
        else:
            _state.tp_group = previous[0]
        _state.vocab_parallel = previous[1]


def tp_group_backend(parallel_config: ParallelConfig, device: torch.device) -> str:
    """The process-group backend a rank on ``device`` uses under this configuration."""
    if parallel_config.distributed_executor_backend == "uni":
        return "cupy-nccl" if device.type == "cuda" else "threads"
    return parallel_config.distributed_backend


def init_tensor_parallel_group(parallel_config: ParallelConfig, rank: int, device: torch.device,
                               init_method: str) -> ProcessGroup:
    """This rank's tensor-parallel group (a single rank when tensor_parallel_size is 1)."""
    if parallel_config.tensor_parallel_size == 1:
        return _SINGLE
    group = ProcessGroupFactory.instance().get_or_create(
        parallel_config.tp_group_name, backend=tp_group_backend(parallel_config, device), rank=rank,
        world_size=parallel_config.tensor_parallel_size, device=device, init_method=init_method)
    if not parallel_config.disable_custom_all_reduce:
        group.enable_custom_all_reduce()
    return group
