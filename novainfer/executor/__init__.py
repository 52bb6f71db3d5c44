from novainfer.executor.abstract import Executor, WorkerError

__all__ = ["Executor", "WorkerError"]
