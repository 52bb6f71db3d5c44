"""Handles of asynchronous collectives (InfiniTrain's ``Work``, seed 000 section 2.2).

A collective issued with ``async_op=True`` returns a ``Work``. ``wait`` makes its result usable by
whatever the caller does next: on CPU the calling thread blocks until it is done; on CUDA the
caller's current stream waits for it, so the host does not (and a CUDA graph can capture it).
``synchronize`` always blocks the host until the collective has finished.
"""

from __future__ import annotations

import concurrent.futures
import time
from abc import ABC, abstractmethod

import torch


class Work(ABC):
    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """True once the result is usable; raises the collective's error if it failed, and
        ``TimeoutError`` if it has not finished within ``timeout`` seconds."""

    @abstractmethod
    def is_completed(self) -> bool: ...

    @abstractmethod
    def is_success(self) -> bool:
        """Completed without an error."""

    @abstractmethod
    def synchronize(self) -> None:
        """Blocks the calling thread until the collective has finished (raises its error)."""

    @abstractmethod
    def exception(self) -> BaseException | None:
        """The collective's error once it failed, else None."""


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


class FutureWork(Work):
    """A collective running on a helper thread (CPU groups)."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            # A distinct class before Python 3.11: callers catch the builtin one.
            raise TimeoutError(f"collective did not finish within {timeout} s") from None
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def synchronize(self) -> None:
        self.wait()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


class CudaEventWork(Work):
    """A collective enqueued on a CUDA stream; ``event`` was recorded right after it."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

    @classmethod
    def on_current_stream(cls, device: torch.device) -> CudaEventWork:
        """The work of what was just enqueued on ``device``'s current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return cls(event, device)

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            return True
        # A bounded wait can only be measured on the host.
        end = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() >= end:
                raise TimeoutError(f"collective did not finish within {timeout} s")
            time.sleep(1e-4)
        return True

    def is_completed(self) -> bool:
        return self._event.query()

    def is_success(self) -> bool:
        # Errors of enqueued NCCL work surface at the next CUDA call, not through the event.
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def exception(self) -> BaseException | None:
        return None
