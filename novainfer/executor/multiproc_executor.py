"""``mp``: one worker process per rank (multiprocessing with the spawn start method).

Every rank, rank 0 included, has a process of its own and the driver only schedules. A rank
spends its step inside collectives, so a driver that were rank 0 could not notice that another
rank died before a collective timed out; a driver that only waits on pipes and process sentinels
notices at once, fails the in-flight requests and stops the other ranks. The price is one pipe
hop for rank 0's result, which is a handful of token ids.

A call is pickled once and the same bytes are written to every rank's pipe (a step's
``SchedulerOutput`` carries only what changed for requests the workers already hold). Only the
ranks whose result is wanted reply (rank 0 for a step); the others write only when they fail.
While it waits, the driver watches every pipe and every process sentinel, with a timeout.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch

from novainfer.config import EngineConfig
from novainfer.distributed.torch_distributed import host_store
from novainfer.executor.abstract import Executor, ExecutorTimeoutError, WorkerError, method_name
from novainfer.worker.worker import Worker

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 10.0  # for workers to leave their groups and exit when asked
_KILL_TIMEOUT_S = 5.0  # for a killed worker to be gone
_STOP = pickle.dumps(None)


@dataclass
class WorkerProcess:
    """The driver's handle of one rank's process."""

    rank: int
    local_rank: int
    process: BaseProcess
    conn: Connection


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process; shown as that exception's cause."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\nin the worker process:\n{self.text}"


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        parallel = self.config.parallel_config
        # With no rendezvous given, this process serves the ranks' store on a port the OS assigns
        # and holds it until shutdown: two runs started at once can never pick the same port.
        self._store = None
        self._init_method = parallel.init_method
        if not self._init_method:
            self._store, self._init_method = host_store(parallel.master_addr, parallel.world_size,
                                                        self.rpc_timeout_s)
        self._failure: BaseException | None = None
        self.workers: list[WorkerProcess] = []
        # Holds the list, not the executor: stops the processes if the executor is dropped unshut.
        self._finalizer = weakref.finalize(self, _stop_processes, self.workers, False)
        context = multiprocessing.get_context("spawn")
        log_level = logging.getLogger("novainfer").getEffectiveLevel()
        try:
            for rank in range(parallel.world_size):
                init_method, rank, local_rank = self._distributed_args(rank)
                driver_end, worker_end = context.Pipe()
                process = context.Process(target=run_worker, name=f"novainfer-worker-rank{rank}", daemon=True,
                                          args=(self.config, rank, local_rank, init_method, worker_end, log_level))
                process.start()
                worker_end.close()
                self.workers.append(WorkerProcess(rank, local_rank, process, driver_end))
            self._init_workers()
        except BaseException:
            self.shutdown()
            raise

    def _distributed_args(self, rank: int) -> tuple[str, int, int]:
        return self._init_method, rank, rank  # one node: local rank == rank

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    # ---- calls ------------------------------------------------------------------------------
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None, *, unique_reply_rank: int | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        if self._failure is not None:
            raise self._failure
        payload = pickle.dumps((method, args, kwargs or {}, unique_reply_rank), protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self.workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError:  # its end of the pipe is gone: so is the process
                self._fail(self._death_error(method, worker))
        repliers = self.workers if unique_reply_rank is None else [self.workers[unique_reply_rank]]
        results = self._collect(method, {w.rank for w in repliers}, timeout_s or self.rpc_timeout_s)
        return [results[w.rank] for w in repliers]

    def _collect(self, method: str | Callable[..., Any], waiting: set[int], timeout_s: float) -> dict[int, Any]:
        """The replies of the ranks in ``waiting``; fails on any error, death or timeout."""
        by_conn = {w.conn: w for w in self.workers}
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        deadline = time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        while waiting:
            remaining = deadline - time.monotonic()
            ready = wait_for_any([*by_conn, *by_sentinel], timeout=remaining) if remaining > 0 else []
            if not ready:
                self._fail(ExecutorTimeoutError(method, sorted(waiting), timeout_s))
            # Messages before deaths: a worker that failed and then died is described by its error.
            for conn in (r for r in ready if r in by_conn):
                worker = by_conn[conn]
                try:
                    ok, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death_error(method, worker))
                if not ok:
                    cause = _rebuild_exception(value)
                    error = WorkerError(method, worker.rank, worker.local_rank, cause)
                    error.__cause__ = cause
                    self._fail(error)
                results[worker.rank] = value
                waiting.discard(worker.rank)
            for sentinel in (r for r in ready if r in by_sentinel):
                self._fail(self._death_error(method, by_sentinel[sentinel]))
        return results

    def check_health(self) -> None:
        for worker in self.workers:
            if not worker.process.is_alive():
                self._fail(self._death_error("check_health", worker))
        super().check_health()

    # ---- failure and shutdown ----------------------------------------------------------------
    @staticmethod
    def _death_error(method: str | Callable[..., Any], worker: WorkerProcess) -> WorkerError:
        worker.process.join(1.0)  # the exit code is known once it is reaped
        code = worker.process.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return WorkerError(method, worker.rank, worker.local_rank,
                           RuntimeError(f"worker process pid={worker.process.pid} {how}"))

    def _fail(self, error: BaseException) -> NoReturn:
        """Stops every rank (the group is broken) and raises ``error``, now and on every later call."""
        logger.error("mp executor: %s; stopping every worker", error)
        self._failure = error
        _stop_processes(self.workers, graceful=False)
        raise error

    def shutdown(self) -> None:
        _stop_processes(self.workers, graceful=self._failure is None)
        self._finalizer.detach()
        self._store = None  # closes the rendezvous port
        if self._failure is None:
            self._failure = RuntimeError("the executor was shut down")


def _stop_processes(workers: list[WorkerProcess], graceful: bool) -> None:
    """Asks the workers to leave their group and exit (``graceful``); kills those still running.

    Killing is right for a broken group: its ranks are stuck in collectives (or stopped) and
    hold nothing that needs an orderly exit.
    """
    if graceful:
        for worker in workers:
            try:
                worker.conn.send_bytes(_STOP)
            except OSError:
                pass
        deadline = time.monotonic() + _SHUTDOWN_TIMEOUT_S
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
    deadline = time.monotonic() + _KILL_TIMEOUT_S
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():  # e.g. in uninterruptible sleep inside a driver call
            logger.error("worker rank=%d pid=%d is still alive after SIGKILL", worker.rank, worker.process.pid)
        worker.conn.close()


def _rebuild_exception(info: tuple[bytes | None, str, str, str]) -> BaseException:
    """The worker's exception: the original type when it survives pickling, else a RuntimeError."""
    pickled, type_name, message, text = info
    exc = None
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except Exception:  # e.g. an exception class whose constructor takes other arguments
            pass
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{type_name}: {message}")
    exc.__cause__ = RemoteTraceback(text)
    return exc


