"""Ranks that are threads of one process (the ``uni`` executor on CPU).

The members of a group share an :class:`InProcessRendezvous`: a barrier and one slot per rank.
A collective is an exchange: every rank publishes its tensor, waits at the barrier, computes the
result from all slots in rank order (so every rank gets bit-identical results), waits again so
that no slot is overwritten while another rank still reads it, and only then writes its output.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from novainfer.distributed.process_group import CollectiveAbortedError, ProcessGroup, ReduceOpType, average_in_place
from novainfer.distributed.work import FutureWork, Work

R = TypeVar("R")


class InProcessRendezvous:
    """Where the ranks of one in-process group meet."""

    def __init__(self, name: str, world_size: int, timeout_s: float) -> None:
        self.name = name
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size
        self._mailboxes: dict[tuple[int, int], queue.Queue] = {}
        self._mailbox_lock = threading.Lock()

    def exchange(self, rank: int, value: Any, combine: Callable[[list[Any]], R]) -> R:
        """Publishes ``value`` and returns ``combine(values of every rank, in rank order)``.

        ``combine`` runs while every rank's value is readable; it must not modify them.
        """
        self._slots[rank] = value
        self._wait()
        try:
            result = combine(self._slots)
        except BaseException:
            self.abort()  # the others would otherwise wait for this rank until the timeout
            raise
        self._wait()
        return result

    def mailbox(self, src: int, dst: int) -> queue.Queue:
        """The queue of point-to-point messages from ``src`` to ``dst``."""
        with self._mailbox_lock:
            return self._mailboxes.setdefault((src, dst), queue.Queue())

    def abort(self) -> None:
        self._barrier.abort()

    @property
    def aborted(self) -> bool:
        return self._barrier.broken

    def _wait(self) -> None:
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            raise CollectiveAbortedError(
                f"in-process group {self.name!r} was aborted or a rank did not arrive within "
                f"{self.timeout_s} s") from None


def _reduce(values: list[torch.Tensor], op: ReduceOpType) -> torch.Tensor:
    """Reduces in rank order, element-wise, so that every rank computes the same bits."""
    out = values[0].clone()
    for value in values[1:]:
        if op in (ReduceOpType.kSum, ReduceOpType.kAvg):
            out.add_(value)
        elif op is ReduceOpType.kProd:
            out.mul_(value)
        elif op is ReduceOpType.kMin:
            torch.minimum(out, value, out=out)
        elif op is ReduceOpType.kMax:
            torch.maximum(out, value, out=out)
        else:
            raise ValueError(f"unknown reduce op {op!r}")
    if op is ReduceOpType.kAvg:
        average_in_place(out, len(values))
    return out


class ThreadProcessGroup(ProcessGroup):
    """One member (rank) of a group whose ranks are threads of this process."""

    def __init__(self, name: str, rank: int, world_size: int, rendezvous: InProcessRendezvous,
                 device: torch.device | None = None) -> None:
        super().__init__(name, rank, world_size, device=device)
        if rendezvous.world_size != world_size:
            raise ValueError(f"group {name!r}: rendezvous has {rendezvous.world_size} ranks, "
                             f"world_size is {world_size}")
        self.rendezvous = rendezvous
        # Asynchronous collectives run in issue order on one helper thread per member.
        self._async_runner: ThreadPoolExecutor | None = None
        self._last_async: Work | None = None

    # ---- issuing ------------------------------------------------------------------------------
    def _issue(self, op: str, fn: Callable[[], None], async_op: bool) -> Work | None:
        if async_op:
            if self._async_runner is None:
                self._async_runner = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-rank{self.rank}-async")
            self._last_async = FutureWork(self._async_runner.submit(self._run_collective, op, fn))
            return self._last_async
        if self._last_async is not None:
            # Collectives must reach the rendezvous in the order they were issued.
            last, self._last_async = self._last_async, None
            try:
                last.wait()
            except Exception:  # already logged; its Work reports it
                pass
        self._run_collective(op, fn)
        return None

    def _exchange_then_write(self, value: Any, combine: Callable[[list[Any]], Any],
                             write: Callable[[Any], None]) -> Callable[[], None]:
        def run() -> None:
            # Written after the second barrier: ``value`` may alias the output.
            write(self.rendezvous.exchange(self.rank, value, combine))
        return run

    # ---- collectives --------------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOpType, async_op: bool) -> Work | None:
        return self._issue("all_reduce", self._exchange_then_write(
            tensor, lambda values: _reduce(values, op), tensor.copy_), async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Work | None:
        if output.numel() != tensor.numel() * self.world_size:
            raise ValueError(f"all_gather output has {output.numel()} elements, expected "
                             f"world_size={self.world_size} x {tensor.numel()}")
        return self._issue("all_gather", self._exchange_then_write(
            tensor, lambda values: torch.cat([v.reshape(-1) for v in values]),
            lambda result: output.copy_(result.view_as(output))), async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       op: ReduceOpType = ReduceOpType.kSum, async_op: bool = False) -> Work | None:
        if tensor.shape[0] != output.shape[0] * self.world_size:
            raise ValueError(f"reduce_scatter input has {tensor.shape[0]} rows, expected "
                             f"world_size={self.world_size} x {output.shape[0]}")
        rows = output.shape[0]
        return self._issue("reduce_scatter", self._exchange_then_write(
            tensor, lambda values: _reduce([v[self.rank * rows:(self.rank + 1) * rows] for v in values], op),
            output.copy_), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src must be in [0, {self.world_size}), got {src}")
        if self.rank == src:
            return self._issue("broadcast", self._exchange_then_write(tensor, lambda values: None,
                                                                      lambda _: None), async_op)
        return self._issue("broadcast", self._exchange_then_write(
            None, lambda values: values[src].clone(), tensor.copy_), async_op)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._run_collective("send", lambda: self.rendezvous.mailbox(self.rank, dst).put(tensor.clone()))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        def run() -> None:
            try:
                message = self.rendezvous.mailbox(src, self.rank).get(timeout=self.rendezvous.timeout_s)
            except queue.Empty:
                raise CollectiveAbortedError(f"group {self.name!r}: nothing from rank {src} within "
                                             f"{self.rendezvous.timeout_s} s") from None
            tensor.copy_(message)
        self._run_collective("recv", run)

    # ---- lifecycle ----------------------------------------------------------------------------
    def abort(self) -> None:
        self.rendezvous.abort()

    def shutdown(self) -> None:
        if self._async_runner is not None:
            self._async_runner.shutdown(wait=False, cancel_futures=True)
            self._async_runner = None
