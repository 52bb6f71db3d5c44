"""``ProcessGroupFactory``: the one place that creates, finds and releases process groups.

InfiniTrain's ``ProcessGroupFactory::Instance / GetOrCreate / GetDefaultProcessGroup`` in Python.
A group is identified by its ``init_method`` (the rendezvous: ``tcp://host:port`` between
processes, ``inproc://<id>`` between the threads of one process), its ``name`` and the caller's
``rank``. Several engines can therefore live in one process with groups of the same name.
"""

from __future__ import annotations

import threading

import torch

from novainfer.distributed.in_process import InProcessRendezvous, ThreadProcessGroup
from novainfer.distributed.process_group import ProcessGroup

# Backends: ranks as threads of this process on CPU ("threads") or on GPUs ("cupy-nccl"), or one
# rank per process through torch.distributed ("gloo", "nccl").
IN_PROCESS_BACKENDS = ("threads", "cupy-nccl")
PROCESS_BACKENDS = ("gloo", "nccl")
# How long a rank waits for the others in one collective (torch.distributed's default for Gloo).
DEFAULT_TIMEOUT_S = 1800.0


class ProcessGroupFactory:
    _instance: ProcessGroupFactory | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, str, int], ProcessGroup] = {}
        self._rendezvous: dict[tuple[str, str], InProcessRendezvous] = {}
        self._defaults: dict[int, ProcessGroup] = {}  # thread id -> that thread's default group

    @classmethod
    def instance(cls) -> ProcessGroupFactory:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def get_or_create(self, name: str, *, backend: str, rank: int, world_size: int, device: torch.device,
                      init_method: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ProcessGroup:
        """This rank's member of group ``name``; creating it waits until every rank has joined.

        The first group a thread obtains becomes that thread's default group.
        """
        if backend not in IN_PROCESS_BACKENDS + PROCESS_BACKENDS:
            raise ValueError(f"backend must be one of {list(IN_PROCESS_BACKENDS + PROCESS_BACKENDS)}, "
                             f"got {backend!r}")
        key = (init_method, name, rank)
        with self._lock:
            group = self._groups.get(key)
            if group is None and backend in IN_PROCESS_BACKENDS:
                rendezvous = self._rendezvous.setdefault(
                    (init_method, name), InProcessRendezvous(name, world_size, timeout_s))
        if group is None:
            # Outside the lock: creation blocks until the other ranks (threads) arrive.
            group = self._create(name, backend, rank, world_size, device, init_method, timeout_s,
                                 rendezvous if backend in IN_PROCESS_BACKENDS else None)
            with self._lock:
                self._groups[key] = group
        if group.world_size != world_size:
            raise ValueError(f"group {name!r} has world_size {group.world_size}, requested {world_size}")
        with self._lock:
            self._defaults.setdefault(threading.get_ident(), group)
        return group

    @staticmethod
    def _create(name: str, backend: str, rank: int, world_size: int, device: torch.device, init_method: str,
                timeout_s: float, rendezvous: InProcessRendezvous | None) -> ProcessGroup:
        if backend == "threads":
            return ThreadProcessGroup(name, rank, world_size, rendezvous, device)
        if backend == "cupy-nccl":
            from novainfer.distributed.cupy_nccl import CupyNcclProcessGroup

            return CupyNcclProcessGroup(name, rank, world_size, device, rendezvous)
        from novainfer.distributed.torch_distributed import TorchDistributedProcessGroup

        return TorchDistributedProcessGroup(name, rank, world_size, device, backend, init_method, timeout_s)

    def get_default_process_group(self) -> ProcessGroup:
        """The group this thread's rank obtained first (the world group: tensor parallel spans it)."""
        with self._lock:
            group = self._defaults.get(threading.get_ident())
        if group is None:
            raise RuntimeError("no process group has been created on this thread")
        return group

    def abort(self, init_method: str) -> None:
        """Fails every in-process collective (and group creation) waiting under ``init_method``."""
        with self._lock:
            groups = [g for (method, _, _), g in self._groups.items() if method == init_method]
            rendezvous = [r for (method, _), r in self._rendezvous.items() if method == init_method]
        for r in rendezvous:
            r.abort()
        for group in groups:
            group.abort()

    def destroy(self, group: ProcessGroup) -> None:
        """Releases ``group`` (this rank's member) and forgets it."""
        with self._lock:
            keys = [key for key, g in self._groups.items() if g is group]
            for key in keys:
                del self._groups[key]
                init_method, name, _ = key
                if not any(k[:2] == (init_method, name) for k in self._groups):
                    self._rendezvous.pop((init_method, name), None)
            # Whichever thread destroys it: rank threads of a failed executor do not get to.
            for thread_id in [t for t, g in self._defaults.items() if g is group]:
                del self._defaults[thread_id]
        group.close_custom_all_reduce()
        group.shutdown()
