"""``uni``: every rank's worker lives in the driver process.

With one rank the worker runs on the calling thread. With several, each rank has a persistent
thread of its own, so that its thread-local TP group and CUDA device stay bound to it and the
ranks' collectives run concurrently. A call goes to every rank thread and waits for all of them
(lock-step); ranks meet through in-process groups under one ``inproc://`` rendezvous per engine.
In a step only the driver rank stages inputs and samples; the others run what it staged, or the
driver launches a decode step's graphs on every device itself
(:class:`~novainfer.worker.step_broadcast.StepBroadcast`), so the ranks' host work does not add
up under the GIL.
"""

from __future__ import annotations

import concurrent.futures
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from novainfer.core.sched.output import SchedulerOutput
from novainfer.distributed import CollectiveAbortedError, ProcessGroupFactory
from novainfer.executor.abstract import Executor, ExecutorTimeoutError, WorkerError
from novainfer.worker.model_runner import ModelRunnerOutput
from novainfer.worker.step_broadcast import StepBroadcast
from novainfer.worker.worker import Worker

logger = logging.getLogger(__name__)

# Once a failed rank's group is aborted, the other ranks leave their collectives at once.
_ABORT_GRACE_S = 2.0
_SHUTDOWN_TIMEOUT_S = 30.0


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        parallel = self.config.parallel_config
        # Distinct per engine: several engines (and their groups) can share this process.
        self._init_method = f"inproc://{parallel.tp_group_name}-{uuid.uuid4().hex[:12]}"
        self.workers = [Worker(self.config, local_rank=local_rank, rank=rank, distributed_init_method=init_method,
                               is_driver_worker=rank == 0, follows_driver_steps=parallel.world_size > 1)
                        for init_method, rank, local_rank in map(self._distributed_args, range(parallel.world_size))]
        self._rank_threads = [ThreadPoolExecutor(1, thread_name_prefix=f"novainfer-rank{rank}")
                              for rank in range(parallel.world_size)] if parallel.world_size > 1 else []
        self._failure: BaseException | None = None
        try:
            self._init_workers()
        except BaseException:
            self.shutdown()
            raise

    def _distributed_args(self, rank: int) -> tuple[str, int, int]:
        return self._init_method, rank, rank

    @property
    def driver_worker(self) -> Worker:
        """Rank 0's worker, whose results the executor returns."""
        return self.workers[0]

    def execute_model(self, scheduler_output: SchedulerOutput, pipelined: bool = False) -> list[ModelRunnerOutput]:
        if not self._rank_threads:
            return super().execute_model(scheduler_output, pipelined)
        broadcast = StepBroadcast(self.execute_model_timeout_s, [w.model_runner for w in self.workers[1:]])
        return self.collective_rpc("execute_model", (scheduler_output, broadcast, pipelined), unique_reply_rank=0,
                                   timeout_s=self.execute_model_timeout_s)[0]

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None, *, unique_reply_rank: int | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        if self._failure is not None:
            raise self._failure
        kwargs = kwargs or {}
        if self._rank_threads:
            results = self._run_on_rank_threads(method, args, kwargs, timeout_s or self.rpc_timeout_s)
        else:
            worker = self.workers[0]
            try:
                results = [worker.execute_method(method, *args, **kwargs)]
            except Exception as exc:
                raise WorkerError(method, worker.rank, worker.local_rank, exc) from exc
        return results if unique_reply_rank is None else [results[unique_reply_rank]]

    def _run_on_rank_threads(self, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                             timeout_s: float) -> list[Any]:
        futures = [pool.submit(worker.execute_method, method, *args, **kwargs)
                   for pool, worker in zip(self._rank_threads, self.workers)]
        done, pending = concurrent.futures.wait(futures, timeout_s, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = [rank for rank, future in enumerate(futures) if future in done and future.exception() is not None]
        if not failed and not pending:
            return [future.result() for future in futures]
        # The other ranks may be waiting for the failed (or hung) one inside a collective: abort
        # the group so that they fail too instead of waiting for its timeout.
        ProcessGroupFactory.instance().abort(self._init_method)
        concurrent.futures.wait(pending, _ABORT_GRACE_S)
        if failed:
            # Ranks that the abort released fail with CollectiveAbortedError: they are not the cause.
            causes = [rank for rank, future in enumerate(futures) if future.done() and future.exception()
                      is not None and not isinstance(future.exception(), CollectiveAbortedError)]
            worker = self.workers[causes[0] if causes else failed[0]]
            cause = futures[worker.rank].exception()
            error: BaseException = WorkerError(method, worker.rank, worker.local_rank, cause)
            error.__cause__ = cause
        else:
            # Ranks that were only waiting for the hung one have left after the abort.
            hung = [w.rank for w, f in zip(self.workers, futures) if not f.done()] or \
                [w.rank for w, f in zip(self.workers, futures) if f in pending]
            error = ExecutorTimeoutError(method, hung, timeout_s)
        logger.error("uni executor: %s; stopping every rank", error)
        self._failure = error
        raise error

    def shutdown(self) -> None:
        if self._rank_threads and self._failure is None:
            try:  # every rank leaves its group at the same time, on its own thread
                self._run_on_rank_threads("shutdown", (), {}, _SHUTDOWN_TIMEOUT_S)
            except Exception:
                logger.exception("uni executor: a worker failed to shut down")
        for worker in self.workers:  # whatever is left (after a failure: from this thread)
            worker.shutdown()
        for pool in self._rank_threads:
            pool.shutdown(wait=False, cancel_futures=True)
        self._rank_threads = []
        self.workers = []
        if self._failure is None:
            self._failure = RuntimeError("the executor was shut down")
