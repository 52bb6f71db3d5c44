"""Collective-communication vocabulary shared by every tensor-parallel backend.

Names follow InfiniTrain (seed 000, sections 2.2 and 3.2) in Python form: ``ReduceOpType`` with
``kSum``..``kAvg``, a ``ProcessGroup`` whose collectives optionally return a ``Work`` handle.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch


class ReduceOpType(enum.Enum):
    kSum = "sum"
    kProd = "prod"
    kMin = "min"
    kMax = "max"
    kAvg = "avg"


class Work(ABC):
    """Handle of an asynchronous collective."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool: ...

    @abstractmethod
    def is_completed(self) -> bool: ...

    @abstractmethod
    def is_success(self) -> bool: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def exception(self) -> BaseException | None: ...


class CompletedWork(Work):
    """A ``Work`` for a collective that already finished when it was issued."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def wait(self, timeout: float | None = None) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None

    def synchronize(self) -> None:
        self.wait()

    def exception(self) -> BaseException | None:
        return self._error


class ProcessGroup(ABC):
    """A set of ranks that run collectives together.

    ``rank`` is this member's rank inside the group and ``world_size`` the group's size.
    Every collective works in place on ``tensor`` (or fills ``output``) and returns a ``Work``
    when ``async_op`` is true, ``None`` otherwise.
    """

    def __init__(self, name: str, rank: int, world_size: int, ranks: list[int] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.ranks = list(ranks) if ranks is not None else list(range(world_size))

    def get_group_rank(self, global_rank: int) -> int:
        """Rank inside this group of the process whose global rank is ``global_rank``."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"global rank {global_rank} is not a member of group {self.name!r} "
                             f"(members: {self.ranks})") from None

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpType = ReduceOpType.kSum,
                   async_op: bool = False) -> Work | None: ...

    @abstractmethod
    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Work | None:
        """Concatenates every rank's ``tensor`` along dim 0 into ``output``."""

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       op: ReduceOpType = ReduceOpType.kSum, async_op: bool = False) -> Work | None:
        """Reduces ``tensor`` across ranks and keeps this rank's dim-0 chunk in ``output``."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None: ...

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None: ...

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, world_size={self.world_size})"


class SingleRankProcessGroup(ProcessGroup):
    """The group of one rank: every collective is the identity. Used whenever tp_size == 1."""

    def __init__(self, name: str = "single") -> None:
        super().__init__(name, rank=0, world_size=1)

    def _done(self, async_op: bool) -> Work | None:
        return CompletedWork() if async_op else None

    def all_reduce(self, tensor, op=ReduceOpType.kSum, async_op=False):
        return self._done(async_op)

    def all_gather(self, output, tensor, async_op=False):
        output.copy_(tensor)
        return self._done(async_op)

    def reduce_scatter(self, output, tensor, op=ReduceOpType.kSum, async_op=False):
        output.copy_(tensor)
        return self._done(async_op)

    def broadcast(self, tensor, src=0, async_op=False):
        return self._done(async_op)

    def send(self, tensor, dst):
        raise RuntimeError(f"send to rank {dst} in a single-rank group {self.name!r}")

    def recv(self, tensor, src):
        raise RuntimeError(f"recv from rank {src} in a single-rank group {self.name!r}")
