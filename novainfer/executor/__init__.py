from novainfer.executor.abstract import Executor, ExecutorTimeoutError, WorkerError

__all__ = ["Executor", "ExecutorTimeoutError", "WorkerError"]
