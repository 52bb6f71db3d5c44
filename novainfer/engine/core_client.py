"""The front-end's handle on an engine core that runs its own loop: in an engine-core process
(spawned and supervised here) or in a thread of this process, joined by two ZMQ sockets.

The client binds both sockets (on ``ipc://`` paths in a private temporary directory), starts the
core, and waits for its :class:`CoreReady`. Requests and aborts go out in batches; each core step
comes back as one :class:`EngineCoreOutputs`. If the core dies (a step raised, the process was
killed), :meth:`CoreClient.get_output` raises :class:`EngineDeadError` naming the cause.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from novainfer.config import EngineConfig
from novainfer.core.messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreStats
from novainfer.engine.core import EngineCore, EngineCoreInfo
from novainfer.engine.core_proc import Channel, start_core_process, start_core_thread
from novainfer.engine.serial import CoreFailed, CoreReady, InputEncoder, PrefixCacheReset, StepOutputs, \
    core_message_decoder

logger = logging.getLogger(__name__)

# How often a receiver waiting for the core checks that it is still alive.
_LIVENESS_POLL_MS = 100
# Shutdown: how long the core gets to stop by itself, then after SIGTERM, before SIGKILL.
_STOP_GRACE_S = 5.0
# How long a send waits for a core that closed its end of the requests' socket to exit.
_NO_PEER_GRACE_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine core failed (or was shut down); no request can be served by it any more."""


def _shutdown_at_exit(client: CoreClient) -> Callable[[], None]:
    """An exit handler that shuts ``client`` down if it is still alive then (held weakly).

    At exit multiprocessing joins every non-daemon child before this process ends, while an engine
    core process waits for this one to end: a script that never called shutdown() would hang. Exit
    handlers run last registered first, and multiprocessing's own is registered by the time a
    process has started, so this one, registered after, stops the core before that join."""
    ref = weakref.ref(client)

    def shutdown() -> None:
        alive = ref()
        if alive is not None:
            alive.shutdown()

    return shutdown


