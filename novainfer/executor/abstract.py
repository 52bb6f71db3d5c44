"""Executors: the control plane that starts workers and drives them step by step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from novainfer.config import EngineConfig
from novainfer.core.sched.output import SchedulerOutput
from novainfer.worker.model_runner import ModelRunnerOutput


class WorkerError(RuntimeError):
    """A worker failed; says which one."""

    def __init__(self, method: str, rank: int, local_rank: int, cause: BaseException) -> None:
        self.rank = rank
        self.local_rank = local_rank
        super().__init__(f"worker rank={rank} local_rank={local_rank} failed in {method}: "
                         f"{type(cause).__name__}: {cause}")


class Executor(ABC):
    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from novainfer.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend in ("mp", "ray"):
            raise NotImplementedError(f"distributed_executor_backend={backend!r} is not implemented yet")
        raise ValueError(f"unknown distributed_executor_backend {backend!r}; expected 'uni', 'mp' or 'ray'")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Calls ``method`` on every worker; returns their results in rank order."""

    def determine_num_available_blocks(self) -> int:
        # Every rank must hold the same block table, so the smallest cache wins.
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        """Releases the workers; a no-op for executors that hold nothing outside this process."""
