"""One worker in the driver's own process."""

from __future__ import annotations

from typing import Any

from novainfer.executor.abstract import Executor, WorkerError
from novainfer.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, local_rank=0, rank=0, is_driver_worker=True)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        worker = self.driver_worker
        try:
            return [getattr(worker, method)(*args, **(kwargs or {}))]
        except Exception as exc:
            raise WorkerError(method, worker.rank, worker.local_rank, exc) from exc

    def shutdown(self) -> None:
        self.driver_worker = None
