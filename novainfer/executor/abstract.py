"""Executors: the control plane that starts one worker per rank and drives them step by step.

``uni`` keeps every rank in the driver process (one thread per rank); ``mp`` gives every rank a
process of its own. Both run the same Worker, so the tensor-parallel algorithm exists only in the
model layers. Every step reaches every rank; rank 0's result is returned.

A failure of one rank breaks its tensor-parallel group for good: the executor then stops all
ranks and every later call raises the same error (the engine fails its requests with it).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from novainfer.config import EngineConfig
from novainfer.core.sched.output import SchedulerOutput
from novainfer.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)


def method_name(method: str | Callable[..., Any]) -> str:
    """How a collective_rpc target is named in errors and logs."""
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))


class WorkerError(RuntimeError):
    """A worker failed (raised, or its process died); says which one."""

    def __init__(self, method: str | Callable[..., Any], rank: int, local_rank: int,
                 cause: BaseException) -> None:
        self.method = method_name(method)
        self.rank = rank
        self.local_rank = local_rank
        super().__init__(f"worker rank={rank} local_rank={local_rank} failed in {self.method}: "
                         f"{type(cause).__name__}: {cause}")


class ExecutorTimeoutError(TimeoutError):
    """Workers did not answer in time (a hung rank), as opposed to a worker that failed."""

    def __init__(self, method: str | Callable[..., Any], ranks: list[int], timeout_s: float) -> None:
        self.method = method_name(method)
        self.ranks = ranks
        super().__init__(f"worker rank(s) {ranks} did not finish {self.method} within {timeout_s:g} s")


class Executor(ABC):
    # A step slower than this means a hung rank (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).
    execute_model_timeout_s: float = 300.0
    # Other calls include loading weights and profiling, which can be slow, but not endless.
    rpc_timeout_s: float = 3600.0

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from novainfer.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from novainfer.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            raise NotImplementedError("distributed_executor_backend='ray' is not implemented; use 'uni' or 'mp'")
        raise ValueError(f"distributed_executor_backend must be one of ['uni', 'mp', 'ray'], got {backend!r}")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()
        parallel = config.parallel_config
        logger.info("executor ready: backend=%s tp_size=%d world_size=%d", parallel.distributed_executor_backend,
                    parallel.tensor_parallel_size, parallel.world_size)

    @abstractmethod
    def _init_executor(self) -> None:
        """Starts the workers; on failure releases whatever was started, then raises."""

    @abstractmethod
    def _distributed_args(self, rank: int) -> tuple[str, int, int]:
        """``(distributed_init_method, rank, local_rank)`` of the worker of ``rank``."""

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None, *, unique_reply_rank: int | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        """Calls ``method`` on every worker: a Worker method's name, or a function that gets the
        worker as first argument (for ``mp`` it must be importable by name). Returns the results
        in rank order, or only the result of ``unique_reply_rank`` (a one-element list).
        ``timeout_s`` defaults to ``rpc_timeout_s``."""

    def _init_workers(self) -> None:
        """The start-up sequence every backend shares: devices and groups, then the model."""
        tp_size = self.config.parallel_config.tensor_parallel_size
        for info in self.collective_rpc("init_device"):
            logger.info("worker pid=%d rank=%d local_rank=%d device=%s tp_size=%d", info.pid, info.rank,
                        info.local_rank, info.device, tp_size)
        self.collective_rpc("load_model")

    def determine_num_available_blocks(self) -> int:
        # Every rank must hold the same block table, so the smallest cache wins.
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput, pipelined: bool = False) -> list[ModelRunnerOutput]:
        """Runs a step on every rank; returns rank 0's outputs of the steps fetched meanwhile,
        oldest first. With ``pipelined`` the step stays in flight: the next call returns it."""
        return self.collective_rpc("execute_model", (scheduler_output,), {"pipelined": pipelined},
                                   unique_reply_rank=0, timeout_s=self.execute_model_timeout_s)[0]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the workers and releases their devices; safe to call more than once."""
