"""One rank per process through ``torch.distributed`` (the ``mp`` executor): NCCL on CUDA, Gloo on CPU.

The process's default ``torch.distributed`` group is this group: with pipeline parallelism fixed
at 1, the tensor-parallel group spans the whole world.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from novainfer.distributed.process_group import ProcessGroup, ReduceOpType, average_in_place
from novainfer.distributed.work import Work

_TORCH_OPS = {
    ReduceOpType.kSum: dist.ReduceOp.SUM,
    ReduceOpType.kProd: dist.ReduceOp.PRODUCT,
    ReduceOpType.kMin: dist.ReduceOp.MIN,
    ReduceOpType.kMax: dist.ReduceOp.MAX,
}

# ``tcpstore://host:port``: a rendezvous store that the launching process already serves (it bound
# the port itself, so no other run can take it between choosing and binding); ranks join as clients.
HOSTED_STORE_SCHEME = "tcpstore://"

# Newer releases renamed the single-tensor gather/scatter; the old names warn there.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def host_store(host: str, world_size: int, timeout_s: float) -> tuple[dist.TCPStore, str]:
    """A rendezvous store served by this process on a port the OS assigns, and its ``tcpstore://`` address."""
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{HOSTED_STORE_SCHEME}{host}:{store.port}"


def join_hosted_store(address: str, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    host, _, port = address[len(HOSTED_STORE_SCHEME):].rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), world_size, is_master=False, timeout=timeout)


class TorchWork(Work):
    """A ``torch.distributed`` work handle; ``finish`` runs once after it completed (e.g. averaging)."""

    def __init__(self, work: dist.Work, device: torch.device, on_error: Callable[[BaseException], None],
                 finish: Callable[[], None] | None = None) -> None:
        self._work = work
        self._device = device
        self._on_error = on_error
        self._finish = finish
        self._error: BaseException | None = None
        # Some Gloo works never report completion themselves; a successful wait is proof enough.
        self._waited = False

    def _completed(self, wait: Callable[[], object]) -> bool:
        if self._error is not None:
            raise self._error
        try:
            wait()
        except Exception as exc:
            self._error = exc
            self._on_error(exc)
            raise
        self._waited = True
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return self._completed(self._work.wait)
        return self._completed(lambda: self._work.wait(datetime.timedelta(seconds=timeout)))

    def is_completed(self) -> bool:
        return self._waited or self._error is not None or self._work.is_completed()

    def is_success(self) -> bool:
        return self._error is None and (self._waited or self._work.is_completed())

    def synchronize(self) -> None:
        self._completed(self._work.wait)
        if self._device.type == "cuda":  # NCCL's wait only makes the current stream wait
            torch.cuda.current_stream(self._device).synchronize()

    def exception(self) -> BaseException | None:
        return self._error


class TorchDistributedProcessGroup(ProcessGroup):
    """``backend`` is "nccl" (CUDA tensors) or "gloo" (CPU tensors)."""

    def __init__(self, name: str, rank: int, world_size: int, device: torch.device, backend: str,
                 init_method: str, timeout_s: float) -> None:
        super().__init__(name, rank, world_size, device=device)
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        if dist.is_initialized():
            raise RuntimeError(f"cannot create group {name!r}: this process already has a torch.distributed group")
        self.backend = backend
        # device_id binds the rank to its GPU and creates the NCCL communicator now, not lazily
        # inside the first collective (which may be a CUDA graph capture).
        timeout = datetime.timedelta(seconds=timeout_s)
        rendezvous = ({"store": join_hosted_store(init_method, world_size, timeout)}
                      if init_method.startswith(HOSTED_STORE_SCHEME) else {"init_method": init_method})
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None, **rendezvous)
        # The first collective sets up the connections: fail here, at start-up, if they cannot be.
        self.all_reduce(torch.zeros(1, device=device))

    def _issue(self, op: str, call: Callable[[bool], dist.Work | None], async_op: bool,
               finish: Callable[[], None] | None = None) -> Work | None:
        work = self._run_collective(op, lambda: call(async_op))
        if not async_op:
            if finish is not None:
                finish()
            return None
        return TorchWork(work, self.device, lambda exc: self.log_failure(op, exc), finish)

    def _torch_op(self, op: ReduceOpType, tensor: torch.Tensor) -> tuple[dist.ReduceOp, Callable[[], None] | None]:
        """The torch op, and what to do after it: averaging is a sum divided by the world size
        (Gloo has no AVG on every release)."""
        if op is ReduceOpType.kAvg:
            if self.backend == "nccl":
                return dist.ReduceOp.AVG, None
            return dist.ReduceOp.SUM, lambda: average_in_place(tensor, self.world_size)
        return _TORCH_OPS[op], None

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOpType, async_op: bool) -> Work | None:
        torch_op, finish = self._torch_op(op, tensor)
        return self._issue("all_reduce", lambda a: dist.all_reduce(tensor, op=torch_op, async_op=a), async_op,
                           finish)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Work | None:
        return self._issue("all_gather", lambda a: _all_gather_single(output, tensor, async_op=a), async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       op: ReduceOpType = ReduceOpType.kSum, async_op: bool = False) -> Work | None:
        torch_op, finish = self._torch_op(op, output)
        return self._issue("reduce_scatter",
                           lambda a: _reduce_scatter_single(output, tensor, op=torch_op, async_op=a), async_op,
                           finish)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
        return self._issue("broadcast", lambda a: dist.broadcast(tensor, src=self.ranks[src], async_op=a),
                           async_op)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._run_collective("send", lambda: dist.send(tensor, dst=self.ranks[dst]))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._run_collective("recv", lambda: dist.recv(tensor, src=self.ranks[src]))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
