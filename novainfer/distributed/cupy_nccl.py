"""Several GPUs of one process through NCCL (the ``uni`` executor on CUDA).

The communicators of all ranks are created together by rank 0 (``ncclCommInitAll``, through
CuPy's binding); then every rank's thread drives its own communicator. Each collective is
enqueued on the caller's current CUDA stream, so it never blocks the host and a CUDA graph
being captured on that stream records it. CuPy is imported only when such a group is created.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from novainfer.distributed.in_process import InProcessRendezvous
from novainfer.distributed.process_group import ProcessGroup, ReduceOpType
from novainfer.distributed.work import CudaEventWork, Work

# ncclDataType_t and ncclRedOp_t values (nccl.h); stable across NCCL 2.x.
_NCCL_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
_NCCL_OPS = {ReduceOpType.kSum: 0, ReduceOpType.kProd: 1, ReduceOpType.kMax: 2, ReduceOpType.kMin: 3,
             ReduceOpType.kAvg: 4}


def _import_cupy():
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise RuntimeError("distributed_executor_backend='uni' with tensor_parallel_size > 1 on CUDA needs CuPy "
                           "with NCCL (pip install cupy-cuda12x); or use distributed_executor_backend='mp'") from exc
    return cupy, nccl


def _init_communicators(devices: list[int]) -> list:
    """One communicator per device, each an object of its own.

    ``NcclCommunicator.initAll`` would give one object that switches between devices through a
    shared "current communicator", which threads driving different ranks cannot share. Instead
    one thread creates every rank's communicator inside an NCCL group, the pattern NCCL documents
    for initialising several devices from one thread (each ncclCommInitRank would otherwise wait
    for the others).
    """
    cupy, nccl = _import_cupy()
    unique_id = nccl.get_unique_id()
    comms = []
    nccl.groupStart()
    try:
        for rank, device in enumerate(devices):
            with cupy.cuda.Device(device):
                comms.append(nccl.NcclCommunicator(len(devices), unique_id, rank))
    finally:
        nccl.groupEnd()
    return comms


class CupyNcclProcessGroup(ProcessGroup):
    """One rank (GPU) of an in-process NCCL group; ``rendezvous`` is shared by the ranks' threads."""

    def __init__(self, name: str, rank: int, world_size: int, device: torch.device,
                 rendezvous: InProcessRendezvous) -> None:
        super().__init__(name, rank, world_size, device=device)
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"group {name!r}: an NCCL rank needs a CUDA device with an index, got {device}")
        _import_cupy()  # fail early, on every rank, when CuPy is missing
        devices = rendezvous.exchange(rank, device.index, list)
        if len(set(devices)) != len(devices):
            raise ValueError(f"group {name!r}: every rank needs its own GPU, got devices {devices}")
        comms = None
        if rank == 0:
            try:
                comms = _init_communicators(devices)
            except BaseException:
                rendezvous.abort()  # the other ranks wait for these communicators
                raise
        self._comm = rendezvous.exchange(rank, comms, lambda slots: slots[0][rank])

    # ---- plumbing -----------------------------------------------------------------------------
    def _check(self, tensor: torch.Tensor) -> int:
        """The NCCL data type of ``tensor``, after checking that NCCL can use it in place."""
        if tensor.device != self.device:
            raise ValueError(f"group {self.name!r} rank {self.rank}: tensor is on {tensor.device}, "
                             f"expected {self.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"group {self.name!r}: NCCL needs contiguous tensors, got shape "
                             f"{tuple(tensor.shape)} with strides {tensor.stride()}")
        if tensor.dtype not in _NCCL_DTYPES:
            raise ValueError(f"group {self.name!r}: dtype {tensor.dtype} is not supported by NCCL; "
                             f"supported: {sorted(str(d) for d in _NCCL_DTYPES)}")
        return _NCCL_DTYPES[tensor.dtype]

    def _issue(self, op: str, call: Callable[[int], None], async_op: bool) -> Work | None:
        stream = torch.cuda.current_stream(self.device)
        self._run_collective(op, lambda: call(stream.cuda_stream))
        return CudaEventWork.on_current_stream(self.device) if async_op else None

    # ---- collectives --------------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOpType, async_op: bool) -> Work | None:
        dtype = self._check(tensor)
        ptr = tensor.data_ptr()
        return self._issue("all_reduce", lambda stream: self._comm.allReduce(
            ptr, ptr, tensor.numel(), dtype, _NCCL_OPS[op], stream), async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Work | None:
        dtype = self._check(tensor)
        if self._check(output) != dtype or output.numel() != tensor.numel() * self.world_size:
            raise ValueError(f"all_gather output must be {self.world_size} x {tensor.numel()} elements of "
                             f"{tensor.dtype}, got {output.numel()} of {output.dtype}")
        return self._issue("all_gather", lambda stream: self._comm.allGather(
            tensor.data_ptr(), output.data_ptr(), tensor.numel(), dtype, stream), async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       op: ReduceOpType = ReduceOpType.kSum, async_op: bool = False) -> Work | None:
        dtype = self._check(tensor)
        if self._check(output) != dtype or tensor.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter input must be {self.world_size} x {output.numel()} elements of "
                             f"{output.dtype}, got {tensor.numel()} of {tensor.dtype}")
        return self._issue("reduce_scatter", lambda stream: self._comm.reduceScatter(
            tensor.data_ptr(), output.data_ptr(), output.numel(), dtype, _NCCL_OPS[op], stream), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
        dtype = self._check(tensor)
        ptr = tensor.data_ptr()
        return self._issue("broadcast", lambda stream: self._comm.broadcast(
            ptr, ptr, tensor.numel(), dtype, src, stream), async_op)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dtype = self._check(tensor)
        self._issue("send", lambda stream: self._comm.send(tensor.data_ptr(), tensor.numel(), dtype, dst, stream),
                    False)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        dtype = self._check(tensor)
        self._issue("recv", lambda stream: self._comm.recv(tensor.data_ptr(), tensor.numel(), dtype, src, stream),
                    False)

    # ---- lifecycle ----------------------------------------------------------------------------
    def abort(self) -> None:
        # Unblocks kernels waiting for a rank that failed; the communicator is unusable afterwards.
        if self._comm is not None:
            self._comm.abort()
            self._comm = None

    def shutdown(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
