"""Collective-communication vocabulary shared by every tensor-parallel backend.

Names follow InfiniTrain (seed 000, sections 2.2 and 3.2) in Python form: ``ReduceOpType`` with
``kSum``..``kAvg``, a ``ProcessGroup`` whose collectives optionally return a ``Work`` handle.
Implementations: :mod:`.in_process` (ranks as threads of one process, CPU),
:mod:`.cupy_nccl` (ranks as threads driving several GPUs of one process) and
:mod:`.torch_distributed` (one rank per process, NCCL or Gloo).
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from novainfer.distributed.work import CompletedWork, CudaEventWork, Work

if TYPE_CHECKING:
    from novainfer.distributed.custom_all_reduce import CustomAllReduce

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ReduceOpType(enum.Enum):
    kSum = "sum"
    kProd = "prod"
    kMin = "min"
    kMax = "max"
    kAvg = "avg"


def average_in_place(total: torch.Tensor, world_size: int) -> None:
    """Turns a sum over ``world_size`` ranks into their average (integer division truncates)."""
    if total.is_floating_point():
        total.div_(world_size)
    else:
        total.div_(world_size, rounding_mode="trunc")


class CollectiveAbortedError(RuntimeError):
    """A collective gave up because its group was aborted (another rank failed) or timed out."""


class ProcessGroup(ABC):
    """A set of ranks that run collectives together.

    ``rank`` is this member's rank inside the group and ``world_size`` the group's size.
    Every collective works in place on ``tensor`` (or fills ``output``) and returns a ``Work``
    when ``async_op`` is true, ``None`` otherwise. On CUDA no collective synchronises the host,
    so that CUDA graphs can capture them.
    """

    def __init__(self, name: str, rank: int, world_size: int, ranks: list[int] | None = None,
                 device: torch.device | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.ranks = list(ranks) if ranks is not None else list(range(world_size))
        self.device = device if device is not None else torch.device("cpu")

    # The custom (one-shot or two-shot) all-reduce of small sums (GPU groups; see enable_custom_all_reduce).
    custom_all_reduce: CustomAllReduce | None = None

    def enable_custom_all_reduce(self, max_bytes: int | None = None) -> bool:
        """Sets up the custom all-reduce when every GPU of the group can read the others' memory.

        Every rank calls it at once (it exchanges buffers); returns whether it is on. Off on CPU,
        for one rank, without CuPy, or without peer access between some pair of GPUs.
        """
        if self.device.type != "cuda" or self.world_size == 1:
            return False
        from novainfer.distributed.custom_all_reduce import DEFAULT_MAX_BYTES, MAX_WORLD_SIZE, CustomAllReduce

        devices = [int.from_bytes(b, "little") for b in self.all_gather_bytes(self.device.index.to_bytes(8, "little"))]
        if not CustomAllReduce.is_possible(devices):
            logger.info("group %s: no custom all-reduce (GPUs %s cannot all access each other, are more than its "
                        "%d ranks, or no CuPy); all-reduces use the group's backend", self.name, devices,
                        MAX_WORLD_SIZE)
            return False
        self.custom_all_reduce = CustomAllReduce(self.rank, self.world_size, self.device, self.all_gather_bytes,
                                                 max_bytes or DEFAULT_MAX_BYTES)
        return True

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (of the same length on every rank), in rank order."""
        local = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        gathered = torch.empty(self.world_size * len(data), dtype=torch.uint8, device=self.device)
        self.all_gather(gathered, local)
        flat = gathered.cpu().numpy().tobytes()
        return [flat[i * len(data):(i + 1) * len(data)] for i in range(self.world_size)]

    def close_custom_all_reduce(self) -> None:
        """Releases the custom all-reduce's buffers (before the group itself goes)."""
        if self.custom_all_reduce is not None:
            self.custom_all_reduce.close()
            self.custom_all_reduce = None

    def get_group_rank(self, global_rank: int) -> int:
        """Rank inside this group of the process whose global rank is ``global_rank``."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"global rank {global_rank} is not a member of group {self.name!r} "
                             f"(members: {self.ranks})") from None

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpType = ReduceOpType.kSum,
                   async_op: bool = False) -> Work | None:
        """Reduces ``tensor`` over the ranks in place. Small sums between GPUs that read each other's
        memory take a custom kernel once :meth:`enable_custom_all_reduce` succeeded."""
        fast = self.custom_all_reduce
        if fast is not None and op is ReduceOpType.kSum and fast.supports(tensor):
            self._run_collective("all_reduce", lambda: fast.all_reduce(tensor))
            return CudaEventWork.on_current_stream(self.device) if async_op else None
        return self._all_reduce(tensor, op, async_op)

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOpType, async_op: bool) -> Work | None:
        """The backend's own all-reduce."""

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

    def abort(self) -> None:
        """Makes collectives that wait for other ranks fail now instead of waiting (a rank failed)."""

    def shutdown(self) -> None:
        """Releases the group's communication resources."""

    def _run_collective(self, op: str, fn: Callable[[], T]) -> T:
        """Runs one collective; a failure is logged with op, group, rank and device, then re-raised."""
        try:
            return fn()
        except Exception as exc:
            self.log_failure(op, exc)
            raise

    def log_failure(self, op: str, exc: BaseException) -> None:
        logger.error("collective %s failed: group=%s rank=%d world_size=%d device=%s: %s: %s",
                     op, self.name, self.rank, self.world_size, self.device, type(exc).__name__, exc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, world_size={self.world_size})"


class SingleRankProcessGroup(ProcessGroup):
    """The group of one rank: every collective is the identity. Used whenever tp_size == 1."""

    def __init__(self, name: str = "single") -> None:
        super().__init__(name, rank=0, world_size=1)

    def _done(self, async_op: bool) -> Work | None:
        return CompletedWork() if async_op else None

    def _all_reduce(self, tensor, op, async_op):
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