# ---- the worker process ------------------------------------------------------------------------
def run_worker(config: EngineConfig, rank: int, local_rank: int, init_method: str, conn: Connection,
               log_level: int) -> None:
    """Main function of a worker process: serves the driver's calls until told to stop."""
    exit_with_parent()
    configure_worker_logging(f"rank {rank}", log_level)
    if config.device.type == "cpu":
        # The ranks share the machine's cores instead of each starting a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel_config.world_size))
    worker = Worker(config, local_rank, rank, init_method, is_driver_worker=rank == 0)
    try:
        _serve(worker, conn)
    finally:
        try:
            worker.shutdown()
        except Exception:
            logger.exception("worker rank=%d: leaving the process group failed", rank)
        conn.close()


def _serve(worker: Worker, conn: Connection) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the driver is gone
            return
        if message is None:
            return
        method, args, kwargs, unique_reply_rank = message
        try:
            result = worker.execute_method(method, *args, **kwargs)
        except Exception as exc:
            logger.exception("worker rank=%d local_rank=%d failed in %s", worker.rank, worker.local_rank,
                             method_name(method))
            conn.send_bytes(pickle.dumps((False, _describe_exception(exc)), protocol=pickle.HIGHEST_PROTOCOL))
            continue
        if unique_reply_rank is None or unique_reply_rank == worker.rank:
            conn.send_bytes(pickle.dumps((True, result), protocol=pickle.HIGHEST_PROTOCOL))


def _describe_exception(exc: Exception) -> tuple[bytes | None, str, str, str]:
    try:
        pickled = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pickled = None
    return pickled, type(exc).__name__, str(exc), traceback.format_exc()


def exit_with_parent() -> None:
    """Ends this process when its parent (the driver) dies, even while it is stuck in a collective."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="novainfer-parent-watch", daemon=True).start()


def configure_worker_logging(label: str, level: int) -> None:
    """Log lines of a child process, marked with what it is (``rank 1``, ``engine core``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{label} pid %(process)d] "
                                           f"%(name)s: %(message)s"))
    package = logging.getLogger("novainfer")
    package.addHandler(handler)
    package.setLevel(level)
