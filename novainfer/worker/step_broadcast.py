"""Hands one step, staged once by the driver rank, to the other ranks of a ``uni`` executor.

Ranks that are threads of one process need not each rebuild a step's inputs from the scheduler
output, keep their own copy of every request, and sample tokens that only rank 0 returns: that
host work runs under one GIL, so it would add up over the ranks. The driver rank stages the step
into its pinned host buffer and publishes it here; every other rank copies those bytes to its own
device and runs its shard of the forward pass.

A step that is only a copy and a CUDA-graph replay on every rank (a decode step: its collectives
are inside the graphs) the driver launches on every device itself, from its own thread, so that
no rank waits for another rank's thread to get the GIL; the other ranks then have nothing to do.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from novainfer.distributed import CollectiveAbortedError
from novainfer.worker.model_runner import ModelRunner, StagedStep


class StepBroadcast:
    """One step's hand-off from the driver rank to the others: published once, read by each.

    ``followers``: the other ranks' runners, for the steps the driver launches on their devices.
    """

    def __init__(self, timeout_s: float, followers: Sequence[ModelRunner] = ()) -> None:
        self.timeout_s = timeout_s
        self.followers = list(followers)
        self._ready = threading.Event()
        self._step: StagedStep | None = None
        self._abandoned = False

    def publish(self, step: StagedStep | None) -> None:
        """Makes the step (None: an empty step, nothing to run) available to the waiting ranks, or
        launches it on their devices when it is a graph replay only."""
        if step is not None:
            step.copy_previous_tokens([runner.device for runner in self.followers])
        if step is not None and self.followers and all(r.is_replay_only(step) for r in self.followers):
            for runner in self.followers:
                with torch.cuda.device(runner.device):
                    runner.run_staged(step)
            step = None  # launched: the waiting ranks have nothing left to run
        self._step = step
        self._ready.set()

    def abandon(self) -> None:
        """The driver failed before staging the step: waiting ranks leave without running it."""
        if not self._ready.is_set():
            self._abandoned = True
            self._ready.set()

    def wait(self) -> StagedStep | None:
        """The published step; raises if the driver abandoned it or did not publish in time."""
        if not self._ready.wait(self.timeout_s):
            raise TimeoutError(f"the driver rank did not stage the step within {self.timeout_s:g} s")
        if self._abandoned:
            raise CollectiveAbortedError("the driver rank failed before staging the step")
        return self._step