def _stop_process(process: multiprocessing.process.BaseProcess) -> None:
    """Stops an engine-core process whose client was collected without shutdown() (SIGTERM lets the
    core release its workers and device memory), so that a dropped LLM frees its GPU."""
    if process.is_alive():
        process.terminate()
        process.join(_STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join(_STOP_GRACE_S)


def _pid_exists(pid: int) -> bool:
    """Whether a process of this id exists (a core whose parent is another process: that parent
    reaps it as soon as it dies, so a dead one does not linger as a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


@dataclass(frozen=True)
class CoreHandle:
    """An engine core started by another process (the supervisor of several API server processes)
    that connects to ``channel``, which the client attached to it binds."""

    config: EngineConfig
    channel: Channel
    pid: int


class CoreClient:
    """Starts an engine core and talks to it. ``in_thread`` runs the core in this process (its
    ``engine_core`` is then reachable here); otherwise it runs in a spawned process, or, with
    ``attached``, it is a core started elsewhere, which this client neither starts nor stops."""

    def __init__(self, config: EngineConfig, log_stats_interval: float = 5.0, name: str = "engine",
                 in_thread: bool = False, attached: CoreHandle | None = None) -> None:
        self.name = name
        self._dir = None if attached is not None else tempfile.mkdtemp(prefix="novainfer-core-")
        channel = attached.channel if attached is not None else \
            (f"ipc://{Path(self._dir) / 'input'}", f"ipc://{Path(self._dir) / 'output'}")
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block on a full queue: the core drains it
        self._input.bind(channel[0])
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(channel[1])
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._encoder = InputEncoder()
        self._send_lock = threading.Lock()  # sends may come from any thread; the socket is not thread-safe
        self.engine_core: EngineCore | None = None
        self._attached_pid = attached.pid if attached is not None else None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._exit_handler: Callable[[], None] | None = None
        self._finalizer: weakref.finalize | None = None
        self._thread: threading.Thread | None = None
        self._loop = None
        self.dead_error: EngineDeadError | None = None
        self.stats = EngineCoreStats()
        self._closed = False
        try:
            if in_thread:
                self.engine_core = EngineCore(config, log_stats_interval=log_stats_interval)
                self._thread, self._loop = start_core_thread(self.engine_core, channel, name)
            elif attached is None:
                # shutdown() stops it, at the latest when this process exits.
                self._process = start_core_process(config, [channel], name, log_stats_interval)
                self._exit_handler = _shutdown_at_exit(self)
                atexit.register(self._exit_handler)
                self._finalizer = weakref.finalize(self, _stop_process, self._process)
                self._finalizer.atexit = False  # the exit handler above stops it then
            self.info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else self._attached_pid

    def _wait_ready(self) -> EngineCoreInfo:
        message = self._receive(timeout_s=None)
        if not isinstance(message, CoreReady):
            raise EngineDeadError(f"engine core '{self.name}' sent {type(message).__name__} before it was ready")
        return message.info

    # ---- sending -----------------------------------------------------------------------------
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(self._encoder.add(requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(self._encoder.abort(list(request_ids)))

    def _send(self, frame: bytes) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        with self._send_lock:
            # The queue has no bound, so a send finds no room only when the PUSH socket has no peer:
            # once the core has closed its end, which it does only as it stops. A blocking send would
            # then wait forever (and with it the event loop that called it, deaf even to SIGTERM):
            # the core gets a short grace to exit or reconnect, and otherwise counts as dead.
            deadline = time.monotonic() + _NO_PEER_GRACE_S
            while True:
                try:
                    self._input.send(frame, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    pass
                alive = self.is_alive()
                if not alive or time.monotonic() >= deadline:
                    self._die(f"stopped reading requests (pid {self.pid} still running)" if alive
                              else self._exit_description())
                    raise self.dead_error from None
                self._input.poll(_LIVENESS_POLL_MS, zmq.POLLOUT)

    # ---- receiving ---------------------------------------------------------------------------
    def is_alive(self) -> bool:
        if self.dead_error is not None:
            return False
        if self._attached_pid is not None:
            return _pid_exists(self._attached_pid)
        runner = self._process if self._process is not None else self._thread
        return runner is not None and runner.is_alive()

    @property
    def output_fd(self) -> int:
        """A file descriptor that turns readable when messages from the core may have come: ZMQ
        signals it once per change, so a reader woken by it takes every waiting message
        (``get_output(0)`` until None) before it waits again."""
        return self._output.getsockopt(zmq.FD)

    def check_alive(self) -> None:
        """Raises EngineDeadError if the core is gone, for receivers that wait on :attr:`output_fd`
        (a killed core sends nothing)."""
        if self.dead_error is None and not self.is_alive():
            self._die(self._exit_description())
        if self.dead_error is not None:
            raise self.dead_error

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        """The next step's outputs (None if none came within ``timeout_s``; 0: only one already
        here, without looking whether the core lives); raises EngineDeadError once the core is
        gone. Called from one thread only."""
        message = self._receive_waiting() if timeout_s == 0 else self._receive(timeout_s)
        return None if message is None else self._step_outputs(message)

    def _step_outputs(self, message: StepOutputs | CoreReady | PrefixCacheReset) -> EngineCoreOutputs:
        if not isinstance(message, StepOutputs):
            raise EngineDeadError(f"engine core '{self.name}' sent an unexpected {type(message).__name__}")
        outputs = message.outputs
        if outputs.stats is not None:
            self.stats = outputs.stats
        return outputs

    def _receive(self, timeout_s: float | None) -> StepOutputs | CoreReady | PrefixCacheReset | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.dead_error is not None:
                raise self.dead_error
            wait_ms = _LIVENESS_POLL_MS
            if deadline is not None:
                wait_ms = max(0, min(wait_ms, int(1000 * (deadline - time.monotonic()))))
            if self._poller.poll(wait_ms):
                message = self._receive_waiting()
                if message is not None:
                    return message
                continue
            if not self.is_alive():
                self._die(self._exit_description())
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _receive_waiting(self) -> StepOutputs | CoreReady | PrefixCacheReset | None:
        """A message already waiting, if there is one."""
        if self.dead_error is not None:
            raise self.dead_error
        try:
            frame = self._output.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        message = core_message_decoder.decode(frame.buffer)
        if isinstance(message, CoreFailed):
            self._die(f"failed: {message.error}")
            raise self.dead_error
        return message

    def _exit_description(self) -> str:
        if self._closed:
            return "is shut down"
        if self._process is not None:
            code = self._process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return f"process (pid {self._process.pid}) died ({how})"
        if self._attached_pid is not None:
            return f"process (pid {self._attached_pid}) died"
        return "thread stopped"

    def _die(self, description: str) -> None:
        error = EngineDeadError(f"engine core of '{self.name}' {description}")
        if self._loop is not None and self._loop.failure is not None:
            error.__cause__ = self._loop.failure
        self.dead_error = error
        logger.error("%s", error)

    def make_stats(self) -> EngineCoreStats:
        """The stats of the latest step received."""
        return self.stats

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the core (asking first, then SIGTERM, then SIGKILL) and removes the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._exit_handler is not None:
            atexit.unregister(self._exit_handler)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._attached_pid is None:  # an attached core serves other clients too: its starter stops it
            try:
                with self._send_lock:
                    self._input.send(self._encoder.shutdown(), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self._process is not None and self._process.pid is not None:
            self._process.join(_STOP_GRACE_S)
            if self._process.is_alive():
                logger.warning("engine core '%s' did not stop in %g s; terminating it", self.name, _STOP_GRACE_S)
                self._process.terminate()
                self._process.join(_STOP_GRACE_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(_STOP_GRACE_S)
        if self._thread is not None:
            self._thread.join(_STOP_GRACE_S)
        if self.engine_core is not None:
            try:
                self.engine_core.shutdown()
            except Exception:  # shutting down must not raise
                logger.exception("engine core '%s': executor shutdown failed", self.name)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class SyncMPClient(CoreClient):
    """The offline engine's core in a process of its own: ``step()`` returns the core's next step."""

    # step() returns empty-handed after this long, so callers can look at their own state.
    step_timeout_s = 1.0

    def __init__(self, config: EngineConfig, log_stats_interval: float = 5.0) -> None:
        self._received_early: deque[EngineCoreOutputs] = deque()  # steps that came before a reply
        super().__init__(config, log_stats_interval, name="offline")

    def step(self) -> EngineCoreOutputs:
        if self._received_early:
            return self._received_early.popleft()
        outputs = self.get_output(self.step_timeout_s)
        return outputs if outputs is not None else EngineCoreOutputs(timestamp=time.time())

    def reset_prefix_cache(self) -> bool:
        """Empties the core's prefix cache (see ``EngineCore.reset_prefix_cache``) and waits for its
        answer; the steps' outputs that arrive first are kept for :meth:`step`."""
        self._send(self._encoder.reset_prefix_cache())
        while True:
            message = self._receive(timeout_s=None)
            if isinstance(message, PrefixCacheReset):
                return message.done
            self._received_early.append(self._step_outputs(message))
